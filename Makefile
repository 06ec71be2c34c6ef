# The front door. `make demo` runs the whole pipeline on the default corpus; `make test` runs the tests.
# Both create the virtual environment first (.venv, pinned by requirements.lock).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(CURDIR)/$(BIN):$(PATH)
export PREFECT_HOME ?= $(CURDIR)/.prefect
# What every entry point sets (telemetry off, MLflow's retries, ...), for the prefect, mlflow and dvc commands run
# here too: the one file astrai_core/runtime/env.py reads; its `export KEY ?= VALUE` lines keep a value the caller
# has set.
include astrai_core/runtime/env.defaults
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
POOL ?= astrai-local
# `make test` runs the test modules on this many processes (pytest-xdist; a module's tests stay on one): run one at
# a time, the suite kept 2 cores only 57 % busy (waiting for servers, rendezvous and timeouts). 3 on 2 cores was
# slower than 2: pytest 30 min 34 s against 27 min 48 s (`bash .ci/run` on fresh clones, the AVX-512 BF16 kind).
TEST_WORKERS ?= 2

.PHONY: setup demo test pipeline repro serve server worker deploy run-deployment deployment-name stop mlflow-ui \
  mlflow-server team-services team-services-stop bench llama-cpp clean

# uv installs the lock in about a quarter of pip's time (1 min against 3.7 on 2 cores). It reads no pip.conf, so it
# gets pip's configured find-links (where a machine keeps local wheels, e.g. a CPU build of torch).
UV := uv==0.13.9
FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
# A GPU machine: `make setup TORCH_BACKEND=auto` (or cu128, cu130, ...) takes torch from PyTorch's index for the
# machine's CUDA driver (uv's --torch-backend); empty, torch comes like every other package (a CPU build here).
TORCH_BACKEND ?=
$(BIN)/astrai: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(UV)
	$(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode $(addprefix --find-links ,$(FIND_LINKS)) \
	  $(addprefix --torch-backend ,$(TORCH_BACKEND)) -c requirements.lock -e '.[dev,eval,team]'
	touch $@

setup: $(BIN)/astrai  ## create .venv with every dependency

demo: setup  ## the main job: full pipeline on the default corpus, then where to look
	$(BIN)/astrai pipeline

pipeline: setup  ## the pipeline with a profile for this run: `make pipeline PROFILE=quick`
	$(BIN)/astrai pipeline $(if $(PROFILE),--profile $(PROFILE))

test: setup  ## the test suite (the tests marked alone last, with nothing beside them)
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not alone"
	$(BIN)/python -m pytest -q -m alone

repro: setup  ## the same stages through DVC
	$(BIN)/dvc repro

# The registered champion over HTTP (OpenAI- and Anthropic-compatible): `make serve SERVE_MODEL=models:/astrai/2
# SERVE_PORT=8001`; other options: `astrai serve --help`.
SERVE_MODEL ?= models:/astrai@champion
SERVE_PORT ?= 8000
serve: setup  ## serve SERVE_MODEL (default: the registry's champion) on http://127.0.0.1:$(SERVE_PORT)/v1
	$(BIN)/astrai serve --model '$(SERVE_MODEL)' --port $(SERVE_PORT)

# A long-lived Prefect server + process worker for `prefect deployment run` (stop both with `make stop`). The UI calls
# the API at PREFECT_SERVER_UI_API_URL, by default 127.0.0.1:4200 whatever --port says: set from PREFECT_PORT.
server: setup
	mkdir -p $(PREFECT_HOME)
	PREFECT_SERVER_UI_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api \
	  nohup $(BIN)/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT) > $(PREFECT_HOME)/server.log 2>&1 & echo $$! > $(PREFECT_HOME)/server.pid
	for i in $$(seq 60); do curl -sf http://127.0.0.1:$(PREFECT_PORT)/api/health >/dev/null && break; sleep 1; done
	@echo "Prefect UI: http://127.0.0.1:$(PREFECT_PORT)"

