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

import pytest

from astrai_core.errors import AstraiError
from conftest import VENV_BIN


def test_promote_copies_with_lineage_and_moves_the_alias_only_past_the_gate(tmp_path, core_tiny_data, monkeypatch):
    import mlflow
    import torch

    from astrai_core.checkpoint import save_checkpoint
    from astrai_core.config import ModelConfig
    from astrai_core.model import Transformer
    from astrai_core.scoring import wilson_interval
    from tasks.registry.promote import promote
    from tasks.run.layout import model_dir
    from tasks.run.params import Params
    from tasks.stages.register import register

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("ASTRAI_REGISTRY_LOCK_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    n = 500
    base = [i < 217 for i in range(n)]  # 0.434
    random.Random(0).shuffle(base)
    better = list(base)  # 60 more items right: beyond the paired interval
    for i in [i for i, r in enumerate(base) if not r][:60]:
        better[i] = True

    def register_version(seed: int, right: list[bool]) -> dict:
        torch.manual_seed(seed)
        save_checkpoint(model_dir(tmp_path, "sft"), Transformer(cfg), cfg, core_tiny_data["tokenizer"])
        k = sum(right)
        low, high = wilson_interval(k, n)
        (tmp_path / "metrics.json").write_text(json.dumps({
            "final_model": "sft", "sft/task_accuracy": k / n, "sft/task_accuracy_low": low,
            "sft/task_accuracy_high": high, "sft/test_bits_per_char": 2.0}))
        (tmp_path / "items.json").write_text(json.dumps({"task_accuracy": {"sft": [int(r) for r in right]},
                                                         "item_sets": {"task_accuracy": "the-same-500"}}))
        with mlflow.start_run(experiment_id=exp):
            return register(Params(register={"model_name": "g", "metric": "task_accuracy"}), tmp_path / "metrics.json",
                            tmp_path / "out", tmp_path)

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(store)
    try:
        exp = mlflow.create_experiment("promote", artifact_location=(tmp_path / "artifacts").as_uri())
        client = mlflow.MlflowClient()
        assert register_version(1, base)["aliases"] == ["candidate", "champion"]
        assert register_version(2, better)["aliases"] == ["candidate", "champion"]  # g@champion: version 2

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
        cli_env = {"MLFLOW_TRACKING_URI": store, "PATH": str(VENV_BIN), "MLFLOW_DISABLE_TELEMETRY": "true"}
        out = subprocess.run([str(VENV_BIN / "astrai"), "promote", "models:/g/1", "--to", "g-prod"], cwd=tmp_path,
                             env=cli_env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.startswith("astrai: error: models:/g/1 not promoted to g-prod: fails the register gate "
                                     "against g-prod@champion (version 2): task_accuracy: -0.1200, paired 95% "
                                     "interval"), out.stderr
        assert out.stderr.count("\n") == 1 and "--force" in out.stderr, out.stderr
        assert len(client.search_model_versions("name = 'g-prod'")) == 2
        assert str(client.get_model_version_by_alias("g-prod", "champion").version) == "2"

        # --force: its weights are in g-prod already (version 1), so the alias moves there, nothing copied.
        out = subprocess.run([str(VENV_BIN / "astrai"), "promote", "models:/g/1", "--to", "g-prod", "--force"],
                             cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
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
    finally:
        mlflow.set_tracking_uri(previous)
