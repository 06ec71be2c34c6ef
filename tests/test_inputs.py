"""What a run will read is checked before its first stage (tasks/run/checks.py check_inputs): every input path, and
the combinations that cannot work (demo post-training data from a corpus without plays); a disabled stage needs no
data."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from astrai_core.runtime.errors import AstraiError
from tasks.chat.records import KINDS
from tasks.run.checks import check_inputs
from tasks.run.schema import ChatDataParams, Params
from tasks.stages.chat_data import write_records

ROOT = Path(__file__).resolve().parents[1]
ASTRAI = [str(Path(os.sys.executable).parent / "astrai")]


@pytest.fixture
def user_files(tmp_path):
    """A corpus of prose (no plays) and an SFT file, as a user brings them."""
    (tmp_path / "prose").mkdir()
    for i in range(6):
        (tmp_path / "prose" / f"{i}.txt").write_text(f"Essay {i}. The weather was fine and the road was long.\n" * 30)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n"
                                                for i in range(20)))
    return tmp_path


def _params(**sections) -> Params:
    return Params(**sections)


@pytest.mark.parametrize("sections, message", [
    ({"corpus": {"source": "nowhere"}}, "corpus.source: nowhere: corpus source not found"),
    ({"corpus": {"source": "prose/*.md"}}, "corpus.source: prose/*.md: no file matches"),
    ({"corpus": {"source": "prose"}, "chat_data": {"sft": "sft.jsonl"}},
     "chat_data.dpo: demo derives the dpo data from Shakespeare's plays, but corpus.source is prose; set "
     "chat_data.dpo to a JSONL file of {\"prompt\", \"chosen\", \"rejected\"} records, or dpo.enabled: false"),
    ({"chat_data": {"sft": "missing.jsonl"}}, "chat_data.sft: missing.jsonl: file not found"),
    ({"pretrain": {"init_from": "no_checkpoint"}}, "pretrain.init_from: no_checkpoint: no model there"),
    ({"pretrain": {"init_from": "no_model.gguf"}}, "pretrain.init_from: no_model.gguf: no model there"),
    # issue 50 (10): a device this machine lacks, before any stage runs (CI has no GPU)
    ({"evaluate": {"device": "cuda"}}, "evaluate.device: cuda, but torch sees no CUDA device on this machine"),
    ({"sft": {"device": "cuda"}}, "sft.device: cuda, but torch sees no CUDA device on this machine"),
    ({"tokenizer": {"source": "no_tokenizer.json"}}, "tokenizer.source: no_tokenizer.json: not found"),
    ({"corpus": {"source": "prose"}, "chat_data": {"sft": "sft.jsonl"}, "dpo": {"enabled": False},
      "grpo": {"enabled": False}},
     "register.metric: task_accuracy is scored on the grpo data, which a run with grpo.enabled: false and no play "
     "corpus leaves out; set register.metric: test_bits_per_char"),
])
def test_inputs_that_cannot_work_are_refused_naming_the_key(user_files, sections, message):
    with pytest.raises(AstraiError) as e:
        check_inputs(_params(**sections), user_files)
    assert str(e.value).startswith(f"params.yaml: {message}"), str(e.value)


def test_a_disabled_stage_needs_no_data(user_files):
    ok = {"corpus": {"source": "prose"}, "chat_data": {"sft": "sft.jsonl", "grpo": "missing.jsonl"},
          "dpo": {"enabled": False}, "grpo": {"enabled": False}, "register": {"metric": "test_bits_per_char"}}
    check_inputs(_params(**ok), user_files)
    check_inputs(_params(**ok, pretrain={"init_from": None}), user_files)
    check_inputs(_params(grpo={"enabled": False}), user_files)  # the plays: grpo's demo data is still derived


def test_chat_data_of_a_prose_corpus_with_a_user_sft_file_and_dpo_grpo_disabled(user_files):
    """The run the issue reports: chat_data used to derive DPO/GRPO demo data from plays that are not there."""
    from tasks.run.schema import CorpusParams
    from tasks.stages.corpus import build_corpus

    corpus = user_files / "data" / "corpus"
    build_corpus(CorpusParams(source=str(user_files / "prose"), validation_fraction=0.2, test_fraction=0.2), corpus)
    params = ChatDataParams(sft=str(user_files / "sft.jsonl"))
    stats = write_records(params, corpus, user_files / "chat", enabled=("sft",))
    assert stats["files"]["sft_train.jsonl"] + stats["files"]["sft_test.jsonl"] == 20
    assert {k: v for k, v in stats["files"].items() if not k.startswith("sft")} == \
        {f"{k}_{s}.jsonl": 0 for k in KINDS[1:] for s in ("train", "test")}
    assert stats["sources"]["dpo"] == "none: dpo.enabled is false"
    with pytest.raises(AstraiError, match="no play with speeches"):  # enabled, demo data is still an error
        write_records(params, corpus, user_files / "chat2", enabled=("sft", "dpo"))


def test_astrai_pipeline_refuses_a_missing_corpus_before_prefect_starts(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["corpus"]["source"] = "nowhere"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PYTHONPATH=str(ROOT), PREFECT_HOME=str(tmp_path / "prefect"))
    out = subprocess.run(ASTRAI + ["pipeline"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "astrai: error: params.yaml: corpus.source: nowhere: corpus source not found (expected "
        "'shakespeare', a directory or a glob)")
    assert not (tmp_path / "prefect").exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize("where", ["under a file", "under /proc"])
def test_astrai_pipeline_refuses_a_prefect_home_it_cannot_write_before_prefect_starts(tmp_path, where):
    """A temporary Prefect server's database goes in PREFECT_HOME: where no directory can be made, the run stops at
    once with one line naming PREFECT_HOME (not after Prefect's start-up timeout, on a line that does not say where).
    /proc: root passes every permission check there, yet can make nothing."""
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (tmp_path / "a-file").write_text("")
    home = tmp_path / "a-file" / "prefect" if where == "under a file" else Path("/proc/astrai-test-prefect")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(home))
    out = subprocess.run(ASTRAI + ["pipeline"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"astrai: error: PREFECT_HOME={home}: the temporary Prefect server cannot keep its "
                           "database there (") and line.endswith(
        "); set PREFECT_HOME to a writable directory, or PREFECT_API_URL to a Prefect server"), line
    assert not (tmp_path / "data").exists()
