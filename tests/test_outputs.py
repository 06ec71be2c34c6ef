"""Nothing lost (issue 32, item 1): a command writes over a folder only if that folder holds an earlier output of
the same command (or --force), and never over its own input. One rule, astrai_core/runtime/io.py check_output, for every
writer: the export and import commands, the stages, checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from astrai_core.checkpoint.model_dir import save_checkpoint, verify_checkpoint
from astrai_core.convert.hf import export_hf, import_hf
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import OUTPUT_MARK, atomic_path, written_by
from conftest import PROJECT_ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny astrai checkpoint (what `astrai export-hf` reads)."""
    import torch

    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer
    from astrai_core.tokenizer.bpe import train_tokenizer

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
    from tasks.run.schema import TokenizerParams
    from tasks.stages.tokenizer import build_tokenizer

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


def test_export_gguf_replaces_only_its_own_earlier_file(tmp_path, checkpoint):
    """Issue 43, item 1: `export-gguf data/grpo README.md` made README.md a GGUF file, and an export onto another
    checkpoint's model.safetensors broke it. A file export-gguf did not write is refused in one line (unless
    --force), and so is a folder; its own earlier file is replaced without asking."""
    other = tmp_path / "other"
    save_checkpoint(other, *(lambda m: (m, m.cfg))(_tiny_model()), checkpoint / "tokenizer.json")
    readme = tmp_path / "README.md"
    readme.write_text("# my project\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    weights = other / "model.safetensors"
    before = weights.read_bytes()
    for target, says in ((readme, "README.md: exists and was not written by astrai export-gguf"),
                         (weights, "model.safetensors: exists and was not written by astrai export-gguf"),
                         (folder, "folder: is a directory, not a file"),
                         (checkpoint / "model.safetensors", "the output folder is inside the input")):
        out = astrai("export-gguf", checkpoint, target, cwd=tmp_path)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("astrai: error: "), out.stderr
        assert says in lines[0], lines[0]
    assert readme.read_text() == "# my project\n" and weights.read_bytes() == before and verify_checkpoint(other)
    assert not list(tmp_path.rglob("*.tmp")) and not any(folder.iterdir())

    gguf_file = tmp_path / "model.gguf"
    for _ in range(2):  # an earlier export is replaced without --force
        out = astrai("export-gguf", checkpoint, gguf_file, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    out = astrai("export-gguf", checkpoint, readme, "--force", cwd=tmp_path)
    assert out.returncode == 0 and readme.read_bytes()[:4] == b"GGUF", out.stderr


def test_lm_eval_data_writes_only_a_folder_of_its_own(tmp_path):
    """Issue 43, item 2: `lm-eval-data --out` overwrote a user's own files, wrote into a DVC stage output
    (data/corpus) and into the checkout root. Its folder is now written whole and replaces only its own earlier
    one (or any with --force); never the corpus, the current directory, or a folder another command wrote. Also
    item 16: an unwritable folder and bad --limit values end in one `astrai: error:` line."""
    import json

    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    lines = ["Good morrow to you my lord", "What light through yonder window breaks", "I will go now",
             "Is this the way to the town"]
    speeches = "\n".join(f"{name}.\n{lines[i % 4]}{'?' if i % 3 else '.'}\n"
                          for i, name in enumerate(["ROMEO", "JULIET", "NURSE", "TYBALT", "FRIAR", "CAPULET"] * 8))
    text = f"\nSCENE I.\n\n{speeches}"
    (corpus / "test.jsonl").write_text(json.dumps({"id": "play", "text": text}) + "\n")
    (corpus / OUTPUT_MARK).write_text(json.dumps({"written_by": "stage corpus"}) + "\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "next_speaker.jsonl").write_text("my own items\n")
    pretrain = tmp_path / "data" / "pretrain"
    pretrain.mkdir()
    (pretrain / "model.safetensors").write_text("weights")
    (pretrain / OUTPUT_MARK).write_text(json.dumps({"written_by": "astrai checkpoint"}) + "\n")
    before = snapshot(tmp_path)

    for out_dir, says in (("mine", "mine: exists, is not empty and holds files not written by astrai lm-eval-data"),
                          ("data/corpus", "the output folder is the input"),
                          ("data/corpus/sub", "the output folder is inside the input"),
                          ("data/pretrain", "holds an output of astrai checkpoint"),
                          (".", "is the current directory")):
        out = astrai("lm-eval-data", "--corpus", "data/corpus", "--out", out_dir, cwd=tmp_path)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("astrai: error: "), out.stderr
        assert says in lines[0], lines[0]
    assert snapshot(tmp_path) == before

    for _ in range(2):  # its own earlier folder is replaced
        out = astrai("lm-eval-data", "--corpus", "data/corpus", "--out", "evals/data", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    assert written_by(tmp_path / "evals/data") == "astrai lm-eval-data"
    assert (tmp_path / "evals/data/next_speaker.jsonl").stat().st_size > 0
    out = astrai("lm-eval-data", "--corpus", "data/corpus", "--out", "mine", "--force", cwd=tmp_path)
    assert out.returncode == 0 and (mine / "next_speaker.jsonl").read_text() != "my own items\n", out.stderr

    # Root may write anywhere a mode allows; /proc takes no new folder from anyone.
    for args, says in ((["--out", "/proc/astrai-data"], "/proc"), (["--limit", "abc"], "Invalid value for '--limit'"),
                       (["--limit", "0"], "Invalid value for '--limit'")):
        out = astrai("lm-eval-data", "--corpus", "data/corpus", *args, cwd=tmp_path)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("astrai: error: "), out.stderr
        assert says in lines[0], lines[0]


def _tiny_model():
    import torch

    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer

    torch.manual_seed(1)
    return Transformer(ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64))
