"""GGUF export against llama.cpp built from source (scripts/build_llama_cpp.sh): a model trained here tokenizes,
generates and scores in llama.cpp as it does in astrai. Without a build the llama.cpp tests are skipped, saying so;
ASTRAI_REQUIRE_LLAMA_CPP=1 (CI, after running the build script) makes a missing build a failure.

What is checked, on a model trained for a few seconds and on random models of each exportable shape:
* llama-tokenize gives exactly the ids of the astrai tokenizer (mixed scripts, whitespace runs, special tokens);
* 64 greedy tokens from the f32 file equal `astrai generate --temperature 0`;
* llama-perplexity of the f32 file equals astrai's own on the same chunks (0.1%), and Q8_0's is within 1% of it;
* unsupported options and tokenizers are refused by name, nothing written (these need no llama.cpp).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from astrai_core.checkpoint import load_model, save_checkpoint
from astrai_core.config import ModelConfig
from astrai_core.errors import AstraiError
from astrai_core.gguf_export import export_gguf, rope_adjacent_pairs
from astrai_core.model import apply_rope, rope_tables
from conftest import PROJECT_ROOT, _core_text, sharp_random_model

BUILD_SCRIPT = PROJECT_ROOT / "scripts" / "build_llama_cpp.sh"
# Held-out sentences (another seed than training's), and what a byte-level tokenizer can get wrong (these two are in
# the tokenizer's training text, so its merges cover them).
TOKENIZE_TEXTS = [
    _core_text(40, seed=9),
    "  leading spaces,\ttabs and\n\n\nnewlines   then trailing spaces   ",
    "中文测试：你好，世界。 Emoji 👍🏽🎉, accents: café, naïve. Numbers 12345 and 3.14, it's we'll they'd IT'S WE'LL",
    "<|user|>the king speaks<|end_of_turn|><|assistant|>to the crown.<|end_of_text|>",
]
PROMPT = "the king"


def llama_cpp_bin() -> Path | None:
    """The bin directory the build script fills, or None when it has not run (the pinned version is read from the
    script, so a new pin is a missing build until it runs)."""
    version = re.search(r"^VERSION=(\S+)", BUILD_SCRIPT.read_text(), re.M).group(1)
    root = Path(os.environ.get("ASTRAI_LLAMA_CPP_DIR", Path.home() / ".cache" / "astrai" / f"llama.cpp-{version}"))
    return root / "bin" if (root / "bin" / ".complete").is_file() else None


@pytest.fixture(scope="module")
def llama_bin() -> Path:
    found = llama_cpp_bin()
    if found is None:
        why = f"llama.cpp is not built: run {BUILD_SCRIPT.relative_to(PROJECT_ROOT)} (about 25 min on 2 cores)"
        if os.environ.get("ASTRAI_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(f"ASTRAI_REQUIRE_LLAMA_CPP=1 but {why}")
        pytest.skip(why)
    return found


def run_llama(bin_dir: Path, tool: str, *args) -> str:
    out = subprocess.run([str(bin_dir / tool), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{tool} {args} failed ({out.returncode}):\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    """astrai's tokenizer recipe (bpe.train_tokenizer: special tokens, GPT-2 split) on the training text."""
    from astrai_core.bpe import train_tokenizer

    path = tmp_path_factory.mktemp("gguf_tok") / "tokenizer.json"
    train_tokenizer([_core_text(2000, 0), *TOKENIZE_TEXTS[1:3]], vocab_size=384).save(str(path))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_path, core_write_packed) -> dict:
    """A model trained here for a few seconds, its f32 and Q8_0 exports: {"ckpt", "f32", "q8_0"}."""
    from tokenizers import Tokenizer

    from astrai_core.config import TrainConfig
    from astrai_core.io import sha256_file
    from astrai_core.train import train

    root = tmp_path_factory.mktemp("gguf_trained")
    ids = Tokenizer.from_file(str(tokenizer_path)).encode(_core_text(3000, 1)).ids
    data = core_write_packed(root / "train.h5", ids, tokenizer_sha256=sha256_file(tokenizer_path), vocab_size=384)
    cfg = TrainConfig.model_validate(dict(
        model=dict(vocab_size=384, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128),
        optim=dict(lr=1e-2, min_lr=1e-3, warmup_steps=5), train_data=str(data), tokenizer=str(tokenizer_path),
        out_dir=str(root / "ckpt"), seq_len=64, batch_size=8, max_steps=60, log_every=20, device="cpu"))
    train(cfg)
    ckpt = root / "ckpt"
    return {"ckpt": ckpt, "f32": export_gguf(ckpt, root / "model.gguf"),
            "q8_0": export_gguf(ckpt, root / "model-q8_0.gguf", "q8_0")}


