"""`astrai promote SOURCE --to TARGET` (tasks/registry/promote.py): a registered version copied to another registered
model with its lineage tags and who promoted it from where, the target's alias moved to it, refused when it does not
beat that alias on the register gate unless forced. Real registrations (tasks/stages/register.py register) in a real
MLflow store (a sqlite file); the PostgreSQL-backed server, the registry lock and serving the target are in
tests/test_team_services.py."""

from __future__ import annotations

import getpass
import json
import random
import socket
import subprocess
import time

import pytest

from astrai_core.runtime.errors import AstraiError
from conftest import PROJECT_ROOT, VENV_BIN, free_port

N = 500  # items of the task, the same for every version
BASE = [i < 217 for i in range(N)]  # 0.434
random.Random(0).shuffle(BASE)
BETTER = list(BASE)  # 60 more items right: beyond the paired interval
for _i in [i for i, r in enumerate(BASE) if not r][:60]:
    BETTER[_i] = True


@pytest.fixture(scope="module")
def registry(tmp_path_factory, core_tiny_data) -> dict:
    """A sqlite MLflow store with three versions of model "g" registered by the register stage itself: 1 (BASE), 2
    (BETTER: champion) and 3 (no item right: no task better than chance, so register kept it candidate). Each test
    promotes into targets of its own names. {"store": the tracking URI, "root": the project directory}."""
    import mlflow
    import torch

    from astrai_core.checkpoint.model_dir import save_checkpoint
    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer
    from astrai_core.scoring.statistics import wilson_interval
    from tasks.run.schema import Params
    from tasks.run.table import model_dir
    from tasks.stages.register import register

    root = tmp_path_factory.mktemp("promote")
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)

    def register_version(seed: int, right: list[bool]) -> dict:
        torch.manual_seed(seed)
        save_checkpoint(model_dir(root, "sft"), Transformer(cfg), cfg, core_tiny_data["tokenizer"])
        k = sum(right)
        low, high = wilson_interval(k, N)
        (root / "metrics.json").write_text(json.dumps({
            "final_model": "sft", "sft/task_accuracy": k / N, "sft/task_accuracy_low": low,
            "sft/task_accuracy_high": high, "sft/test_bits_per_char": 2.0}))
        (root / "items.json").write_text(json.dumps({"task_accuracy": {"sft": [int(r) for r in right]},
                                                     "item_sets": {"task_accuracy": "the-same-500"}}))
        with mlflow.start_run(experiment_id=exp):
            return register(Params(register={"model_name": "g", "metric": "task_accuracy"}), root / "metrics.json",
                            root / "out", root)

    store = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_RUN_ID", raising=False)
        mp.delenv("ASTRAI_REGISTRY_LOCK_URI", raising=False)
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        mlflow.set_tracking_uri(store)  # conftest's autouse fixture unsets it after the test that made this
        exp = mlflow.create_experiment("promote", artifact_location=(root / "artifacts").as_uri())
        assert register_version(1, BASE)["aliases"] == ["candidate", "champion"]
        assert register_version(2, BETTER)["aliases"] == ["candidate", "champion"]  # g@champion: version 2
        unskilled = register_version(3, [False] * N)
        assert unskilled["aliases"] == ["candidate"] and "no task better than chance" in unskilled["decision"]
    return {"store": store, "root": root}


@pytest.fixture
def client(registry):
    import mlflow

    mlflow.set_tracking_uri(registry["store"])  # the gate reads the runs' items through it
    return mlflow.MlflowClient()


