"""Shared pytest fixtures. Each helper area prefixes its fixtures (data_: corpus, tokenizer and pack stages)."""

# --- pipeline (end-to-end tests): a throwaway git + DVC project ------------------------------------------------

import contextlib as _contextlib
import os as _os
import shutil as _shutil
import subprocess as _subprocess
import sys as _sys
import threading as _threading
from pathlib import Path as _Path
import pytest as _pytest

from astrai_core.runtime import env as _env

if _os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs the modules on 2 workers (pytest-xdist, Makefile)
    # A Prefect home per worker: two workers' temporary Prefect servers never share one SQLite database.
    _home = _Path(_os.environ.get("PREFECT_HOME") or _Path.home() / ".prefect")
    _os.environ["PREFECT_HOME"] = str(_home / f"xdist-{_os.environ['PYTEST_XDIST_WORKER']}")
_env.apply()  # before anything imports Prefect, MLflow or DVC

PROJECT_ROOT = _Path(__file__).resolve().parents[1]
VENV_BIN = _Path(_sys.executable).parent

# A pipeline small enough for CI: 8 works cut to 30k characters, a 32-wide model, 30 steps on 2 torchrun ranks.
TINY_PARAMS = {
    "corpus": {"source": "shakespeare", "max_documents": 8, "max_chars_per_document": 30000,
               "validation_fraction": 0.15, "test_fraction": 0.15},
    "tokenizer": {"vocab_size": 384},
    "model": {"vocab_size": 384, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128},
    "pretrain": {"nproc": 2, "seq_len": 128, "batch_size": 4, "max_steps": 30, "dtype": "fp32",
                 "log_every": 5, "eval_every": 15, "eval_batches": 2,
                 "optim": {"lr": 0.01, "min_lr": 0.001, "warmup_steps": 5}},
    "evaluate": {"batch_size": 8, "max_new_tokens": 12, "prompts": ["ROMEO.\n"], "task_examples": 12},
    "chat_data": {"sft_examples": 48, "dpo_pairs": 32, "grpo_prompts": 24, "test_examples": 12, "max_chars": 300},
    "sft": {"nproc": 2, "batch_size": 2, "max_steps": 6, "dtype": "fp32", "log_every": 2, "eval_every": 3,
            "eval_batches": 1, "optim": {"warmup_steps": 6}},  # params.yaml's 10 would exceed the 6 steps
    "dpo": {"nproc": 2, "batch_size": 2, "max_steps": 4, "dtype": "fp32", "log_every": 2,
            "lora": {"rank": 4, "alpha": 8, "dropout": 0.0}},
    "grpo": {"nproc": 2, "batch_size": 2, "objective": {"group_size": 4, "max_new_tokens": 6}, "max_steps": 4,
             "dtype": "fp32", "log_every": 2},
}


def run_ok(cmd, cwd, env) -> str:
    out = _subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