# ---- no llama.cpp needed ----

def test_rope_permutation_gives_the_same_attention_scores():
    """model.py rotates pairs (i, i + d/2); llama.cpp's llama rotates (2i, 2i + 1). q.k after rotation is the same
    once q_proj's and k_proj's rows are permuted per head (rope_adjacent_pairs): the scores llama.cpp computes."""
    torch.manual_seed(0)
    n_heads, d, dim, T = 4, 16, 32, 10
    w_q, w_k, x = torch.randn(n_heads * d, dim), torch.randn(2 * d, dim), torch.randn(T, dim)
    cos, sin = rope_tables(d, T, 10000.0)

    def adjacent_rope(v):  # GPT-J style, as ggml's rope mode 0: pair (2i, 2i+1) rotated by angle theta_i
        angle = torch.outer(torch.arange(T).float(), 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d))
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1).flatten(-2)

    def heads(v, n):
        return v.view(T, n, d).transpose(0, 1)

    q, k = heads(x @ w_q.T, n_heads), heads(x @ w_k.T, 2)
    ours = apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).repeat_interleave(2, 0).transpose(1, 2)
    q2 = heads(x @ rope_adjacent_pairs(w_q, n_heads).T, n_heads)
    k2 = heads(x @ rope_adjacent_pairs(w_k, 2).T, 2)
    theirs = adjacent_rope(q2) @ adjacent_rope(k2).repeat_interleave(2, 0).transpose(1, 2)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_file_holds_the_tokenizer_and_weights(tmp_path, tokenizer_path):
    """Read back with gguf's reader: architecture, vocabulary, special tokens, and Q8_0 weights within a block's
    rounding of the f32 ones."""
    import gguf
    from tokenizers import Tokenizer

    model = sharp_random_model(vocab_size=384, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                               mlp="relu2", tie_embeddings=False)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    tok = Tokenizer.from_file(str(tokenizer_path))
    for out_type in ("f32", "q8_0"):
        reader = gguf.GGUFReader(export_gguf(ckpt, tmp_path / f"{out_type}.gguf", out_type))
        field = lambda key: reader.fields[key].contents()  # noqa: E731
        assert field("general.architecture") == "arcee" and field("tokenizer.ggml.pre") == "gpt-2"
        assert field("tokenizer.ggml.tokens")[:300] == [tok.id_to_token(i) for i in range(300)]
        assert field("tokenizer.ggml.eos_token_id") == tok.token_to_id("<|end_of_text|>")
        assert field("tokenizer.ggml.eot_token_id") == tok.token_to_id("<|end_of_turn|>")
        assert field("tokenizer.ggml.add_bos_token") is False
        assert field("tokenizer.ggml.token_type")[tok.token_to_id("<|user|>")] == gguf.TokenType.CONTROL
        tensors = {t.name: t for t in reader.tensors}
        assert "output.weight" in tensors and "blk.0.ffn_gate.weight" not in tensors  # untied; relu2 has no gate
        down = tensors["blk.1.ffn_down.weight"]
        values = gguf.quants.dequantize(down.data, down.tensor_type).reshape(model.layers[1].mlp.down_proj.weight.shape)
        expected = model.layers[1].mlp.down_proj.weight.detach().numpy()
        tolerance = 0 if out_type == "f32" else np.abs(expected).max() / 127
        assert np.abs(values - expected).max() <= tolerance
        assert down.tensor_type == (gguf.GGMLQuantizationType.Q8_0 if out_type == "q8_0" else gguf.GGMLQuantizationType.F32)


@pytest.mark.parametrize("overrides, named", [
    (dict(qk_norm=True), "model.qk_norm"),
    (dict(qkv_bias=True), "model.qkv_bias"),
    (dict(attn_gate=True), "model.attn_gate"),
    (dict(attention="mla", mla_kv_rank=16, mla_rope_dim=8), "model.attention is 'mla'"),
    (dict(n_experts=4, qk_norm=False), "model.n_experts"),
    (dict(logit_softcap=30.0), "model.logit_softcap"),
    (dict(value_embeds=True), "model.value_embeds"),
    (dict(x0_scalars=True), "model.x0_scalars"),
])
def test_options_llama_cpp_does_not_compute_are_refused(tmp_path, tokenizer_path, overrides, named):
    model = sharp_random_model(vocab_size=384, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64, **overrides)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    with pytest.raises(AstraiError, match=f"cannot export to GGUF: {named}"):
        export_gguf(ckpt, tmp_path / "out.gguf")
    assert list(tmp_path.glob("*gguf*")) == []