def cli(registry: dict, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`astrai promote ARGS` in its own process on the registry's store (this checkout's code: PYTHONPATH)."""
    return subprocess.run([str(VENV_BIN / "astrai"), "promote", *args], cwd=registry["root"], capture_output=True,
                          text=True, timeout=timeout,
                          env={"MLFLOW_TRACKING_URI": registry["store"], "PATH": str(VENV_BIN),
                               "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": str(PROJECT_ROOT), **(env or {})})


def registered_models(client) -> set[str]:
    return {m.name for m in client.search_registered_models()}


def test_promote_copies_with_lineage_and_moves_the_alias_only_past_the_gate(registry, client):
    from tasks.registry.promote import promote

    # The worse version first: the target has no champion, so it passes; a copy, lineage and all.
    line = promote(client, "models:/g/1", "g-prod")
    assert line.startswith("promoted models:/g/1 (models:/g/1): copied to g-prod version 1, now g-prod@champion")
    src, copy = client.get_model_version("g", "1"), client.get_model_version_by_alias("g-prod", "champion")
    assert str(copy.version) == "1"
    for tag in ("stage", "params_hash", "mlflow_run_id", "weights_sha256", "register_metric", "task_accuracy",
                "git_commit", "profile"):
        assert copy.tags[tag] == src.tags[tag], tag
    assert copy.tags["promoted_by"] == f"{getpass.getuser()}@{socket.gethostname()}"
    assert (copy.tags["promoted_from"], copy.tags["promoted_from_uri"]) == ("models:/g/1", "models:/g/1")
    assert copy.tags["promoted_at"].endswith("+00:00") and "g-prod has no champion" in copy.tags["promotion"]
    assert copy.run_id == src.run_id

    # The better one, by alias: it beats g-prod@champion on the paired interval (the per-item results of both
    # come from their registration runs, which the copy names), and takes the alias.
    line = promote(client, "models:/g@champion", "g-prod")
    assert "copied to g-prod version 2, now g-prod@champion" in line and "paired 95% interval" in line, line
    assert client.get_model_version("g-prod", "2").tags["promoted_from"] == "models:/g/2"

    # The worse one again, through the command: refused in one line, nothing copied, the alias stays.
    out = cli(registry, "models:/g/1", "--to", "g-prod")
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith("astrai: error: models:/g/1 not promoted to g-prod: fails the register gate "
                                 "against g-prod@champion (version 2): task_accuracy: -0.1200, paired 95% "
                                 "interval"), out.stderr
    assert out.stderr.count("\n") == 1 and "--force" in out.stderr, out.stderr
    assert len(client.search_model_versions("name = 'g-prod'")) == 2
    assert str(client.get_model_version_by_alias("g-prod", "champion").version) == "2"

    # --force: its weights are in g-prod already (version 1), so the alias moves there, nothing copied.
    out = cli(registry, "models:/g/1", "--to", "g-prod", "--force")
    assert out.returncode == 0, out
    assert "already there as g-prod version 1, now g-prod@champion; forced past the gate" in out.stdout, out
    assert str(client.get_model_version_by_alias("g-prod", "champion").version) == "1"
    assert len(client.search_model_versions("name = 'g-prod'")) == 2
    assert "nothing to do" in promote(client, "models:/g/1", "g-prod")

    # A promotion cut short between the copy and its tags (a crash, a lost connection): the copy is there with
    # the source's lineage only; the next promote finds it by its weights and completes it.
    client.copy_model_version("models:/g/2", "g-cut")
    assert "promoted_from" not in client.get_model_version("g-cut", "1").tags
    assert "already there as g-cut version 1" in promote(client, "models:/g/2", "g-cut")
    assert client.get_model_version("g-cut", "1").tags["promoted_from"] == "models:/g/2"

    # Another alias of the target, and bad references: one line naming what is wrong.
    assert "now g-prod@staging" in promote(client, "models:/g/2", "g-prod", alias="staging")
    for source, target, message in (("models:/g/9", "g-prod", "models:/g/9: "),
                                    ("models:/g", "g-prod", "models:/g: expected models:/NAME@ALIAS"),
                                    ("models:/g/1", "g", "--to g: models:/g/1 is already a version of g")):
        with pytest.raises(AstraiError, match=message):
            promote(client, source, target)


def test_promote_into_a_target_without_champion_still_applies_the_gates_absolute_rule(registry, client):
    """Issue 43 (3): the register gate's rule that needs no champion (a task better than chance) held only against a
    champion; into an empty target a version register had kept candidate was promoted."""
    from tasks.registry.promote import promote

    assert str(client.get_model_version_by_alias("g", "candidate").version) == "3"  # learned no task
    out = cli(registry, "models:/g@candidate", "--to", "g-empty")
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith("astrai: error: models:/g/3 not promoted to g-empty: fails the register gate's "
                                 "absolute rule: no task better than chance (task_accuracy 0.000"), out.stderr
    assert out.stderr.count("\n") == 1 and "--force" in out.stderr, out.stderr
    assert "g-empty" not in registered_models(client)  # nothing written

    # --force promotes it, and the line and the copy's tag say past which rule.
    line = promote(client, "models:/g@candidate", "g-empty", force=True)
    assert "copied to g-empty version 1, now g-empty@champion; forced past the gate: fails the register gate's " \
           "absolute rule: no task better than chance" in line, line
    assert client.get_model_version("g-empty", "1").tags["promotion"].startswith(
        "forced past the gate: fails the register gate's absolute rule")
    # Issue 50 (9): the copy's card names the copy, where it came from, and that it was forced.
    card = client.get_model_version("g-empty", "1").description
    assert card.startswith("# g-empty version 1\n") and "astrai serve --model models:/g-empty/1" in card, card
    assert "Promoted from `models:/g/3` (models:/g@candidate) by " in card and "**Forced**" in card, card

    # A version that learned a task passes it, and the line says so.
    line = promote(client, "models:/g/1", "g-empty2")
    assert line.endswith("now g-empty2@champion; g-empty2 has no champion; passes the register gate's absolute rule "
                         "(a task better than chance, no forgetting)"), line


def test_promote_checks_the_names_before_anything_is_written(registry, client):
    """Issue 43 (4): MLflow checked the alias only when setting it, after the copy (the target kept a version with no
    alias), and the target's name went unescaped into a search filter."""
    from tasks.registry.promote import promote

    for target, alias, message in (
            ("g-names", "latest", "--alias 'latest': 'latest' alias name (case insensitive) is reserved."),
            ("g-names", "v3", "--alias 'v3': Version alias name 'v3' is reserved."),
            ("g-names", "bad alias!", "--alias 'bad alias!': Invalid alias name: 'bad alias!'. Names may only "
                                      "contain alphanumerics, underscores (_), and dashes (-)."),
            ("g-names", "", "--alias '': Registered model alias name cannot be empty."),
            ("", "champion", "--to '': Missing value for required parameter 'name'."),
            ("g/names", "champion", "--to 'g/names': Invalid model name 'g/names'. Names cannot contain '/' or ':'."),
            ("x@y", "champion", "--to 'x@y': a registered model's name must be non-empty, without '@', '/' or "
                                "surrounding spaces (models:/NAME@ALIAS and models:/NAME/VERSION could not name it)")):
        with pytest.raises(AstraiError) as e:
            promote(client, "models:/g/2", target, alias=alias)
        assert str(e.value) == message
    assert not {"g-names", "", "g/names", "x@y"} & registered_models(client)  # nothing written

    out = cli(registry, "models:/g/2", "--to", "g-names", "--alias", "v3")
    assert (out.returncode, out.stdout) == (2, ""), out
    assert out.stderr == "astrai: error: --alias 'v3': Version alias name 'v3' is reserved.\n", out.stderr
    assert "g-names" not in registered_models(client)

    # Quotes are MLflow's to allow in a name (it does): promoted, and found again by its weights (nothing to do).
    for target in ("g'q", 'g"q', "g'q\"q"):
        assert f"copied to {target} version 1, now {target}@champion" in promote(client, "models:/g/2", target)
        assert "nothing to do" in promote(client, "models:/g/2", target)


