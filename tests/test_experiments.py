"""DVC experiments keep their runs: every experiment DVC runs (in the workspace, queued, in a temporary copy) logs to
the project's MLflow store and registry, its runs carry the experiment's name, and `dvc exp apply` leaves `dvc
status` clean (register's registration.json is a cached output)."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from conftest import PROJECT_ROOT, VENV_BIN, make_project, run_ok

MODEL = "exp-test"
# Each stage's model scores best on another metric, so each experiment's `-S register.metric=...` registers another
# model: grpo on task accuracy, pretrain on bits/char, dpo on preference accuracy.
# grpo within 5% of pretrain's bits/char (the gate's forgetting rule); dpo 15% above it: it forgets
METRICS = {"pretrain": (0.10, 2.0, 0.50), "sft": (0.20, 2.2, 0.55), "dpo": (0.30, 2.3, 0.70),
           "grpo": (0.40, 2.05, 0.60)}


def test_tracking_uri_of_a_dvc_temporary_workspace_is_the_projects(tmp_path, monkeypatch):
    from tasks.run.schema import Params
    from tasks.run.tracking import tracking_uri

    workspace = tmp_path / ".dvc/tmp/exps/tmpabc123"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # what DVC sets for a queued or --temp experiment's stages
    assert tracking_uri(Params(), workspace) == f"sqlite:///{tmp_path.resolve()}/mlflow/mlflow.db"
    relative = Params(tracking={"uri": "sqlite:///store/runs.db"})
    assert tracking_uri(relative, workspace) == f"sqlite:///{tmp_path.resolve()}/store/runs.db"
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "elsewhere"))  # not this workspace's repository: its own dir
    assert tracking_uri(Params(), workspace) == f"sqlite:///{workspace.resolve()}/mlflow/mlflow.db"
    assert tracking_uri(Params(tracking={"uri": "http://127.0.0.1:5000"}), workspace) == "http://127.0.0.1:5000"


def _fake_upstream(repo, tokenizer) -> None:
    """Every output of the stages before register, as dvc.yaml lists them: tiny random models for the training
    stages, evaluate's metrics.json with METRICS, placeholders for the rest (register reads none of them)."""
    import torch

    from astrai_core.checkpoint.model_dir import save_checkpoint
    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        for out in stage.get("outs", []) + stage.get("metrics", []):
            path = repo / (out if isinstance(out, str) else next(iter(out)))
            if name == "register":
                continue
            if name in METRICS:
                torch.manual_seed(list(METRICS).index(name))
                save_checkpoint(path, Transformer(cfg), cfg, tokenizer)
            elif path.suffix:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("{}\n")
            else:
                path.mkdir(parents=True, exist_ok=True)
                (path / "placeholder.txt").write_text(name)
    metrics = {f"{s}/{m}": v for s, values in METRICS.items()
               for m, v in zip(("task_accuracy", "test_bits_per_char", "preference_accuracy"), values)}
    (repo / "data/evaluate/metrics.json").write_text(json.dumps(metrics))


