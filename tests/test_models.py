"""One model reference everywhere (tasks/registry/models.py resolve_model): a registry URI, a checkpoint directory or a
Hugging Face directory works with every command that takes a model (serve, generate, export-hf)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.registry.models import resolve_model
from astrai_core.runtime.errors import AstraiError

ROOT = Path(__file__).resolve().parents[1]
ASTRAI = [str(Path(sys.executable).parent / "astrai")]


def test_a_registered_model_works_with_export_hf_and_generate_chat(tmp_path, data_tokenizer, monkeypatch):
    import mlflow
    import torch

    from astrai_core.checkpoint.model_dir import save_checkpoint
    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer
    from tasks.run.schema import Params
    from tasks.run.table import model_dir
    from tasks.stages.register import register

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    data_tokenizer.save(str(tmp_path / "tokenizer.json"))  # astrai's special tokens: --chat needs them
    cfg = ModelConfig(vocab_size=data_tokenizer.get_vocab_size(), dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_seq_len=32)
    torch.manual_seed(0)
    save_checkpoint(model_dir(tmp_path, "pretrain"), Transformer(cfg), cfg, tmp_path / "tokenizer.json")
    (tmp_path / "metrics.json").write_text(json.dumps({"final_model": "pretrain", "pretrain/task_accuracy": 0.1}))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(store)
    try:
        exp = mlflow.create_experiment("models", artifact_location=(tmp_path / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=exp):
            register(Params(register={"model_name": "m"}), tmp_path / "metrics.json", tmp_path / "out", tmp_path)
    finally:
        mlflow.set_tracking_uri(previous)

    env = dict(os.environ, PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=store, MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false")

    def astrai(*args: str) -> subprocess.CompletedProcess:
        out = subprocess.run(ASTRAI + list(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out

    astrai("export-hf", "models:/m@champion", "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"]
    astrai("generate", "--model", "models:/m@champion", "--chat", "--prompt", "Hi", "--max-new-tokens", "3")
    # The same greedy text from the registry, the checkpoint directory and the exported Hugging Face directory.
    texts = {ref: astrai("generate", "--model", ref, "--prompt", "ROMEO.", "--max-new-tokens", "5").stdout
             for ref in ("models:/m/1", str(model_dir(tmp_path, "pretrain")), "hf")}
    assert len(set(texts.values())) == 1, texts


def test_resolve_model_of_a_directory_and_of_nothing(tmp_path, core_tiny_data):
    from astrai_core.checkpoint.model_dir import save_checkpoint
    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    save_checkpoint(tmp_path / "ckpt", Transformer(cfg), cfg, core_tiny_data["tokenizer"])
    assert resolve_model(str(tmp_path / "ckpt"), tmp_path / "dl") == (tmp_path / "ckpt", "ckpt", [])
    with pytest.raises(AstraiError, match="nowhere: no such model"):
        resolve_model(str(tmp_path / "nowhere"), tmp_path / "dl")


def test_a_reference_to_nothing_says_what_is_registered(tmp_path, monkeypatch):
    """Issue 43, item 14: after a quick run (it registers astrai-quick, seldom a champion) `astrai serve` and
    `astrai generate` with the default models:/astrai@champion said only "not found". The line now names what
    the store holds, aliases and versions, or that it holds nothing."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(AstraiError, match=r"not found .*; nothing is registered in this store yet"):
        resolve_model("models:/astrai@champion", tmp_path / "dl")
    client = mlflow.MlflowClient()
    client.create_registered_model("astrai-quick")
    client.set_registered_model_alias("astrai-quick", "candidate",
                                      client.create_model_version("astrai-quick", source=str(tmp_path)).version)
    with pytest.raises(AstraiError, match=r"models:/astrai@champion: .*; registered here: astrai-quick "
                                          r"\(@candidate v1\)$"):
        resolve_model("models:/astrai@champion", tmp_path / "dl")
