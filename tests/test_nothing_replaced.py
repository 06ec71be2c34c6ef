"""Nothing astrai did not write is replaced: `astrai dvc-yaml` writes only in the checkout whose stage table it reads
and never over another project's dvc.yaml; a stage table whose outputs overlap is refused before a stage deletes
another's; a `pretrain.init_from` checkpoint is verified against its manifest before it replaces data/pretrain or
the run's tokenizer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import re

import pytest

from astrai_core.runtime.errors import AstraiError
from tasks.run import table
from tasks.run.schema import SECTIONS, Params
from tasks.run.table import STAGES, Stage, TrainingStage, check_table, dvc_yaml

ROOT = Path(__file__).resolve().parents[1]
ASTRAI = str(Path(sys.executable).parent / "astrai")


def run_astrai(cwd: Path, *args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
    return subprocess.run([ASTRAI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_dvc_yaml_refuses_another_projects_folder_and_leaves_its_dvc_yaml(tmp_path):
    theirs = "stages:\n  train:\n    cmd: python train.py\n"
    (tmp_path / "dvc.yaml").write_text(theirs)
    out = run_astrai(tmp_path, "dvc-yaml")
    assert out.returncode == 2 and "not the astrai checkout" in out.stderr.splitlines()[-1], out.stderr
    assert (tmp_path / "dvc.yaml").read_text() == theirs
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_astrai(empty, "dvc-yaml")
    assert out.returncode == 2 and not (empty / "dvc.yaml").exists(), out.stderr


def test_dvc_yaml_never_replaces_a_dvc_yaml_it_did_not_write(tmp_path):
    """In a checkout (a copy, its own table on PYTHONPATH): a dvc.yaml someone wrote by hand stays; the table's own
    (an older one) is rewritten."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tasks", repo / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    hand = "# my own stages\nstages:\n  train:\n    cmd: python train.py\n"
    (repo / "dvc.yaml").write_text(hand)
    out = run_astrai(repo, "dvc-yaml", pythonpath=repo)
    assert out.returncode == 2 and "not written by `astrai dvc-yaml`" in out.stderr, out.stderr
    assert (repo / "dvc.yaml").read_text() == hand
    (repo / "dvc.yaml").write_text(dvc_yaml().replace("      - astrai_core/training\n", "", 1))
    out = run_astrai(repo, "dvc-yaml", pythonpath=repo)
    assert out.returncode == 0 and (repo / "dvc.yaml").read_text() == dvc_yaml(), out.stderr


@pytest.mark.parametrize("entry, says", [
    (TrainingStage("polish", strategy="sft", reads=("chat_data",), out=Path("data/sft")),
     "stage 'polish': out 'data/sft' overlaps the output of stage 'sft' (data/sft)"),
    (Stage("inner", out=Path("data/chat/inner")),
     "stage 'inner': out 'data/chat/inner' overlaps the output of stage 'chat_data'"),
    (Stage("outer", out=Path("data")), "stage 'outer': out 'data' is not a folder under data/"),
    (Stage("up", out=Path("data/..")), "stage 'up': out 'data/..' is not a folder under data/"),
    (Stage("a/b"), "stage 'a/b': not a name a stage can have"),
    (Stage("a: b"), "stage 'a: b': not a name a stage can have"),
    (Stage(""), "stage '': not a name a stage can have"),
    (Stage("x\ny"), "stage 'x\\ny': not a name a stage can have"),
    (Stage(".."), "stage '..': not a name a stage can have"),
])
def test_a_stage_whose_output_is_anothers_or_outside_data_is_refused(monkeypatch, entry, says):
    monkeypatch.setattr(table, "STAGES", (*STAGES[:-2], entry, *STAGES[-2:]))
    with pytest.raises(AstraiError, match=r"^tasks/run/table.py: " + re.escape(says)):
        check_table(SECTIONS)


def test_a_target_metric_evaluate_does_not_report_is_refused(monkeypatch):
    """Issue 50 (11): a stage's target or keep must be a metric evaluate reports (it is what its check reads)."""
    entry = TrainingStage("polish", strategy="sft", reads=("chat_data",), target="accuracy")
    monkeypatch.setattr(table, "STAGES", (*STAGES[:-2], entry, *STAGES[-2:]))
    with pytest.raises(AstraiError, match=r"^tasks/run/table.py: stage 'polish': metric 'accuracy' is not one "):
        check_table(SECTIONS)


