"""A user's run, end to end on the real stages (torchrun, MLflow's sqlite store, nothing mocked): their prose corpus,
their SFT file, and a model they bring.

* Fine-tuning a given model (`pretrain.init_from` + `pretrain.enabled: false`): a trained model exported to Hugging
  Face is the start; the run takes its tokenizer and shape, compared with defaults resolved (a checkpoint stores
  `ffn_dim: null`, the import the number), while a real difference is refused naming the field.
* The evaluation's samples start from the user's held-out text, not Shakespeare's.
* The registered version's description is its model card, and `astrai export-hf` writes the same card as README.md.
"""

from __future__ import annotations

import json
import shutil

import pytest

from astrai_core.checkpoint.model_dir import read_model_config
from astrai_core.convert.hf import export_hf, import_hf
from astrai_core.runtime.errors import AstraiError
from tasks.run.checks import check_inputs
from tasks.run.schema import Params
from tasks.stages.runner import run_stage

# tiny_trained's shape as a user of the demo writes it in params.yaml: ffn_dim left to its default (null)
SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, qk_norm=True, ffn_dim=None)
CHAIN = ("corpus", "tokenizer", "pack", "pretrain", "chat_data", "sft", "dpo_reference", "dpo", "grpo", "evaluate",
         "register")


def make_project(root, tiny_trained, mp: pytest.MonkeyPatch):
    """The user's prose corpus and SFT file, and the tiny model exported to HF and imported back, in `root`."""
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("MLFLOW_RUN_ID", "ASTRAI_PARENT_RUN_ID"):
        mp.delenv(name, raising=False)
    mp.chdir(root)  # the stages run in the project directory
    (root / "prose").mkdir()
    for i in range(6):
        (root / "prose" / f"{i}.txt").write_text(f"Clause {i} of the licence.\nThe licence is granted as is.\n" * 40)
    (root / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"term {i}?", "response": f"yes {i}"}) + "\n"
                                            for i in range(40)))
    import_hf(export_hf(tiny_trained, root / "hf"), root / "imported")


def params_from(start: str, **model) -> Params:
    train = dict(nproc=1, device="cpu", dtype="fp32", log_every=1)
    return Params(corpus={"source": "prose", "validation_fraction": 0.2, "test_fraction": 0.2},
                  model={**SHAPE, **model},
                  pretrain={"init_from": start, "enabled": False, "seq_len": 32},
                  chat_data={"sft": "sft.jsonl", "test_fraction": 0.2, "max_chars": 100},
                  sft={**train, "batch_size": 2, "max_steps": 3, "eval_every": 3, "eval_batches": 1,
                       "optim": {"warmup_steps": 1}},
                  dpo={"enabled": False}, grpo={"enabled": False},
                  evaluate={"max_new_tokens": 8, "batch_size": 4},
                  register={"metric": "test_bits_per_char", "model_name": "mine"})


@pytest.fixture(scope="module")
def chain(tiny_trained, tmp_path_factory):
    """The whole chain from the HF directory of an exported model, once: (project, params)."""
    root = tmp_path_factory.mktemp("user_run")
    with pytest.MonkeyPatch.context() as mp:
        make_project(root, tiny_trained, mp)
        params = params_from("hf")  # the HF directory itself: converted as `astrai import-hf` does
        check_inputs(params, root)
        for stage in CHAIN:
            run_stage(stage, params, root)
        yield root, params


@pytest.fixture
def project(tmp_path, tiny_trained, monkeypatch):
    make_project(tmp_path, tiny_trained, monkeypatch)
    return tmp_path


def test_sft_from_an_exported_and_imported_model(chain):
    project, _ = chain
    imported = project / "imported"
    assert json.loads((imported / "config.json").read_text())["ffn_dim"] == 128  # the demo stores null
    # The run's tokenizer is the model's (with astrai's special tokens, as import-hf adds them) ...
    assert (project / "data/tokenizer/tokenizer.json").read_bytes() == (imported / "tokenizer.json").read_bytes()
    # ... pretrain passed the model on as it is, and SFT trained from it, in its shape
    assert (project / "data/pretrain/model.safetensors").read_bytes() == (imported / "model.safetensors").read_bytes()
    summary = json.loads((project / "data/sft/summary.json").read_text())
    assert summary["steps"] == 3
    assert read_model_config(project / "data/sft/config.json") == read_model_config(imported / "config.json")


def test_the_shape_is_the_models_and_a_line_names_what_params_yaml_said(project, capsys):
    """Issue 49: no edit of params.yaml's `model:` to start from a model of another shape; one line says which keys
    the model overrides."""
    params = params_from(str(project / "imported"), dim=64)
    run_stage("corpus", params, project)
    capsys.readouterr()
    run_stage("tokenizer", params, project)
    out = capsys.readouterr().out
    assert "model: the shape of pretrain.init_from (" in out and "dim 32 (params.yaml: 64)" in out, out
    tokenizer = (project / "data/tokenizer/tokenizer.json").read_bytes()
    assert tokenizer == (project / "imported/tokenizer.json").read_bytes()