worker: setup
	PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(BIN)/prefect work-pool create $(POOL) --type process --overwrite >/dev/null
	PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api nohup $(BIN)/prefect worker start --pool $(POOL) > $(PREFECT_HOME)/worker.log 2>&1 & echo $$! > $(PREFECT_HOME)/worker.pid
	@echo "worker for pool $(POOL) started (log: $(PREFECT_HOME)/worker.log)"

# The deployment's name is this checkout's own: every checkout registers astrai-pipeline/DEPLOYMENT, pointing at its
# own directory, so one server holds a deployment per checkout and a run goes where its deployment was made (one
# name for all, the last checkout to deploy took everyone's runs). Default: user, folder and a short hash of the
# folder's path (two folders named alike stay apart); `make deploy DEPLOYMENT=NAME` picks another.
DEPLOYMENT ?= $(shell id -un)-$(notdir $(CURDIR))-$(shell printf %s '$(CURDIR)' | sha256sum | cut -c1-6)
# The Prefect server: PREFECT_API_URL's (the team's, after `eval "$$(astrai services env DIR)"`), else make server's.
API_URL = $${PREFECT_API_URL:-http://127.0.0.1:$(PREFECT_PORT)/api}

deploy: setup  ## register astrai-pipeline/DEPLOYMENT (this checkout's) with the Prefect server
	@case '$(DEPLOYMENT)' in ''|*[/%\&\<\>]*) echo "astrai: error: Makefile: DEPLOYMENT='$(DEPLOYMENT)': a deployment \
	name must be non-empty and have none of / % & < >" >&2; exit 2;; esac
	ASTRAI_PROJECT_DIR=$(CURDIR) ASTRAI_DEPLOYMENT='$(DEPLOYMENT)' PREFECT_API_URL=$(API_URL) \
	$(BIN)/prefect --no-prompt deploy --all
	@echo "run it: PREFECT_API_URL=$(API_URL) $(BIN)/prefect deployment run 'astrai-pipeline/$(DEPLOYMENT)' --watch" \
	  "(or: make run-deployment)"

# Without a server, prefect would print a traceback ("Timed out while attempting to connect ..."): say it in one line.
run-deployment:  ## run this checkout's deployment and watch it: `make run-deployment PROFILE=quick`
	@curl -sf $(API_URL)/health >/dev/null || { echo "astrai: error: Makefile: no Prefect server at $(API_URL); \
	start one, a worker and the deployment with: make server worker deploy" >&2; exit 1; }
	PREFECT_API_URL=$(API_URL) $(BIN)/prefect deployment run 'astrai-pipeline/$(DEPLOYMENT)' \
	  $(if $(PROFILE),-p profile=$(PROFILE)) --watch

# The deployment's name alone, for a `prefect deployment run` with other parameters.
deployment-name:
	@echo 'astrai-pipeline/$(DEPLOYMENT)'

# An idle worker passes SIGTERM on to its process worker as a SIGINT that it does not act on; a second signal makes
# it end that process (measured: TERM alone still running after 30 s; TERM, then INT 2 s later: gone in ~3 s).
stop:  ## stop the worker (SIGTERM, then SIGINT) and the server started above
	-@if [ -f $(PREFECT_HOME)/worker.pid ]; then pid=$$(cat $(PREFECT_HOME)/worker.pid); \
	  for sig in TERM INT; do kill -$$sig $$pid 2>/dev/null || break; \
	    for i in $$(seq 20); do kill -0 $$pid 2>/dev/null || break; sleep 0.1; done; done; \
	  for i in $$(seq 100); do kill -0 $$pid 2>/dev/null || break; sleep 0.1; done; \
	  rm -f $(PREFECT_HOME)/worker.pid; fi
	-@if [ -f $(PREFECT_HOME)/server.pid ]; then pid=$$(cat $(PREFECT_HOME)/server.pid); kill -TERM $$pid 2>/dev/null; \
	  for i in $$(seq 100); do kill -0 $$pid 2>/dev/null || break; sleep 0.1; done; rm -f $(PREFECT_HOME)/server.pid; fi
	@echo stopped

