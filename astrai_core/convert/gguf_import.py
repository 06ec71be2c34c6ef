"""GGUF import: a llama.cpp model file -> a Hugging Face model directory, which astrai_core.convert.hf.import_hf takes
in (import_gguf does both).

    astrai import-hf SmolLM2-135M-Instruct.Q4_1.gguf ckpt    # what `pretrain.init_from: FILE.gguf` does too

The reverse of astrai_core/convert/gguf_export.py, with the same tensor names. Read with the `gguf` package (llama.cpp's
own reader); every tensor is dequantized to float32 by its `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q2_K ... Q6_K), and q_proj/k_proj rows go back from llama.cpp's adjacent RoPE pairs to rotate-half
(gguf_export.rope_adjacent_pairs, inverted). The tokenizer (tokens, merges, pre-tokenizer, special tokens, chat
template) is transformers' GGUF converter's, so `transformers` must be installed for a GGUF file (it is, with the
project's dev extra). Architectures: llama (Llama, SmolLM, Mistral-style dense models) and qwen2 (q/k/v biases,
half-split RoPE: nothing permuted); any other is refused by name.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from astrai_core.convert.gguf_export import ADJACENT_ROPE, BLOCK_TENSORS, TOP_TENSORS
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import write_json

# GGUF architecture -> the Hugging Face model it is (qwen2: q/k/v biases, half-split RoPE: nothing to permute)
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}
# GGUF tensor -> HF checkpoint tensor (gguf_export's names, reversed; HF's carry the `model.` prefix)
HF_NAMES = {gguf: ("" if ours == "lm_head.weight" else "model.") + ours for ours, gguf in TOP_TENSORS.items()}
BLOCK_NAMES = {gguf: ours for ours, gguf in BLOCK_TENSORS.items()}


def rope_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k weight, per head, from llama.cpp's adjacent pairs (2i, 2i+1) back to rotate-half (i, i + d/2):
    the inverse of gguf_export.rope_adjacent_pairs."""
    out_features = w.shape[0]
    return w.reshape(n_heads, out_features // n_heads // 2, 2, -1).transpose(1, 2).reshape(out_features, -1)


def _refuse(path: Path, why: str) -> AstraiError:
    return AstraiError(f"{path}: cannot import this GGUF file: {why}; nothing was written")


def read_gguf(path: Path):
    """The file's GGUFReader; AstraiError naming the file when it is not a whole GGUF file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:  # a truncated or foreign file fails in the reader's parse
        why = str(e).splitlines()[0][:120] if str(e) else ""
        raise _refuse(path, f"not a readable GGUF file ({type(e).__name__}: {why}); the file is truncated or not "
                            "GGUF") from None


def import_model(path: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False) -> Path:
    """`astrai import-hf`: a GGUF file (import_gguf) or a Hugging Face folder (astrai_core.convert.hf.import_hf)."""
    from astrai_core.convert.hf import import_hf

    if Path(path).suffix == ".gguf" and not Path(path).is_dir():
        return import_gguf(path, out_dir, force)
    return import_hf(path, out_dir, force)


def import_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Write an astrai checkpoint directory `out_dir` from the GGUF file `path` (`astrai import-hf FILE.gguf OUT`):
    converted to a Hugging Face folder in a temporary directory, then imported as one
    (astrai_core.convert.hf.import_hf)."""
    from astrai_core.convert.hf import IMPORT, import_hf
    from astrai_core.runtime.io import check_output

    check_output(out_dir, IMPORT, force=force, inputs=[path], force_option="--force", folder=True)  # before work
    with tempfile.TemporaryDirectory() as tmp:
        return import_hf(gguf_to_hf(path, Path(tmp) / "hf"), out_dir, force, source=path)


def gguf_to_hf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the Hugging Face model directory `out_dir` (config.json, model.safetensors in float32, tokenizer files,
    generation_config.json) from the GGUF file `path`; AstraiError naming the file and what it cannot take."""
    import gguf

    path, out_dir = Path(path), Path(out_dir)
    reader = read_gguf(path)

    def meta(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    if arch is None:
        raise _refuse(path, "no general.architecture: not a model file, or a truncated one")
    if arch not in ARCHITECTURES:
        raise _refuse(path, f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    scaling = meta(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise _refuse(path, f"{arch}.rope.scaling.type {scaling!r} (supported: none, linear)")
    missing = [k for k in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
               if meta(f"{arch}.{k}") is None]
    if missing:
        raise _refuse(path, f"metadata {arch}.{missing[0]} is missing")
    n_heads = meta(f"{arch}.attention.head_count")
    n_kv_heads = meta(f"{arch}.attention.head_count_kv", n_heads)
    dim = meta(f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    tokens = meta("tokenizer.ggml.tokens") or []
    config = {
        "architectures": [ARCHITECTURES[arch][1]], "model_type": ARCHITECTURES[arch][0],
        "vocab_size": meta(f"{arch}.vocab_size", len(tokens)), "hidden_size": dim,
        "intermediate_size": meta(f"{arch}.feed_forward_length"), "num_hidden_layers": meta(f"{arch}.block_count"),
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "head_dim": meta(f"{arch}.attention.key_length", dim // n_heads),
        "max_position_embeddings": meta(f"{arch}.context_length", 2048),
        "rms_norm_eps": meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5), "hidden_act": "silu",
        "rope_theta": meta(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": {"rope_type": "linear", "factor": meta(f"{arch}.rope.scaling.factor")}
        if scaling == "linear" else None,
        "tie_word_embeddings": "output.weight" not in names, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"), "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta("tokenizer.ggml.padding_token_id"), "torch_dtype": "float32",
    }
    state = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in BLOCK_NAMES:
                raise _refuse(path, f"tensor {t.name} has no place in a {arch} model here")
            name = f"model.layers.{layer}.{BLOCK_NAMES[rest]}"
        elif t.name in HF_NAMES:
            name = HF_NAMES[t.name]
        elif t.name == "rope_freqs.weight":  # Llama 3.1's long-context RoPE factors
            raise _refuse(path, "rope_freqs.weight (Llama 3.1-style RoPE scaling) is not supported")
        else:
            raise _refuse(path, f"tensor {t.name} has no place in a {arch} model here")
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise _refuse(path, f"tensor {t.name}: quantization {t.tensor_type.name} cannot be dequantized by the gguf "
                                "package") from None
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the innermost dimension first
        w = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        if arch in ADJACENT_ROPE and name.endswith("self_attn.q_proj.weight"):
            w = rope_half_split(w, n_heads)
        elif arch in ADJACENT_ROPE and name.endswith("self_attn.k_proj.weight"):
            w = rope_half_split(w, n_kv_heads)
        state[name] = w
    out_dir.mkdir(parents=True)
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    write_json(out_dir / "config.json", config)
    eos = [i for i in (meta("tokenizer.ggml.eos_token_id"), meta("tokenizer.ggml.eot_token_id")) if i is not None]
    write_json(out_dir / "generation_config.json", {"bos_token_id": config["bos_token_id"],
                                                     "eos_token_id": list(dict.fromkeys(eos)) or None})
    _write_tokenizer(path, out_dir, meta("tokenizer.chat_template"))
    _drop_invented_tokens(out_dir, len(tokens))
    return out_dir


def _drop_invented_tokens(out_dir: Path, n_tokens: int) -> None:
    """transformers' byte-level GGUF converter builds a GPT-2 tokenizer, whose class adds its default
    "<|endoftext|>" when the file lacks it (a Llama 3 file, astrai's own export): an id beyond the model's rows. The
    file's vocabulary is all there is: such tokens go."""
    path = out_dir / "tokenizer.json"
    tok = json.loads(path.read_text())
    invented = {t["content"] for t in tok["added_tokens"] if t["id"] >= n_tokens}
    if not invented:
        return
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < n_tokens]
    tok["model"]["vocab"] = {k: i for k, i in tok["model"]["vocab"].items() if i < n_tokens}
    path.write_text(json.dumps(tok, ensure_ascii=False))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key, value in list(config.items()):
        if isinstance(value, str) and value in invented:
            config[key] = None
    if "added_tokens_decoder" in config:
        config["added_tokens_decoder"] = {i: t for i, t in config["added_tokens_decoder"].items() if int(i) < n_tokens}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _write_tokenizer(path: Path, out_dir: Path, template: str | None) -> None:
    """tokenizer.json and tokenizer_config.json by transformers' GGUF converter; the chat template as
    chat_template.jinja (the GGUF's own, when the converter did not write it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local file: nothing is downloaded
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise _refuse(path, "its tokenizer is converted by transformers, which is not installed (pip install "
                            "transformers)") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent.resolve()), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as e:
        raise _refuse(path, f"its tokenizer cannot be converted ({type(e).__name__}: {str(e).splitlines()[0][:160]})") \
            from None
    tok.save_pretrained(str(out_dir))
    if template and not (out_dir / "chat_template.jinja").is_file():
        config = json.loads((out_dir / "tokenizer_config.json").read_text())
        if not config.get("chat_template"):
            (out_dir / "chat_template.jinja").write_text(template)
