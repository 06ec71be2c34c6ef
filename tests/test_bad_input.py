"""Bad input to the `astrai` command (issue 32): one line `astrai: error: <file or key>: <what>`, exit 2, no
traceback, nothing written. One table, each case the real command in a subprocess on files broken one way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai_core.runtime.io import sha256_file
from conftest import PROJECT_ROOT

ASTRAI = [sys.executable, "-m", "astrai.cli"]
MODEL = dict(vocab_size=300, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64)


def rehash(ckpt: Path) -> None:
    """Make manifest.json agree with the files again: the fault is in a file's content, not a changed hash."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {name: sha256_file(ckpt / name) for name in manifest["files"]}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def broken_copy(src: Path, dst: Path, name: str, content: bytes | None = None, **json_changes) -> Path:
    """A copy of directory `src` whose file `name` holds `content` (or its JSON with `json_changes` applied)."""
    shutil.copytree(src, dst)
    if json_changes:
        content = json.dumps({**json.loads((src / name).read_text()), **json_changes}).encode()
    (dst / name).write_bytes(content)
    if (dst / "manifest.json").is_file():
        rehash(dst)
    return dst


@pytest.fixture(scope="module")
def work(tmp_path_factory, core_tiny_data):
    """A tiny checkpoint, its Hugging Face export, a train config on packed files, a project with params.yaml; and
    copies of each broken one way."""
    from astrai_core.checkpoint.checkpointer import save_resumable
    from astrai_core.checkpoint.model_dir import save_checkpoint
    from astrai_core.convert.hf import export_hf
    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer
    from astrai_core.training.config import TrainConfig

    root = tmp_path_factory.mktemp("bad_input")
    cfg = ModelConfig(**MODEL)
    torch.manual_seed(0)
    model = Transformer(cfg)
    save_checkpoint(root / "ckpt", model, cfg, core_tiny_data["tokenizer"])
    export_hf(root / "ckpt", root / "hf")
    weights = (root / "ckpt" / "model.safetensors").read_bytes()
    for d, src in (("c", "ckpt"), ("h", "hf")):
        broken_copy(root / src, root / f"{d}_truncated", "model.safetensors", weights[:100])
        broken_copy(root / src, root / f"{d}_empty", "model.safetensors", b"")
        broken_copy(root / src, root / f"{d}_config", "config.json", b"not json {")
        broken_copy(root / src, root / f"{d}_tokenizer", "tokenizer.json", b"not json {")
    broken_copy(root / "ckpt", root / "c_huge", "config.json", dim=10**9)
    broken_copy(root / "hf", root / "h_huge", "config.json", hidden_size=1e9, head_dim=None)
    (root / "a_file").write_text("x")

    # astrai train --config: a run on the tiny packed files, and the same with one thing wrong
    run = dict(model=MODEL, seq_len=32, batch_size=2, max_steps=2, train_data=str(core_tiny_data["train"]),
               val_data=str(core_tiny_data["val"]), tokenizer=str(core_tiny_data["tokenizer"]),
               out_dir=str(root / "out"), optim={"warmup_steps": 1}, device="cpu")
    (root / "cfg_beta1.json").write_text(json.dumps({**run, "optim": {"beta1": 1.5, "warmup_steps": 1}}))
    (root / "corrupt.h5").write_bytes(Path(core_tiny_data["train"]).read_bytes()[:500])
    (root / "cfg_corrupt_h5.json").write_text(json.dumps({**run, "train_data": str(root / "corrupt.h5")}))
    (root / "cfg_missing_h5.json").write_text(json.dumps({**run, "val_data": str(root / "nowhere.h5")}))
    # A resumable checkpoint of this run whose train_state.pt holds something weights_only refuses (a function).
    resumed = TrainConfig(**{**run, "out_dir": str(root / "resumed")})
    (root / "cfg_resume.json").write_text(resumed.model_dump_json())
    step = save_resumable(resumed.checkpoints, 1, 2, model=model, model_cfg=cfg, tokenizer_path=resumed.tokenizer,
                          train_config=resumed, train_state={"step": 1})
    torch.save({"step": 1, "hook": os.getcwd}, step / "train_state.pt")
    rehash(step)

    # a project: params.yaml and profiles/, a JSONL corpus with a lone surrogate
    project = root / "project"
    (project / "profiles").mkdir(parents=True)
    (project / "params.yaml").write_text((PROJECT_ROOT / "params.yaml").read_text())
    (project / "profiles" / "quick.yaml").write_text((PROJECT_ROOT / "profiles" / "quick.yaml").read_text())
    (project / "corpus").mkdir()
    (project / "corpus" / "docs.jsonl").write_text('{"text": "fine"}\n{"text": "half a pair: \\ud800 here"}\n')
    (project / "surrogate.yaml").write_text(f"corpus: {{source: {project / 'corpus'}}}\n")
    # pretrain's model of a 64-token context (as a quick-profile run leaves it), for sft's 256-token sequences
    shutil.copytree(root / "ckpt", project / "data" / "pretrain")
    return root