def make_project(repo: _Path, remote: _Path, model_name: str, post_training: bool = True) -> dict:
    """Copy the pipeline's definition into `repo`, make it a git + DVC repo with tiny params; returns its env.
    post_training=False disables sft, dpo and grpo (for tests of an entry point, not of the stages: a minute less)."""
    import yaml

    from tasks.run.table import MODEL_STAGES

    repo.mkdir(parents=True, exist_ok=True)
    for name in ("dvc.yaml", ".gitignore", "prefect.yaml"):
        _shutil.copy(PROJECT_ROOT / name, repo / name)
    for pkg in ("astrai_core", "tasks", "flows", "evals"):  # dvc.yaml lists code files (and the lm-eval tasks) as deps
        # evals/: not the lm-eval data a run writes there (astrai_core/data/ is source)
        skip = ("__pycache__", "data") if pkg == "evals" else ("__pycache__",)
        _shutil.copytree(PROJECT_ROOT / pkg, repo / pkg, ignore=_shutil.ignore_patterns(*skip))
    params = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    # Registered by test bits/char: a model this tiny scores 0 on the tasks, and chosen by a task metric it would stay
    # candidate (tasks/stages/register.py no_skill); these projects test the registry and serving, which need a
    # champion.
    register = {"model_name": model_name, "metric": "test_bits_per_char"}
    off = {} if post_training else {kind: {**TINY_PARAMS[kind], "enabled": False} for kind in MODEL_STAGES[1:]}
    for section, values in {**TINY_PARAMS, "register": register, **off}.items():
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(params[section].get(key), dict):
                params[section][key].update(value)
            else:
                params[section][key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(_os.environ)
    env.update({"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                "GIT_COMMITTER_EMAIL": "t@t", "PATH": f"{VENV_BIN}{_os.pathsep}{env['PATH']}"})
    run_ok(["git", "init", "-q", "-b", "main"], repo, env)
    run_ok([VENV_BIN / "dvc", "init", "-q"], repo, env)
    run_ok([VENV_BIN / "dvc", "config", "core.analytics", "false"], repo, env)
    run_ok([VENV_BIN / "dvc", "remote", "add", "-d", "local", str(remote)], repo, env)
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "commit", "-q", "-m", "pipeline"], repo, env)
    return env



def make_deploy(repo: _Path, env: dict, *prefix: str) -> str:
    """`make deploy` in `repo` (a make_project checkout) with this checkout's Makefile and venv, as a user runs it in
    theirs (prefix: e.g. a network namespace's command to run it in); returns the deployment it printed the command
    for, astrai-pipeline/NAME."""
    import re

    venv = VENV_BIN.parent
    out = run_ok([*prefix, "make", "-s", "-f", PROJECT_ROOT / "Makefile", f"VENV={venv}", "-o", venv / "bin/astrai",
                  "deploy"], repo, env)
    printed = re.search(r"prefect deployment run '(astrai-pipeline/[^']+)' --watch", out)
    assert printed, f"make deploy printed no command to run the deployment:\n{out}"
    return printed[1]


def make_quick_project(tmp_path: _Path) -> tuple[_Path, dict]:
    """A project for `astrai pipeline --profile quick`: the real params.yaml and profiles/, MLflow in tmp_path, a
    temporary Prefect server per run. Returns (repo, env)."""
    repo = tmp_path / "project"
    env = make_project(repo, tmp_path / "remote", "unused")
    _shutil.copy(PROJECT_ROOT / "params.yaml", repo / "params.yaml")
    _shutil.copytree(PROJECT_ROOT / "profiles", repo / "profiles")
    env.update({"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONPATH": str(repo)})
    env.pop("PREFECT_API_URL", None)
    return repo, env

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(model: _Path, cwd: _Path, *options: str, timeout: float = 300) -> tuple[_subprocess.Popen, str]:
    """`astrai serve --model MODEL` (one torch thread) in its own process group, once /health answers: (process, base
    URL). Its log is cwd/serve.log; a server that exits first fails with the log's end. Stop it with stop_group."""
    import time

    import httpx

    port = free_port()
    with open(cwd / "serve.log", "w") as log:
        proc = _subprocess.Popen([_sys.executable, "-m", "astrai.cli", "serve", "--model", str(model), "--port",
                                  str(port), "--no-compile", *options], cwd=cwd, env={**_os.environ, "OMP_NUM_THREADS": "1"},
                                 stdout=log, stderr=_subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_group(proc)
            raise AssertionError(f"astrai serve did not start:\n{(cwd / 'serve.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)


def stop_group(proc: _subprocess.Popen, timeout: float = 30) -> None:
    """End `proc` (started with start_new_session) and its process group: SIGTERM, SIGKILL after `timeout` s."""
    import signal

    if proc.poll() is not None:
        return
    _os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except _subprocess.TimeoutExpired:
        _os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@_contextlib.contextmanager
def prefect_server(home: _Path, port: int, env: dict):
    """`prefect server start` on 127.0.0.1:PORT in its own process group, healthy (its log: home/server.log);
    stopped on leaving."""
    from astrai.services import wait_healthy

    home.mkdir(parents=True, exist_ok=True)
    server = _subprocess.Popen([VENV_BIN / "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                               cwd=home, env=env, stdout=open(home / "server.log", "w"), stderr=_subprocess.STDOUT,
                               start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/api/health", server.pid, home / "server.log")
        yield server
    finally:
        stop_group(server)


def lines_until(proc: _subprocess.Popen, marker: str, timeout: float) -> list[str]:
    """`proc`'s output lines up to the first one containing `marker`; fails after `timeout` seconds without it, so
    that a process that never gets there (a Slurm job that never starts) cannot hold the test."""
    seen, found = [], _threading.Event()

    def read() -> None:
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                found.set()
                return

    reader = _threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found.is_set(), f"no {marker!r} within {timeout:.0f} s:\n" + "".join(seen[-30:])
    return seen


def served_completion(base_url: str, model: str, api_key: str | None = None) -> dict:
    """The JSON answer of `astrai serve` at base_url to a short /v1/completions request for `model`."""
    import json
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(f"{base_url}/v1/completions", method="POST", headers=headers,
                                 data=json.dumps({"model": model, "prompt": "ROMEO.\n", "max_tokens": 8}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


# --- the order: the long modules first ----------------------------------------------------------------------------

import pytest


def pytest_collection_modifyitems(items):
    """The modules marked integration as a whole (pytestmark: whole pipelines, clusters, servers; minutes each) first,
    the rest after in their order: on `make test`'s 2 workers the long ones then start at once, not last."""
    items.sort(key=lambda item: item.getparent(pytest.Module).get_closest_marker("integration") is None)  # stable


# --- MLflow's process-global tracking URI: each test starts where the last one started ---------------------------

@pytest.fixture(autouse=True)
def _mlflow_tracking_uri_restored():
    """`mlflow.set_tracking_uri` sets a module global that wins over MLFLOW_TRACKING_URI, and writes that variable too:
    a URI one test sets would otherwise send a later test's `MlflowClient()` to a store of the earlier test's."""
    yield
    utils = _sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None:
        utils._tracking_uri = None
    if _os.environ.get("MLFLOW_TRACKING_URI") != _TRACKING_URI_AT_START:
        _os.environ.pop("MLFLOW_TRACKING_URI", None)
        if _TRACKING_URI_AT_START is not None:
            _os.environ["MLFLOW_TRACKING_URI"] = _TRACKING_URI_AT_START


_TRACKING_URI_AT_START = _os.environ.get("MLFLOW_TRACKING_URI")


# --- data stages (corpus, tokenizer, pack): fixtures prefixed data_ ---------------------------------------------

import json

import pytest

DATA_SAMPLE_TEXTS = {
    "a.txt": "ROMEO.\nBut soft, what light through yonder window breaks?\n",
    "b.txt": "  Leading spaces, tabs\tand\n\nblank lines.\n",
    "c.txt": "中文测试：你好，世界。\n",
    "d.txt": "Emoji 👍🏽🎉 and accents: café, naïve.\n",
    "nested/e.txt": "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\n",
}


@pytest.fixture(scope="session")
def data_tokenizer():
    """A small byte-level BPE trained on mixed-script text (well under a second)."""
    from astrai_core.tokenizer.bpe import train_tokenizer

    return train_tokenizer(list(DATA_SAMPLE_TEXTS.values()) * 20, vocab_size=320, min_frequency=2)


@pytest.fixture
def data_source_dir(tmp_path):
    """A directory corpus: five .txt documents (one nested) and a .jsonl file holding three more."""
    src = tmp_path / "src"
    for name, text in DATA_SAMPLE_TEXTS.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text, encoding="utf-8")
    records = [{"text": f"Document {i} from jsonl: the quick brown fox.\n"} for i in range(3)]
    (src / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return src


# --- training core (model, train, checkpoint): fixtures and helpers prefixed core_ -----------------------------

import random
from pathlib import Path


def _core_text(n_sentences: int, seed: int) -> str:
    """Tiny English-like text with structure a 2-layer model picks up within 20 steps."""
    rng = random.Random(seed)
    subjects = ["the king", "a queen", "my lord", "the fool", "sweet romeo", "fair juliet"]
    verbs = ["speaks to", "loves", "follows", "betrays", "sings for", "waits for"]
    objects = ["the crown.", "his horse.", "the night.", "her brother.", "the people.", "a ghost."]
    return "\n".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}" for _ in range(n_sentences))


def _core_write_packed(path, ids, *, tokenizer_sha256: str, vocab_size: int, split: str = "train") -> Path:
    """Write token ids as a packed HDF5 file (one document)."""
    from astrai_core.data.packed import PackedWriter

    with PackedWriter(path, vocab_size=vocab_size, tokenizer_sha256=tokenizer_sha256,
                      source_manifest_sha256="0" * 64, split=split) as w:
        w.add_document(ids)
    return Path(path)


@pytest.fixture(scope="session")
def core_write_packed():
    """The packed-file writer above: core_write_packed(path, ids, tokenizer_sha256=..., vocab_size=...)."""
    return _core_write_packed


@pytest.fixture(scope="session")
def core_tiny_data(tmp_path_factory) -> dict:
    """A byte-level BPE tokenizer (vocab 300) and train/val packed files: {"tokenizer", "train", "val", "vocab_size"}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from astrai_core.runtime.io import sha256_file

    root = tmp_path_factory.mktemp("core_data")
    vocab_size = 300
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end_of_text|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_core_text(2000, 0)], trainer=trainer)
    tok_path = root / "tokenizer.json"
    tok.save(str(tok_path))
    sha = sha256_file(tok_path)
    out = {"tokenizer": tok_path, "vocab_size": vocab_size, "tokenizer_obj": tok}
    for split, seed, n in (("train", 1, 3000), ("val", 2, 300)):
        ids = tok.encode(_core_text(n, seed)).ids
        out[split] = _core_write_packed(root / f"{split}.h5", ids, tokenizer_sha256=sha, vocab_size=vocab_size,
                                       split=split)
    return out


# --- generation and serving tests: a random model whose greedy choices are rarely near-ties ------------------------

def sharp_random_model(**cfg):
    """A seeded random Transformer with its weights scaled up x3: sharper, less tie-prone next-token distributions,
    so greedy outputs compared across code paths differ only if the arithmetic does."""
    import torch

    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


class Collector:
    """on_event for one engine request (Engine or EngineProcess): the tokens and every finish reason it was sent,
    and the logprobs (None unless an event carried them: a request with logprobs or prompt_logprobs)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reasons: list[str] = []
        self.logprobs: list | None = None
        self.done = _threading.Event()

    def __call__(self, tokens: list[int], reason: str | None, *logprobs: list) -> None:
        if self.done.is_set():  # an event after the last one: the tests' exact reasons lists catch it
            reason = reason or "event after the last one"
        self.tokens += tokens
        if logprobs:
            self.logprobs = (self.logprobs or []) + logprobs[0]
        if reason is not None:
            self.reasons.append(reason)
            self.done.set()


@pytest.fixture(scope="session")
def tiny_trained(core_tiny_data, tmp_path_factory) -> Path:
    """A checkpoint the training core trained for 15 steps on core_tiny_data (Qwen3-like: qk_norm), trained once per
    session for the tests that register or export a trained model; copy it before writing beside it."""
    from astrai_core.training.config import TrainConfig
    from astrai_core.training.train import train

    out = tmp_path_factory.mktemp("tiny_trained") / "pretrain"
    cfg = TrainConfig.model_validate(dict(
        model=dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, qk_norm=True),
        optim=dict(lr=1e-2, min_lr=1e-3, warmup_steps=2), train_data=str(core_tiny_data["train"]),
        tokenizer=str(core_tiny_data["tokenizer"]), out_dir=str(out), seq_len=32, batch_size=8, max_steps=15,
        log_every=5, device="cpu"))
    saved = _os.environ.pop("MLFLOW_RUN_ID", None)  # trained outside any test's MLflow run
    try:
        train(cfg)
    finally:
        if saved is not None:
            _os.environ["MLFLOW_RUN_ID"] = saved
    return out
