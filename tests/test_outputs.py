"""Nothing lost (issue 32, item 1): a command writes over a folder only if that folder holds an earlier output of
the same command (or --force), and never over its own input. One rule, astrai_core/io.py check_output, for every
writer: the export and import commands, the stages, checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from astrai_core.checkpoint import save_checkpoint, verify_checkpoint
from astrai_core.errors import AstraiError
from astrai_core.hf import export_hf, import_hf
from astrai_core.io import OUTPUT_MARK, atomic_path, written_by
from conftest import PROJECT_ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny astrai checkpoint (what `astrai export-hf` reads)."""
    import torch

    from astrai_core.bpe import train_tokenizer
    from astrai_core.config import ModelConfig
    from astrai_core.model import Transformer

    root = tmp_path_factory.mktemp("ckpt")
    tok = root / "tokenizer.json"
    train_tokenizer(["ROMEO.\nBut soft, what light through yonder window breaks?\n"] * 20, vocab_size=300,
                    min_frequency=2).save(str(tok))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64))
    return save_checkpoint(root / "ckpt", model, model.cfg, tok)


def astrai(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "astrai.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}, timeout=300)


def snapshot(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_and_import_refuse_a_folder_they_did_not_write_and_their_own_input(tmp_path, checkpoint):
    """The issue's commands: `export-hf CKPT data` with data/ holding other files, `export-hf CK CK`, and
    `import-hf HF existing_dir` each stop with one line naming the folder and change nothing."""
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    (data / "corpus" / "train.jsonl").write_text('{"text": "x"}\n')
    before, ckpt_before = snapshot(data), snapshot(checkpoint)

    out = astrai("export-hf", checkpoint, "data", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("astrai: error: data: exists, is not empty"), out.stderr
    assert "--force" in lines[0]
    assert snapshot(data) == before

    out = astrai("export-hf", checkpoint, checkpoint, "--force", cwd=tmp_path)  # --force does not change this
    assert out.returncode == 2 and "the output folder is the input" in out.stderr, out.stderr
    for target, relation in ((checkpoint / "hf", "is inside the input"), (checkpoint.parent, "contains the input")):
        with pytest.raises(AstraiError, match=f"the output folder {relation}"):
            export_hf(checkpoint, target, force=True)
    assert snapshot(checkpoint) == ckpt_before
    verify_checkpoint(checkpoint)

    # An earlier export is replaced without --force; so is an empty folder.
    (tmp_path / "hf").mkdir()
    for _ in range(2):
        export_hf(checkpoint, tmp_path / "hf")
    assert written_by(tmp_path / "hf") == "astrai export-hf"

    existing = tmp_path / "existing_dir"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    out = astrai("import-hf", "hf", "existing_dir", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("astrai: error: existing_dir: exists, is not empty"), \
        out.stderr
    assert snapshot(existing) == {"notes.txt": b"mine"}
    with pytest.raises(AstraiError, match="the output folder is the input"):
        import_hf(tmp_path / "hf", tmp_path / "hf")
    # A folder holding an import is not an export's output, nor the other way round.
    import_hf(tmp_path / "hf", tmp_path / "imported")
    with pytest.raises(AstraiError, match="imported: exists, is not empty and holds an output of astrai import-hf"):
        export_hf(checkpoint, tmp_path / "imported")
    with pytest.raises(AstraiError, match="holds an output of astrai export-hf"):
        import_hf(tmp_path / "imported", tmp_path / "hf")

    # --force replaces a folder of other files (never the input, above).
    export_hf(checkpoint, data, force=True)
    assert not (data / "corpus").exists() and (data / "model.safetensors").is_file()


def test_every_writer_replaces_only_its_own_earlier_output(tmp_path, checkpoint):
    """The stages' and checkpoints' folders go through the same rule: a stage rewrites its own folder, and refuses
    one that holds something else (here: a checkpoint where the tokenizer stage writes, and hand-made files)."""
    from tasks.params import TokenizerParams
    from tasks.tokenizer import build_tokenizer

    out = tmp_path / "tokenizer"
    source = TokenizerParams(source=str(checkpoint))
    build_tokenizer(source, tmp_path, out)
    first = (out / "tokenizer.json").read_bytes()
    build_tokenizer(source, tmp_path, out)  # its own earlier output: replaced
    assert (out / "tokenizer.json").read_bytes() == first and written_by(out) == "stage tokenizer"

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("keep")
    with pytest.raises(AstraiError, match="foreign: exists, is not empty and holds files not written by stage "
                                          "tokenizer"):
        build_tokenizer(source, tmp_path, foreign)
    with pytest.raises(AstraiError, match="holds an output of astrai checkpoint"):
        build_tokenizer(source, tmp_path, checkpoint)
    assert (foreign / "keep.txt").read_text() == "keep" and verify_checkpoint(checkpoint)
    assert not list(tmp_path.glob(".*.tmp"))  # refused before anything was written

    # A file is replaced as a file; an empty folder as nothing; the mark is in every folder written.
    with atomic_path(tmp_path / "note.txt", "test") as tmp:
        tmp.write_text("one")
    with atomic_path(tmp_path / "note.txt", "test") as tmp:
        tmp.write_text("two")
    assert (tmp_path / "note.txt").read_text() == "two"
    assert (checkpoint / OUTPUT_MARK).is_file()