mlflow-ui: setup  ## the MLflow UI on http://127.0.0.1:$(MLFLOW_PORT)
	@echo "MLflow UI: http://127.0.0.1:$(MLFLOW_PORT) (MLflow 3 opens experiments on its GenAI pages: set the sidebar's switch to" \
	  "'Model training' once, or open the link \`astrai pipeline\` prints, ending in ?workflowType=machine_learning)"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow server --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1 \
	  --backend-store-uri sqlite:///$(CURDIR)/mlflow/mlflow.db --default-artifact-root $(CURDIR)/mlflow/artifacts

# The team's tracking server, for `cluster.launcher: slurm` (ranks on compute nodes log to it over HTTP): a database
# backend and an artifact root on storage every node reaches, e.g. `make mlflow-server
# MLFLOW_BACKEND=postgresql://user@db/mlflow MLFLOW_ARTIFACTS=s3://bucket/mlflow MLFLOW_HOST=0.0.0.0`; then
# `tracking.uri: http://<this host>:$(MLFLOW_PORT)` in params.yaml. Defaults: the project's sqlite and folder.
MLFLOW_HOST ?= 127.0.0.1
MLFLOW_BACKEND ?= sqlite:///$(CURDIR)/mlflow/mlflow.db
MLFLOW_ARTIFACTS ?= $(CURDIR)/mlflow/artifacts
mlflow-server: setup  ## MLflow tracking server for the cluster: MLFLOW_BACKEND, MLFLOW_ARTIFACTS, MLFLOW_HOST
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow server --host $(MLFLOW_HOST) --port $(MLFLOW_PORT) \
	  --workers 1 --backend-store-uri $(MLFLOW_BACKEND) --artifacts-destination $(MLFLOW_ARTIFACTS)

# The team services on PostgreSQL (docs/scaling-out.md, "Team setup"): a trial PostgreSQL in TEAM_DIR, or the team's
# with TEAM_POSTGRES=postgresql://USER:PASS@HOST:PORT; the MLflow and Prefect servers on it and a process worker.
# Ports: TEAM_POSTGRES_PORT (the trial PostgreSQL's), MLFLOW_PORT, PREFECT_PORT.
# Then `eval "$$(.venv/bin/astrai services env TEAM_DIR)"` points a shell at them.
TEAM_DIR ?= $(CURDIR)/.astrai/team
TEAM_HOST ?= 127.0.0.1
TEAM_POSTGRES ?=
TEAM_POSTGRES_PORT ?= 5432
team-services: setup  ## PostgreSQL + MLflow + Prefect + worker for a team: TEAM_DIR, TEAM_HOST, TEAM_POSTGRES(_PORT)
	$(BIN)/astrai services start $(TEAM_DIR) --host $(TEAM_HOST) --pg-port $(TEAM_POSTGRES_PORT) \
	  --mlflow-port $(MLFLOW_PORT) --prefect-port $(PREFECT_PORT) --pool $(POOL) \
	  $(if $(TEAM_POSTGRES),--postgres '$(TEAM_POSTGRES)')

team-services-stop:  ## stop what team-services started (the trial database's data stays in TEAM_DIR)
	$(BIN)/astrai services stop $(TEAM_DIR)

bench: setup
	$(BIN)/python bench/throughput.py

# llama.cpp (CPU) for GGUF files and tests/test_gguf.py, built from the pinned source outside the checkout
# (~/.cache/astrai/llama.cpp-<version>/bin; docs/architectures.md "GGUF and llama.cpp"); instant once built.
llama-cpp: setup  ## build llama.cpp's tools for `astrai export-gguf` files
	PYTHON=$(CURDIR)/$(BIN)/python scripts/build_llama_cpp.sh

clean:  ## remove generated data, the MLflow store and Prefect's home (not the venv)
	find data -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +  # every stage's output, checkpoints too
	rm -rf mlflow/mlflow.db mlflow/artifacts .prefect .astrai dvc_plots
