"""Fine-tuning a given model (`pretrain.init_from` + `pretrain.enabled: false`): a trained model exported to
Hugging Face and imported back starts SFT on the user's data; the run takes the model's tokenizer and shape, and
shapes are compared with defaults resolved (a checkpoint stores `ffn_dim: null`, the import the number), while a
real difference is refused naming the field. The real stages (torchrun, MLflow's sqlite store), nothing mocked."""

from __future__ import annotations

import json
import shutil

import pytest

from astrai_core.checkpoint import read_model_config
from astrai_core.errors import AstraiError
from astrai_core.hf import export_hf, import_hf
from tasks.params import Params, check_inputs
from tasks.stages import run_stage

# tiny_trained's shape as a user of the demo writes it in params.yaml: ffn_dim left to its default (null)
SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, qk_norm=True, ffn_dim=None)


@pytest.fixture
def project(tmp_path, tiny_trained, monkeypatch):
    """A project with the user's prose corpus and SFT file, and the tiny model exported to HF and imported back."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("ASTRAI_PARENT_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)  # the stages run in the project directory
    (tmp_path / "prose").mkdir()
    for i in range(6):
        (tmp_path / "prose" / f"{i}.txt").write_text(f"Note {i}. The licence is granted to the user as is.\n" * 40)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"term {i}?", "response": f"yes {i}"}) + "\n"
                                                for i in range(40)))
    hf = export_hf(tiny_trained, tmp_path / "hf")
    import_hf(hf, tmp_path / "imported")
    return tmp_path


def params_from(start: str, **model) -> Params:
    train = dict(nproc=1, device="cpu", dtype="fp32", log_every=1)
    return Params(corpus={"source": "prose", "validation_fraction": 0.2, "test_fraction": 0.2},
                  model={**SHAPE, **model},
                  pretrain={"init_from": start, "enabled": False, "seq_len": 32},
                  chat_data={"sft": "sft.jsonl", "test_fraction": 0.2, "max_chars": 100},
                  sft={**train, "batch_size": 2, "max_steps": 3, "eval_every": 3, "eval_batches": 1,
                       "optim": {"warmup_steps": 1}},
                  dpo={"enabled": False}, grpo={"enabled": False}, register={"metric": "test_bits_per_char"})


def test_sft_from_an_exported_and_imported_model(project):
    imported = project / "imported"
    assert json.loads((imported / "config.json").read_text())["ffn_dim"] == 128  # the demo stores null
    params = params_from("hf")  # the HF directory itself: converted as `astrai import-hf` does
    check_inputs(params, project)
    for stage in ("corpus", "tokenizer", "pack", "pretrain", "chat_data", "sft"):
        run_stage(stage, params, project)
    # The run's tokenizer is the model's (with astrai's special tokens, as import-hf adds them) ...
    assert (project / "data/tokenizer/tokenizer.json").read_bytes() == (imported / "tokenizer.json").read_bytes()
    # ... pretrain passed the model on as it is, and SFT trained from it, in its shape
    assert (project / "data/pretrain/model.safetensors").read_bytes() == (imported / "model.safetensors").read_bytes()
    summary = json.loads((project / "data/sft/summary.json").read_text())
    assert summary["steps"] == 3
    assert read_model_config(project / "data/sft/config.json") == read_model_config(imported / "config.json")


def test_a_real_shape_difference_is_refused_naming_the_field(project):
    params = params_from(str(project / "imported"), dim=64)
    run_stage("corpus", params, project)
    with pytest.raises(AstraiError, match=r"^params.yaml: model.dim: 64, but pretrain.init_from .* has 32; remove "
                                          r"model.dim") as e:
        run_stage("tokenizer", params, project)
    assert "\n" not in str(e.value) and not (project / "data/tokenizer").exists()


def test_init_from_takes_the_tokenizer_and_refuses_a_second_one(project):
    with pytest.raises(ValueError, match="tokenizer.source: the run's tokenizer is pretrain.init_from's"):
        Params(tokenizer={"source": str(project / "imported")}, pretrain={"init_from": "models:/astrai/1"})
    with pytest.raises(ValueError, match="pretrain.enabled: false needs pretrain.init_from"):
        Params(pretrain={"enabled": False})
    shutil.rmtree(project / "imported")
    with pytest.raises(AstraiError, match="pretrain.init_from: imported: no model there"):
        check_inputs(params_from("imported"), project)