def test_init_from_takes_the_tokenizer_and_refuses_a_second_one(project):
    with pytest.raises(ValueError, match="tokenizer.source: the run's tokenizer is pretrain.init_from's"):
        Params(tokenizer={"source": str(project / "imported")}, pretrain={"init_from": "models:/astrai/1"})
    with pytest.raises(ValueError, match="pretrain.enabled: false needs pretrain.init_from"):
        Params(pretrain={"enabled": False})
    shutil.rmtree(project / "imported")
    with pytest.raises(AstraiError, match="pretrain.init_from: imported: no model there"):
        check_inputs(params_from("imported"), project)


def test_samples_start_from_the_users_held_out_text(chain):
    from tasks.evaluation.samples import DEMO_PROMPTS, sample_prompts

    project, params = chain
    held_out = [json.loads(line)["text"] for split in ("test", "validation")
                for line in (project / f"data/corpus/{split}.jsonl").read_text().splitlines()]
    corpus = project / "data/corpus"
    prompts = sample_prompts(params.evaluate.prompts, params.corpus.source, corpus)
    assert prompts and all(any(t.startswith(p) for t in held_out) for p in prompts), prompts
    samples = (project / "data/evaluate/samples.md").read_text()
    assert f"{prompts[0]!r}" in samples and "ROMEO" not in samples and "To be" not in samples
    # The plays keep the demo's prompts, and a list in evaluate.prompts wins over both.
    assert sample_prompts(Params().evaluate.prompts, Params().corpus.source, corpus) == DEMO_PROMPTS
    assert sample_prompts(["Mine"], params.corpus.source, corpus) == ["Mine"]


def test_the_registered_version_and_its_export_carry_one_model_card(chain, tmp_path, monkeypatch):
    import mlflow
    from typer.testing import CliRunner

    from astrai.cli import app

    project, params = chain
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project}/mlflow.db")
    monkeypatch.chdir(project)
    registration = json.loads((project / "data/register/registration.json").read_text())
    assert registration["model_uri"] == "models:/mine/1"
    mlflow.set_tracking_uri(f"sqlite:///{project}/mlflow.db")
    card = mlflow.MlflowClient().get_model_version("mine", "1").description
    for part in ("# mine version 1", "the sft stage's model, the chain's best on test_bits_per_char",
                 "Shape: dim 32, 2 layers, 4 heads (2 key/value)", "* corpus (corpus.source): `prose`",
                 f"* params hash (sha256 of the resolved params.yaml): `{params.digest()}`",
                 "| test bits/char | ", "astrai serve --model models:/mine/1"):
        assert part in card, (part, card)
    result = CliRunner().invoke(app, ["export-hf", "models:/mine@champion", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "README.md").read_text() == card  # the same card, by the same function
    # A plain checkpoint's card says what it is and how to serve it; metrics with their intervals read as such.
    from tasks.registry.model_card import model_card

    result = CliRunner().invoke(app, ["export-hf", "data/sft", str(tmp_path / "hf_sft")])
    assert result.exit_code == 0, result.output
    plain = (tmp_path / "hf_sft" / "README.md").read_text()
    assert "Not a registered version" in plain and "astrai serve --model data/sft" in plain
    assert "| task accuracy | 0.3000 | 0.2000 to 0.4000 |" in model_card(
        "m", "models:/m/1", {"task_accuracy": "0.3", "task_accuracy_low": "0.2", "task_accuracy_high": "0.4"})


def test_long_stages_print_counts_and_an_eta(chain, capfd, monkeypatch):
    """With the progress interval at 0 every step of a stage's loops prints its line (the interval is a parameter,
    ASTRAI_PROGRESS_SECONDS; 10 s by default): counts and an eta, from the stage and from evaluate's workers."""
    import re

    project, params = chain
    monkeypatch.setenv("ASTRAI_PROGRESS_SECONDS", "0")  # the evaluate workers inherit it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project}/mlflow.db")
    monkeypatch.chdir(project)
    capfd.readouterr()
    for stage in ("pack", "evaluate"):
        run_stage(stage, params, project)
    out = capfd.readouterr().out
    count = r"\d+/\d+ {} \(\d+%\), \d+s so far, eta (\d+m)?\d+s"
    for label, unit in (("pack", "train documents"), ("evaluate", "models scored"),
                        ("evaluate: sft", "test windows"), ("evaluate: pretrain", "SFT test rows")):
        assert re.search(f"^{label}: {count.format(re.escape(unit))}$", out, re.M), (label, unit, out[-3000:])


def test_the_flow_estimates_the_run_from_the_stages_last_times():
    from flows.pipeline import STAGE_TIMES, run_eta

    assert run_eta({"sft": 100.0, "dpo": 65.0, "grpo": 30.0}, ["dpo", "grpo"]) == \
        "eta 1m35s for the 2 stages left, from their last runs' times"
    assert run_eta({"dpo": 65.0}, ["dpo", "evaluate"]) == \
        "eta 1m05s for the 2 stages left, from their last runs' times (evaluate never timed, not counted)"
    assert run_eta({}, ["corpus"]) == f"eta unknown: no earlier run timed these stages ({STAGE_TIMES})"