def test_promote_stops_in_bounded_time_when_the_registry_lock_server_does_not_answer(registry, client):
    """Issue 43 (5): with the lock's PostgreSQL down, promote waited without end and said nothing. A port where
    nothing listens (refused at once), and one that accepts and never answers (a server that hangs: the kernel
    completes the handshake, nothing reads): each one line naming the server, exit 2, nothing written, well before
    the bound (the connect timeout is REGISTRY_LOCK_CONNECT_TIMEOUT, 10 s)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        for port, what in ((free_port(), "Connection refused"), (silent.getsockname()[1], "timeout expired")):
            started = time.monotonic()
            out = cli(registry, "models:/g/2", "--to", "g-lock", timeout=60,
                      env={"ASTRAI_REGISTRY_LOCK_URI": f"postgresql://astrai:secret@127.0.0.1:{port}/astrai"})
            assert time.monotonic() - started < 60
            assert (out.returncode, out.stdout) == (2, ""), out
            assert out.stderr.startswith("astrai: error: registry lock (ASTRAI_REGISTRY_LOCK_URI or "
                                         f'tracking.registry_lock_uri): connection to server at "127.0.0.1", port '
                                         f"{port} failed: {what}"), out.stderr
            assert out.stderr.count("\n") == 1 and "secret" not in out.stderr, out.stderr
    assert "g-lock" not in registered_models(client)


def test_promote_stops_in_bounded_time_when_the_tracking_server_does_not_answer(registry):
    """Issue 43 (5), MLflow's side: a tracking server that accepts and never answers held each request for MLflow's
    default 120 s (and retried it). promote bounds a request at 15 s; retries off here (env.defaults' six, about a
    minute, are for a server restarting), so one request's wait is what this measures, against a generous bound."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        started = time.monotonic()
        out = cli(registry, "models:/g/2", "--to", "g-lock", timeout=60,
                  env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
        assert time.monotonic() - started < 60
    assert (out.returncode, out.stdout) == (2, ""), out
    assert out.stderr.startswith(f"astrai: error: models:/g/2: API request to http://127.0.0.1:{port}/"), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


def test_champion_record_of_a_registry_that_does_not_answer_is_an_error_not_no_champion(monkeypatch):
    """A champion looked up while the registry does not answer (PostgreSQL down) was taken for "no champion": the
    gate then passed anything, and a registry back by the next call took the copy. Only "no such model" and "no
    such alias" mean none."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from tasks.registry.gate import champion_record

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once, no retries to wait out
    with pytest.raises(MlflowException, match="Connection refused"):
        champion_record(mlflow.MlflowClient(f"http://127.0.0.1:{free_port()}"), "g-prod")