def test_a_tokenizer_with_another_split_is_refused(tmp_path, tokenizer_path):
    """A pre-tokenizer other than the GPT-2 split (a copied tokenizer) would tokenize differently in llama.cpp."""
    import json

    tok = json.loads(tokenizer_path.read_text())
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    model = sharp_random_model(vocab_size=384, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tmp_path / "tokenizer.json")
    with pytest.raises(AstraiError, match="pre-tokenizer .*Metaspace.* is not ByteLevel"):
        export_gguf(ckpt, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_cli_export_and_refusal(tmp_path, tokenizer_path):
    from typer.testing import CliRunner

    from astrai.cli import app

    model = sharp_random_model(vocab_size=384, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    result = CliRunner().invoke(app, ["export-gguf", str(ckpt), str(tmp_path / "m.gguf"), "--type", "q8_0"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "q8_0" in result.output and (tmp_path / "m.gguf").is_file()
    gated = sharp_random_model(vocab_size=384, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64,
                               attn_gate=True)
    ckpt = save_checkpoint(tmp_path / "gated", gated, gated.cfg, tokenizer_path)
    result = CliRunner().invoke(app, ["export-gguf", str(ckpt), str(tmp_path / "g.gguf")])
    assert result.exit_code == 2 and not (tmp_path / "g.gguf").exists()
    assert result.output.startswith("astrai: error: cannot export to GGUF: model.attn_gate is set")
    assert result.output.count("\n") == 1  # one line
    result = CliRunner().invoke(app, ["export-gguf", str(ckpt), str(tmp_path / "g.gguf"), "--type", "q4_k"])
    assert result.exit_code == 2 and "--type q4_k: expected one of f32, q8_0" in result.output


# ---- against llama.cpp ----

def llama_token_ids(bin_dir: Path, gguf_file: Path, text: str, tmp_path: Path) -> list[int]:
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    out = run_llama(bin_dir, "llama-tokenize", "-m", gguf_file, "-f", tmp_path / "text.txt", "--ids", "--log-disable")
    return [int(i) for i in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def test_llama_cpp_tokenizes_to_the_same_ids(llama_bin, trained, tokenizer_path, tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    for text in TOKENIZE_TEXTS:
        ours = tok.encode(text, add_special_tokens=False).ids
        assert llama_token_ids(llama_bin, trained["f32"], text, tmp_path) == ours, text


def llama_greedy(bin_dir: Path, gguf_file: Path, prompt: str, n: int, ctx: int) -> str:
    """n greedy tokens after `prompt` (its ids exactly: no BOS), the text only."""
    return run_llama(bin_dir, "llama-completion", "-m", gguf_file, "-p", prompt, "-n", n, "-c", ctx, "--temp", 0,
                     "--top-k", 1, "--seed", 0, "-no-cnv", "--no-display-prompt", "--no-warmup", "-t", 1)


def astrai_generate(ckpt: Path, prompt: str, n: int) -> str:
    from typer.testing import CliRunner

    from astrai.cli import app

    result = CliRunner().invoke(app, ["generate", "--model", str(ckpt), "--prompt", prompt, "--max-new-tokens", str(n),
                                      "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(prompt)
    return result.output[len(prompt):].removesuffix("\n")


def test_llama_cpp_greedy_continuation_equals_astrai_generate(llama_bin, trained):
    ours = astrai_generate(trained["ckpt"], PROMPT, 64)
    assert len(ours) > 64  # 64 tokens of text, not a stop
    assert llama_greedy(llama_bin, trained["f32"], PROMPT, 64, 128) == ours


# Every exportable shape, on sharp random models (greedy choices rarely near ties).
SHAPES = {
    "llama_mqa_untied": dict(n_kv_heads=1, tie_embeddings=False),
    "llama_mha_rope_linear": dict(n_kv_heads=4, rope_scaling="linear", rope_factor=2.0, rope_theta=500.0),
    "llama_rope_ntk_head_dim": dict(rope_scaling="ntk", rope_factor=4.0, rope_theta=500.0, attn_head_dim=16),
    "arcee_relu2": dict(mlp="relu2", tie_embeddings=False),
}


@pytest.mark.parametrize("name", SHAPES)
def test_llama_cpp_greedy_parity_for_every_exportable_shape(llama_bin, tmp_path, tokenizer_path, name):
    model = sharp_random_model(vocab_size=384, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128,
                               **SHAPES[name])
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    gguf_file = export_gguf(ckpt, tmp_path / "m.gguf")
    assert llama_greedy(llama_bin, gguf_file, PROMPT, 32, 128) == astrai_generate(ckpt, PROMPT, 32)


def astrai_perplexity(ckpt: Path, ids: list[int], ctx: int) -> tuple[float, int, int]:
    """What llama-perplexity computes, with astrai's model: chunks of `ctx` tokens, each scored on the tokens of
    its second half (the first half is context). -> (perplexity, tokens scored, characters of those tokens)."""
    model, tok, _ = load_model(ckpt)
    first, nll, count, chars = ctx // 2, 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - ctx + 1, ctx):
            chunk = torch.tensor(ids[start:start + ctx])
            logp = torch.log_softmax(model(chunk[None])[0].double(), -1)
            nll -= logp[first:ctx - 1].gather(1, chunk[first + 1:, None]).sum().item()
            count += ctx - 1 - first
            chars += len(tok.decode(chunk[first + 1:].tolist()))
    return math.exp(nll / count), count, chars


def llama_perplexity(bin_dir: Path, gguf_file: Path, text_file: Path, ctx: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf_file), "-f", str(text_file), "-c", str(ctx),
                          "-b", str(ctx), "-t", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return float(re.search(r"Final estimate: PPL = ([\d.]+)", out.stdout + out.stderr).group(1))


def test_q8_0_scores_within_one_percent_of_f32(llama_bin, trained, tokenizer_path, tmp_path):
    """bits/char on held-out text: the f32 file equals astrai's own (0.1%), the Q8_0 file is within 1% of it."""
    from tokenizers import Tokenizer

    text = _core_text(400, seed=5)
    (tmp_path / "test.txt").write_text(text)
    ids = Tokenizer.from_file(str(tokenizer_path)).encode(text).ids
    ppl_astrai, count, chars = astrai_perplexity(trained["ckpt"], ids, 128)

    def bits_per_char(ppl: float) -> float:
        return math.log(ppl) * count / math.log(2) / chars

    bpc = {"astrai": bits_per_char(ppl_astrai)}
    for out_type in ("f32", "q8_0"):
        bpc[out_type] = bits_per_char(llama_perplexity(llama_bin, trained[out_type], tmp_path / "test.txt", 128))
    print(f"bits/char on {chars} chars ({count} tokens): {bpc}")
    assert bpc["f32"] == pytest.approx(bpc["astrai"], rel=1e-3)
    assert bpc["q8_0"] == pytest.approx(bpc["f32"], rel=1e-2)
    assert bpc["f32"] < 0.9 * math.log2(384) * count / chars  # the model learnt something: far below uniform


def test_register_attaches_the_gguf_file(tmp_path, trained, monkeypatch):
    """register.gguf: q8_0 puts the file in the version's artifacts (artifacts/model.gguf) and tags its type: the
    same tensors as `astrai export-gguf --type q8_0` of the checkpoint (the file the llama.cpp tests run). And
    `astrai export-gguf models:/NAME@ALIAS` exports a registered version."""
    from typer.testing import CliRunner

    from astrai.cli import app

    import json
    import shutil

    import gguf
    import mlflow

    from tasks.params import Params
    from tasks.register import register

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    shutil.copytree(trained["ckpt"], tmp_path / "data" / "pretrain")
    (tmp_path / "metrics.json").write_text(json.dumps({"pretrain/task_accuracy": 0.5}))
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.get_tracking_uri())  # the store `astrai export-gguf` reads
    try:
        exp = mlflow.create_experiment("gguf", artifact_location=(tmp_path / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=exp):
            result = register(Params(register={"model_name": "gguf_test", "gguf": "q8_0"}), tmp_path / "metrics.json",
                              tmp_path / "register", tmp_path)
        local = Path(mlflow.artifacts.download_artifacts("models:/gguf_test@champion", dst_path=str(tmp_path / "dl")))
        cli = CliRunner().invoke(app, ["export-gguf", "models:/gguf_test@champion", str(tmp_path / "cli.gguf")])
        assert cli.exit_code == 0, cli.output
    finally:
        mlflow.set_tracking_uri(previous)
    assert result["tags"]["gguf_export"] == "q8_0"
    registered, exported = (gguf.GGUFReader(f) for f in (local / "artifacts" / "model.gguf", trained["q8_0"]))
    assert registered.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert [t.name for t in registered.tensors] == [t.name for t in exported.tensors]
    for ours, theirs in zip(registered.tensors, exported.tensors):
        assert np.array_equal(ours.data, theirs.data), ours.name
    from_registry, exported = (gguf.GGUFReader(f) for f in (tmp_path / "cli.gguf", trained["f32"]))
    for ours, theirs in zip(from_registry.tensors, exported.tensors, strict=True):
        assert np.array_equal(ours.data, theirs.data), ours.name