CASES = {  # id: (args, cwd under the work folder, the one line's text after "astrai: error: ")
    # generate on a checkpoint whose files are broken (their manifest agrees with them)
    "safetensors truncated": (["generate", "--model", "c_truncated", "--prompt", "x"], ".",
                              "c_truncated/model.safetensors: not a readable safetensors file"),
    "safetensors empty": (["generate", "--model", "c_empty", "--prompt", "x"], ".",
                          "c_empty/model.safetensors: not a readable safetensors file"),
    "config not JSON": (["generate", "--model", "c_config", "--prompt", "x"], ".",
                        "c_config/config.json: not valid JSON"),
    "tokenizer not JSON": (["generate", "--model", "c_tokenizer", "--prompt", "x"], ".",
                           "c_tokenizer/tokenizer.json: not a valid tokenizer file"),
    "dim 1e9": (["generate", "--model", "c_huge", "--prompt", "x"], ".",
                "c_huge/config.json: a model of 1.1e+19 parameters needs"),
    "temperature nan": (["generate", "--model", "ckpt", "--prompt", "x", "--temperature", "nan"], ".",
                        "--temperature nan: must be a finite number >= 0"),
    # import-hf with the same faults
    "import safetensors truncated": (["import-hf", "h_truncated", "out"], ".",
                                     "h_truncated/model.safetensors: cannot import: not a readable safetensors file"),
    "import safetensors empty": (["import-hf", "h_empty", "out"], ".",
                                 "h_empty/model.safetensors: cannot import: not a readable safetensors file"),
    "import config not JSON": (["import-hf", "h_config", "out"], ".", "h_config/config.json: cannot import: not valid JSON"),
    "import tokenizer not JSON": (["import-hf", "h_tokenizer", "out"], ".",
                                  "h_tokenizer/tokenizer.json: cannot import: not a valid tokenizer file"),
    "import hidden_size 1e9": (["import-hf", "h_huge", "out"], ".", "h_huge/config.json: a model of 3e+18 parameters"),
    # export-hf onto a file, or onto the current directory
    "export to a file": (["export-hf", "ckpt", "a_file"], ".", "a_file: is a file, not a directory"),
    "export to .": (["export-hf", "ckpt", "."], ".", ".: is the current directory"),
    "import to .": (["import-hf", "hf", "."], ".", ".: is the current directory"),
    # serve, train: arguments
    "port 99999": (["serve", "--model", "ckpt", "--port", "99999"], ".", "--port 99999: expected a TCP port from 1"),
    "port -5": (["serve", "--model", "ckpt", "--port", "-5"], ".", "--port -5: expected a TCP port from 1"),
    "alias-poll -3": (["serve", "--model", "ckpt", "--alias-poll", "-3"], ".", "--alias-poll -3: expected seconds >= 0"),
    "compile and batch-invariant": (["serve", "--model", "ckpt", "--compile", "--batch-invariant"], ".",
                                    "compile and batch_invariant cannot be combined"),
    "bf16 and batch-invariant": (["serve", "--model", "ckpt", "--dtype", "bf16", "--batch-invariant"], ".",
                                 "--dtype bf16 and --batch-invariant cannot be combined"),
    "nproc abc": (["train", "--config", "cfg_beta1.json", "--nproc", "abc"], ".", "--nproc abc: expected auto or"),
    "nproc 0": (["train", "--config", "cfg_beta1.json", "--nproc", "0"], ".", "--nproc 0: expected auto or"),
    "nproc -2": (["train", "--config", "cfg_beta1.json", "--nproc=-2"], ".", "--nproc -2: expected auto or"),
    # train: what the ranks used to find
    "beta1 1.5": (["train", "--config", "cfg_beta1.json", "--nproc", "1"], ".",
                  "cfg_beta1.json: optim.beta1: Input should be less than 1"),
    "corrupt HDF5": (["train", "--config", "cfg_corrupt_h5.json", "--nproc", "1"], ".",
                     "corrupt.h5: not a packed token file (HDF5 open failed"),
    "missing HDF5": (["train", "--config", "cfg_missing_h5.json", "--nproc", "1"], ".",
                     "nowhere.h5: packed token file not found"),
    "invalid train_state.pt": (["train", "--config", "cfg_resume.json", "--nproc", "1"], ".",
                               "train_state.pt: corrupt training state"),
    # the pipeline's settings
    "--set bad YAML": (["pipeline", "--set", "pretrain.max_steps=[1"], "project",
                       "--set 'pretrain.max_steps=[1': the value is not valid YAML"),
    "--profile a path": (["pipeline", "--profile", "../params"], "project",
                         "--profile ../params: no such profile; profiles: quick"),
    # a stage whose settings the model it starts from cannot take
    "seq_len beyond the start model's": (["stage", "sft"], "project", "params.yaml: sft: seq_len (256) exceeds "
                                         "model.max_seq_len (64), the shape of the model it starts from"),
    # a JSONL corpus with half a UTF-16 pair
    "lone surrogate": (["stage", "corpus", "--params", "surrogate.yaml"], "project",
                       "docs.jsonl:2: a lone surrogate \\ud800 at character 13"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_naming_it(work, case):
    args, cwd, message = CASES[case]
    cwd = work / cwd
    def files() -> list[Path]:  # what the command left, MLflow's store aside (the stage's failed run is recorded)
        # and the command's log (.astrai/logs, named in its error line)
        return sorted(p.relative_to(work) for p in work.rglob("*") if not p.relative_to(work).parts[0].startswith(
            ("mlflow.db", "artifacts")) and ".astrai" not in p.relative_to(work).parts)

    before = files()
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), MLFLOW_TRACKING_URI=f"sqlite:///{work}/mlflow.db")
    env.pop("MLFLOW_RUN_ID", None)
    out = subprocess.run(ASTRAI + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    assert "weights_only=False" not in out.stderr + out.stdout
    lines = [line for line in out.stderr.splitlines() if line.strip()]  # MLflow may say it made its database first
    assert lines[-1].startswith("astrai: error: ") and sum("error" in line.lower() for line in lines) == 1, out.stderr
    assert message in lines[-1], lines[-1]
    assert files() == before, set(files()) ^ set(before)  # nothing written


def test_the_parameter_estimate_is_the_models_count():
    """check_fits_in_memory's estimate: every matrix and embedding of each variant, short of the model's own count
    by only its norm gains, biases and scalars."""
    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer, estimated_params

    variants = [{}, {"tie_embeddings": False, "qkv_bias": True}, {"qk_norm": True, "attn_gate": True},
                {"attention": "mla", "n_experts": 4, "n_shared_experts": 1}, {"n_experts": 4, "moe_ffn_dim": 32},
                {"mlp": "relu2", "value_embeds": True, "x0_scalars": True}, {"attn_head_dim": 16}]
    for kw in variants:
        cfg = ModelConfig(**{**MODEL, "dim": 64, "n_layers": 2, **kw})
        exact = Transformer(cfg).num_params()
        assert 0.97 * exact <= estimated_params(cfg) <= exact, (kw, estimated_params(cfg), exact)