@pytest.mark.integration
def test_queued_experiments_log_to_the_project_store_and_apply_cleanly(tmp_path, core_tiny_data):
    import mlflow

    from tasks.run.params import load_params

    repo = tmp_path / "project"
    env = make_project(repo, tmp_path / "remote", MODEL)
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's default store: mlflow/mlflow.db in the repository
    env.pop("MLFLOW_RUN_ID", None)
    env["PYTHONPATH"] = str(repo)
    dvc = [VENV_BIN / "dvc"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["register"]["metric"] = "task_accuracy"  # the default; the queued experiments change it
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _fake_upstream(repo, core_tiny_data["tokenizer"])
    upstream = [s for s in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"] if s != "register"]
    run_ok(dvc + ["commit", "-f", "-q", *upstream], repo, env)  # recorded as run: only register is left to run
    run_ok(["git", "add", "dvc.lock", "params.yaml"], repo, env)
    run_ok(["git", "commit", "-q", "-m", "upstream outputs"], repo, env)
    original = load_params(repo / "params.yaml")

    run_ok(dvc + ["exp", "run", "-n", "base"], repo, env)  # in the workspace: register alone runs
    for name, metric in (("bpc", "test_bits_per_char"), ("pref", "preference_accuracy")):
        run_ok(dvc + ["exp", "run", "--queue", "-n", name, "-S", f"register.metric={metric}"], repo, env)
    start = time.monotonic()
    out = run_ok(dvc + ["exp", "run", "--run-all"], repo, env)  # each in a temporary copy under .dvc/tmp/exps
    print(f"dvc exp run --run-all (2 queued experiments): {time.monotonic() - start:.1f} s")
    assert not (repo / ".dvc/tmp/exps").exists() or not list((repo / ".dvc/tmp/exps").glob("tmp*")), out
    # The README's view (issue 50, 7): the changed params and metrics (here only register.metric: upstream is the same
    # in all three), no code or data hashes, every cell whole at 120 columns (plain `dvc exp show` was 206 columns of
    # "…").
    view = run_ok(dvc + ["exp", "show", "--only-changed", "--drop", "(astrai_core|tasks|evals|data)/", "--no-pager"],
                  repo, {**env, "COLUMNS": "120"})
    assert [line for line in view.splitlines() if "…" in line] == [] and "register.metric" in view, view
    assert not any(dep in view for dep in ("tasks/", "astrai_core/", "data/")), view

    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow/mlflow.db'}")
    exp = client.get_experiment_by_name("astrai")
    runs = {r.data.tags.get("astrai.dvc_experiment"): r for r in
            client.search_runs([exp.experiment_id], filter_string="tags.`astrai.stage` = 'register'")}
    assert set(runs) == {"base", "bpc", "pref"}, runs.keys()
    decisions = {name: run.data.tags["astrai.registration"] for name, run in runs.items()}
    assert decisions["base"] == "version 1 is champion: task_accuracy 0.4000 (no previous champion)"
    # The queued ones saw the registry the workspace's experiment wrote to (FIFO: bpc, then pref).
    assert decisions["bpc"].startswith("version 2 is champion: test_bits_per_char 2.0000 beats version 1's 2.0500")
    assert decisions["pref"].startswith("version 3 stays candidate: it forgets: test bits/char +15.0% over the model "
                                        "its chain started from"), decisions["pref"]
    versions = {str(v.version): v.tags for v in client.search_model_versions(f"name = '{MODEL}'")}
    assert {v: tags["dvc_experiment"] for v, tags in versions.items()} == {"1": "base", "2": "bpc", "3": "pref"}
    assert {v: tags["stage"] for v, tags in versions.items()} == {"1": "grpo", "2": "pretrain", "3": "dpo"}

    # `dvc exp apply`: the experiment's registration.json comes back with its dvc.lock, and DVC has nothing to do.
    run_ok(dvc + ["exp", "apply", "bpc"], repo, env)
    registration = json.loads((repo / "data/register/registration.json").read_text())
    assert (registration["version"], registration["metric"]) == (2, "test_bits_per_char")
    status = run_ok(dvc + ["status"], repo, env)
    assert "Data and pipelines are up to date." in status, status
    # DVC wrote params.yaml back through its own YAML writer (`null` shows as an empty value): the same params.
    applied = load_params(repo / "params.yaml")
    assert applied.register.metric == "test_bits_per_char"
    assert applied.model_copy(update={"register": original.register}) == original


def test_the_readmes_exp_show_drops_every_dependency_and_no_param_or_metric():
    """Issue 50 (7): the README's `dvc exp show` drops every dependency column (the code and data hashes that filled
    206 columns) and no param or headline metric: its --drop pattern, matched as DVC matches it (re.match on the
    column name), against dvc.yaml's deps, params.yaml's keys and the headline's names."""
    import re

    from tasks.stages.evaluate import HEADLINE

    line = next(ln for ln in (PROJECT_ROOT / "README.md").read_text().splitlines() if ln.startswith("dvc exp show"))
    drop = re.compile(re.search(r"--drop '([^']+)'", line)[1])
    deps = {d for stage in yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"].values()
            for d in stage.get("deps", [])}

    def keys(tree: dict, prefix: str = "") -> list[str]:
        return [k for key, v in tree.items()
                for k in (keys(v, f"{prefix}{key}.") if isinstance(v, dict) else [f"{prefix}{key}"])]

    assert deps and all(drop.match(d) for d in deps), sorted(d for d in deps if not drop.match(d))
    names = keys(yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())) + list(HEADLINE)
    assert not [n for n in names if drop.match(n)]