@pytest.mark.parametrize("keep", ["()", "STAGES[:2] + STAGES[3:]"], ids=["empty table", "no pack"])
def test_an_empty_table_or_one_without_pack_is_one_line(tmp_path, keep):
    """Issue 50 (11): the table edited down to nothing, or without `pack`: `astrai dvc-yaml` says which stage the
    others need, exit 2, instead of a KeyError traceback; nothing written."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tasks", repo / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    path = repo / "tasks/run/table.py"
    text = path.read_text()
    path.write_text(text.replace("BY_NAME: dict[str, Stage]", f"STAGES = {keep}\nBY_NAME: dict[str, Stage]", 1))
    before = (repo / "dvc.yaml").read_bytes()
    out = run_astrai(repo, "dvc-yaml", pythonpath=repo)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"astrai: error: tasks/run/table.py: no stage {'corpus' if keep == '()' else 'pack'!r}; the stages corpus, "
        "tokenizer, pack, pretrain, dpo_reference, evaluate, register are read by name by the others (add stages "
        "around them, keep these)"], out.stderr
    assert (repo / "dvc.yaml").read_bytes() == before


def test_init_from_with_broken_weights_replaces_nothing(tmp_path, tiny_trained):
    """A checkpoint whose model.safetensors was truncated: the tokenizer stage and the pretrain stage (enabled:
    false, which copies it to data/pretrain) both stop with one line naming the broken file, and the good outputs
    there stay as they were."""
    from tasks.stages.runner import _tokenizer as tokenizer_stage
    from tasks.stages.training import train_stage

    broken = tmp_path / "broken"
    shutil.copytree(tiny_trained, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    root = tmp_path / "project"
    for out in ("data/pretrain", "data/tokenizer"):
        shutil.copytree(tiny_trained, root / out)
    before = {p: p.read_bytes() for p in sorted((root / "data").rglob("*")) if p.is_file()}
    params = Params(pretrain={"init_from": str(broken), "enabled": False})
    with pytest.raises(AstraiError, match=rf"^{weights}: sha256 does not match manifest.json"):
        train_stage(params, "pretrain", root, on_line=lambda line: None)
    with pytest.raises(AstraiError, match=rf"{weights}: sha256 does not match manifest.json"):
        tokenizer_stage(params, root)
    assert {p: p.read_bytes() for p in sorted((root / "data").rglob("*")) if p.is_file()} == before


def test_a_checkpoint_without_its_manifest_is_named_as_such(tmp_path, tiny_trained):
    """Issue 50 (18): a checkpoint folder that lost manifest.json was taken for a Hugging Face folder ("model_type
    None is not supported")."""
    from tasks.registry.models import resolve_model

    copy = tmp_path / "copy"
    shutil.copytree(tiny_trained, copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(AstraiError, match=rf"^{copy}: not a checkpoint \(manifest.json missing"):
        resolve_model(str(copy), tmp_path / "dst")


def test_a_copied_checkouts_store_does_not_write_into_the_original(tmp_path, monkeypatch):
    """Issue 50 (17): a copied checkout's mlflow.db names the original's artifact folder (absolute): its runs' artifacts
    landed in the source checkout. One line naming both, before anything is logged."""
    import mlflow

    from tasks.run.tracking import setup

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    previous = mlflow.get_tracking_uri()
    try:
        setup(Params(), tmp_path / "original")
        shutil.copytree(tmp_path / "original" / "mlflow", tmp_path / "copy" / "mlflow")
        monkeypatch.delenv("MLFLOW_TRACKING_URI")  # setup sets it for the ranks: a second checkout's process has none
        with pytest.raises(AstraiError, match=r"copy/mlflow/mlflow.db: experiment 'astrai' keeps its artifacts in "
                                              r".*original/mlflow/artifacts, not beside this store"):
            setup(Params(), tmp_path / "copy")
        monkeypatch.delenv("MLFLOW_TRACKING_URI")
        setup(Params(), tmp_path / "original")  # the original's own store is its own
    finally:
        mlflow.set_tracking_uri(previous)


@pytest.mark.parametrize("command", ["export-hf", "export-gguf"])
def test_a_full_disk_is_one_line_naming_the_output(tmp_path, core_tiny_data, command):
    """Issue 50 (15): a full disk was a library's line (`safetensors/torch.py:323: SafetensorError: ... No space left
    on device`, `gguf_writer.py:469: OSError: 16384 requested and 14320 written`). One line naming the output and
    "disk full", exit 2, nothing left on the full disk. The disk: a 16 KiB tmpfs this test mounts (root)."""
    from astrai_core.checkpoint.model_dir import save_checkpoint
    from conftest import sharp_random_model

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    model = sharp_random_model(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    tiny_trained = save_checkpoint(tmp_path / "ckpt", model, model.cfg, core_tiny_data["tokenizer"])
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)], check=True)
    try:
        out_path = full / ("model" if command == "export-hf" else "model.gguf")
        out = run_astrai(tmp_path, command, str(tiny_trained), str(out_path))
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stderr.startswith(f"astrai: error: {out_path}: disk full while writing it ("), out.stderr
        assert list(full.iterdir()) == []
    finally:
        subprocess.run(["umount", str(full)], check=True)


@pytest.mark.parametrize("free_pages", [1, 3])
def test_astrai_train_on_a_full_disk_is_one_line_and_leaves_no_empty_folders(tmp_path, core_tiny_data, free_pages):
    """Issue 50 (15): `astrai train` with its out_dir on a full disk said what failed but left empty `t.ckpts/`
    and `t.logs/` behind. One line naming the output and "disk full", exit 2, and no empty folder left: the disk has room for the
    launcher's config file and nothing more (its first metrics line fails), then for a few lines (the final save
    fails: the steps logged stay)."""
    import yaml

    from test_train import make_cfg

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)], check=True)
    try:
        (full / "ballast").write_bytes(b"x" * 4096 * (4 - free_pages))  # a 4-page disk
        cfg = make_cfg(core_tiny_data, full / "t", max_steps=6)
        (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        out = run_astrai(tmp_path, "train", "--config", str(tmp_path / "cfg.yaml"), "--nproc", "1")
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stderr.startswith(f"astrai: error: {full / 't'}: disk full while "), out.stderr
        left = {f.relative_to(full).as_posix(): f.stat().st_size for f in full.rglob("*") if f.is_file()}
        assert all(left.values()) and {f.name for f in full.iterdir()} == {"ballast", *{f.split("/")[0] for f in left}}, left
    finally:
        subprocess.run(["umount", str(full)], check=True)
