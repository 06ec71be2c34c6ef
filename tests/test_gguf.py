"""GGUF export against llama.cpp built from source (scripts/build_llama_cpp.sh): a model trained here tokenizes,
generates and scores in llama.cpp as it does in astrai. Without a build the llama.cpp tests are skipped, saying so;
ASTRAI_REQUIRE_LLAMA_CPP=1 (CI, after running the build script) makes a missing build a failure.

What is checked, on a model trained for a few seconds and on random models of each exportable shape:
* llama-tokenize gives exactly the ids of the astrai tokenizer (mixed scripts, whitespace runs, special tokens);
* 64 greedy tokens from the f32 file (llama-simple) equal `astrai generate --temperature 0`;
* bits/char of the f32 file (llama-perplexity's saved log-probabilities) equal astrai's own on the same tokens
  (0.1%), and the Q8_0 file's are within 1% of them;
* register.gguf attaches the file to the registered version; `astrai export-gguf models:/...` exports one;
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
from tokenizers import Tokenizer

from astrai_core.checkpoint.model_dir import load_model, save_checkpoint
from astrai_core.convert.gguf_export import export_gguf, rope_adjacent_pairs
from astrai_core.inference.generate import generate
from astrai_core.model.config import ModelConfig
from astrai_core.model.transformer import apply_rope, rope_tables
from astrai_core.runtime.errors import AstraiError
from conftest import PROJECT_ROOT, _core_text, sharp_random_model

BUILD_SCRIPT = PROJECT_ROOT / "scripts" / "build_llama_cpp.sh"
# Held-out sentences (another seed than training's), and what a byte-level tokenizer can get wrong (the next two are
# in the tokenizer's training text, so its merges cover them).
TOKENIZE_TEXTS = [
    _core_text(40, seed=9),
    "  leading spaces,\ttabs and\n\n\nnewlines   then trailing spaces   ",
    "中文测试：你好，世界。 Emoji 👍🏽🎉, accents: café, naïve. Numbers 12345 and 3.14, it's we'll they'd IT'S WE'LL",
    "<|user|>the king speaks<|end_of_turn|><|assistant|>to the crown.<|end_of_text|>",
]
PROMPT = "the king"


TOOLS = ("llama-simple", "llama-tokenize", "llama-perplexity")  # what these tests run


def llama_cpp_bin() -> Path | None:
    """The bin directory the build script fills, or None when it has not run (the pinned version is read from the
    script, so a new pin is a missing build until it runs)."""
    version = re.search(r"^VERSION=(\S+)", BUILD_SCRIPT.read_text(), re.M).group(1)
    bin_dir = Path(os.environ.get("ASTRAI_LLAMA_CPP_DIR", Path.home() / ".cache" / "astrai" / f"llama.cpp-{version}")) / "bin"
    return bin_dir if all((bin_dir / tool).is_file() for tool in TOOLS) else None


@pytest.fixture(scope="module")
def llama_bin() -> Path:
    found = llama_cpp_bin()
    if found is None:
        why = f"llama.cpp is not built: run {BUILD_SCRIPT.relative_to(PROJECT_ROOT)} (about an hour on 2 busy cores)"
        if os.environ.get("ASTRAI_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(f"ASTRAI_REQUIRE_LLAMA_CPP=1 but {why}")
        pytest.skip(why)
    return found


def run_llama(bin_dir: Path, tool: str, *args) -> bytes:
    out = subprocess.run([str(bin_dir / tool), *map(str, args)], capture_output=True, timeout=300)
    assert out.returncode == 0, f"{tool} {args} failed ({out.returncode}):\n{out.stderr.decode(errors='replace')[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    """astrai's tokenizer recipe (bpe.train_tokenizer: special tokens, GPT-2 split) on the training text."""
    from astrai_core.tokenizer.bpe import train_tokenizer

    path = tmp_path_factory.mktemp("gguf_tok") / "tokenizer.json"
    # The odd texts 20 times: merges across the places where other pre-tokenizers split (" 12345", "IT'S", "\n\n\n"),
    # so a wrong split in llama.cpp shows in the ids.
    train_tokenizer([_core_text(2000, 0), *TOKENIZE_TEXTS[1:3] * 20], vocab_size=384).save(str(path))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_path, core_write_packed) -> dict:
    """A model trained here for a few seconds, its f32 and Q8_0 exports: {"ckpt", "f32", "q8_0"}."""

    from astrai_core.runtime.io import sha256_file
    from astrai_core.training.config import TrainConfig
    from astrai_core.training.train import train

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
    """transformer.py rotates pairs (i, i + d/2); llama.cpp's llama rotates (2i, 2i + 1). q.k after rotation is the same
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
    """Read back with gguf's reader: architecture, vocabulary, special tokens, Q8_0 weights within a block's
    rounding of the f32 ones, and bf16 weights equal to torch's bf16 rounding of them (what --dtype bf16 serves)."""
    import gguf

    model = sharp_random_model(vocab_size=384, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                               mlp="relu2", tie_embeddings=False)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    tok = Tokenizer.from_file(str(tokenizer_path))
    for out_type in ("f32", "q8_0", "bf16"):
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
        weight = model.layers[1].mlp.down_proj.weight.detach()
        expected = (weight.to(torch.bfloat16) if out_type == "bf16" else weight).float().numpy()
        tolerance = np.abs(expected).max() / 127 if out_type == "q8_0" else 0
        assert np.abs(values - expected).max() <= tolerance
        assert down.tensor_type == gguf.GGMLQuantizationType[out_type.upper()]
        assert tensors["blk.1.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


@pytest.mark.parametrize("overrides, named", [
    (dict(qk_norm=True), "model.qk_norm"),
    (dict(qkv_bias=True, mlp="relu2"), "model.qkv_bias with model.mlp relu2"),
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
    assert result.exit_code == 2 and "--type q4_k: expected one of f32, q8_0, bf16" in result.output


# ---- against llama.cpp ----

def llama_token_ids(bin_dir: Path, gguf_file: Path, text: str, tmp_path: Path) -> list[int]:
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    out = run_llama(bin_dir, "llama-tokenize", "-m", gguf_file, "-f", tmp_path / "text.txt", "--ids", "--log-disable")
    return [int(i) for i in re.findall(r"-?\d+", out.decode().strip().splitlines()[-1])]


def test_llama_cpp_tokenizes_to_the_same_ids(llama_bin, trained, tokenizer_path, tmp_path):

    tok = Tokenizer.from_file(str(tokenizer_path))
    for text in TOKENIZE_TEXTS:
        ours = tok.encode(text, add_special_tokens=False).ids
        assert llama_token_ids(llama_bin, trained["f32"], text, tmp_path) == ours, text


def llama_greedy(bin_dir: Path, gguf_file: Path, prompt: str, n: int) -> bytes:
    """n greedy tokens after `prompt` (its ids exactly: no BOS, as add_bos_token is false), their bytes only.
    llama-simple samples greedily (no temperature, top-k or seed to set) and prints the prompt, the tokens as they
    come, then a newline. (llama-completion --temp 0 --top-k 1 -no-cnv gives the same tokens, but its text goes
    through an asynchronous logger that lost the end of it in about one run in three with a pipe for stdout.)"""
    out = run_llama(bin_dir, "llama-simple", "-m", gguf_file, "-n", n, prompt)
    assert out.startswith(prompt.encode()) and out.endswith(b"\n"), out
    return out[len(prompt.encode()):-1]


def token_bytes(tokenizer_path: Path, ids: list[int]) -> bytes:
    """The bytes of `ids` as llama.cpp prints them: a byte-level token's own bytes (a random model's tokens need not
    end on a character boundary, which decode() would replace by U+FFFD), a special token's text."""
    import json

    from tokenizers import pre_tokenizers

    # ByteLevel's alphabet: byte b -> a printable character (the GPT-2 table); tokens are strings of them.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    assert set(byte_of) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = json.loads(tokenizer_path.read_text())
    strings = {i: s for s, i in tok["model"]["vocab"].items()}
    special = {t["id"]: t["content"].encode() for t in tok["added_tokens"]}
    return b"".join(special[i] if i in special else bytes(byte_of[c] for c in strings[i]) for i in ids)


def astrai_generate(ckpt: Path, prompt: str, n: int) -> str:
    from typer.testing import CliRunner

    from astrai.cli import app

    result = CliRunner().invoke(app, ["generate", "--model", str(ckpt), "--prompt", prompt, "--max-new-tokens", str(n),
                                      "--temperature", "0", "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(prompt)
    return result.output[len(prompt):].removesuffix("\n")


def test_llama_cpp_greedy_continuation_equals_astrai_generate(llama_bin, trained):
    ours = astrai_generate(trained["ckpt"], PROMPT, 64)
    assert len(ours) > 64  # 64 tokens of text, not a stop
    assert llama_greedy(llama_bin, trained["f32"], PROMPT, 64).decode() == ours


# Every exportable shape, on sharp random models (greedy choices rarely near ties). Their text is byte soup with
# special tokens in it, so the tokens' bytes are compared, not decode()'s text.
SHAPES = {
    "llama_mqa_untied": dict(n_kv_heads=1, tie_embeddings=False),
    "llama_mha_rope_linear": dict(n_kv_heads=4, rope_scaling="linear", rope_factor=2.0, rope_theta=500.0),
    "llama_rope_ntk_head_dim": dict(rope_scaling="ntk", rope_factor=4.0, rope_theta=500.0, attn_head_dim=16),
    "arcee_relu2": dict(mlp="relu2", tie_embeddings=False),
    "qwen2_qkv_bias": dict(qkv_bias=True),
}


def test_qwen2_gguf_file_imports_back_to_the_same_model(tmp_path, tokenizer_path):
    """Issue 49: a model with q/k/v biases is llama.cpp's qwen2 (half-split RoPE: nothing permuted); its GGUF file,
    f32 and Q8_0, imports back as a qwen2 model with the same logits (Q8_0: within its rounding)."""
    import gguf

    from astrai_core.convert.gguf_import import import_gguf

    model = sharp_random_model(vocab_size=512, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                               qkv_bias=True)  # room for what import adds to a tokenizer without a template
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    x = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        expected = model(x)
    for out_type, tolerance in (("f32", 1e-4), ("q8_0", 0.5)):
        gguf_file = export_gguf(ckpt, tmp_path / f"{out_type}.gguf", out_type)
        assert gguf.GGUFReader(gguf_file).fields["general.architecture"].contents() == "qwen2"
        imported, _, cfg = load_model(import_gguf(gguf_file, tmp_path / f"back-{out_type}"))
        assert cfg.qkv_bias
        with torch.no_grad():
            torch.testing.assert_close(imported(x), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("name", SHAPES)
def test_llama_cpp_greedy_parity_for_every_exportable_shape(llama_bin, tmp_path, tokenizer_path, name):
    tok = Tokenizer.from_file(str(tokenizer_path))  # a random model picks any id: only the tokenizer's own
    model = sharp_random_model(**{**dict(vocab_size=tok.get_vocab_size(), dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                         max_seq_len=128), **SHAPES[name]})
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    gguf_file = export_gguf(ckpt, tmp_path / "m.gguf")
    ids = generate(model, tok.encode(PROMPT).ids, 32)  # what astrai generate runs
    assert llama_greedy(llama_bin, gguf_file, PROMPT, 32) == token_bytes(tokenizer_path, ids)


def astrai_token_logprobs(ckpt: Path, chunks: np.ndarray) -> np.ndarray:
    """log p(token) from astrai's model for what llama-perplexity scores: in each chunk of n_ctx tokens, every token
    of the second half after the first (the first half is context). -> (n_chunks, n_ctx - 1 - n_ctx // 2)"""
    model, _, _ = load_model(ckpt)
    first = chunks.shape[1] // 2
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(chunks, dtype=torch.long)).double(), -1)
    return logp[:, first:-1].gather(2, torch.tensor(chunks[:, first + 1:, None], dtype=torch.long))[..., 0].numpy()


def llama_token_logprobs(bin_dir: Path, gguf_file: Path, text_file: Path, ctx: int, tmp_path: Path
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(its token ids (n_chunks, ctx), log p of each scored token) from llama-perplexity --save-all-logits (its
    printed estimate goes through an asynchronous logger that lost the last lines in 2 of 6 runs measured; the
    file is written and closed before it exits). The file: "_logits_", n_ctx, n_vocab, n_chunks (int32), the
    tokens, then per scored token (scale, min log p) as two float32 and n_vocab uint16: log p = min + scale * q."""
    logits_file = tmp_path / f"{gguf_file.stem}.logits"
    # The file's numbers alone: an f32 KV cache and no flash attention (llama.cpp's defaults, an f16 cache and flash
    # attention on CPU, moved log p by up to 7e-3 against astrai; with both off, 9e-5, the file's rounding). No
    # repacking: on a CPU with AMX, llama.cpp 0.3.36 repacks Q8_0 weights for its AMX kernels, and llama-perplexity
    # died of a segmentation fault on this test's Q8_0 file there (every run; with --no-repack it passes).
    run_llama(bin_dir, "llama-perplexity", "-m", gguf_file, "-f", text_file, "-c", ctx, "-b", ctx, "-t", 1,
              "--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off", "--no-repack",
              "--save-all-logits", logits_file)
    raw = logits_file.read_bytes()
    assert raw[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunks = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, n_chunks * n_ctx, 20).reshape(n_chunks, n_ctx)
    nv, first = 2 * ((n_vocab + 1) // 2) + 4, n_ctx // 2
    rows = np.frombuffer(raw, np.uint16, offset=20 + tokens.nbytes).reshape(n_chunks, n_ctx - 1 - first, nv)
    scale_min = rows[..., :4].copy().view(np.float32)  # (n_chunks, n_scored, 2)
    q = np.take_along_axis(rows[..., 4:], tokens[:, first + 1:, None].astype(np.int64), 2)[..., 0]
    return tokens, scale_min[..., 1].astype(np.float64) + scale_min[..., 0] * q


def test_q8_0_scores_within_one_percent_of_f32(llama_bin, trained, tokenizer_path, tmp_path):
    """bits/char on held-out text, scored as llama-perplexity does (chunks of 128 tokens, the second half of each):
    the f32 file's equal astrai's own (0.1%; each token's log p within 1e-3), the Q8_0 file's are within 1%."""
    text = _core_text(400, seed=5)
    (tmp_path / "test.txt").write_text(text)
    tok = Tokenizer.from_file(str(tokenizer_path))
    logp = {}
    for out_type in ("f32", "q8_0"):
        chunks, logp[out_type] = llama_token_logprobs(llama_bin, trained[out_type], tmp_path / "test.txt", 128, tmp_path)
    ids = tok.encode(text).ids
    assert chunks.flatten().tolist() == ids[:chunks.size]  # llama.cpp scored the tokens astrai's tokenizer gives
    logp["astrai"] = astrai_token_logprobs(trained["ckpt"], chunks)
    chars = sum(len(tok.decode(row[len(row) // 2 + 1:].tolist())) for row in chunks)  # of the scored tokens
    bpc = {name: -lp.sum() / math.log(2) / chars for name, lp in logp.items()}
    print(f"bits/char on {chars} chars ({logp['astrai'].size} tokens scored): {bpc}")
    print(f"max |log p difference| per token, f32 file vs astrai: {np.abs(logp['f32'] - logp['astrai']).max():.2e}")
    assert np.abs(logp["f32"] - logp["astrai"]).max() < 1e-3  # every token (the file rounds to range / 65535)
    assert bpc["f32"] == pytest.approx(bpc["astrai"], rel=1e-3)
    assert bpc["q8_0"] == pytest.approx(bpc["f32"], rel=1e-2)
    assert bpc["f32"] < 0.5 * math.log2(tok.get_vocab_size()) * logp["astrai"].size / chars  # it learnt something


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

    from tasks.run.schema import Params
    from tasks.stages.register import register

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
