"""GGUF export: an astrai checkpoint as one file that llama.cpp (llama-cli, llama-server, ...) runs.

    astrai export-gguf data/pretrain model.gguf                 # f32: the same numbers as the checkpoint
    astrai export-gguf data/pretrain model-q8_0.gguf --type q8_0
    astrai export-gguf data/pretrain model-bf16.gguf --type bf16   # what `astrai serve --dtype bf16` computes with

Written with the `gguf` package (llama.cpp's own writer and Q8_0 quantizer). Which llama.cpp architecture a
ModelConfig becomes (gguf_arch); anything else is refused by name, never exported approximately:

    plain (GQA/MQA/MHA, tied or not, RoPE none/linear/ntk)   -> llama
    mlp relu2 (otherwise plain; zero_init_out is only an init) -> arcee   (llama.cpp's Arcee: ungated relu^2)
    qk_norm, qkv_bias, attn_gate, mla, experts, logit_softcap, value_embeds, x0_scalars -> refused

Two conversions, both also in llama.cpp's convert_hf_to_gguf.py for Llama:
* RoPE. transformer.py rotates half-split pairs (i, i + d/2) (HF's convention); llama.cpp's llama and arcee rotate
  adjacent pairs (2i, 2i + 1). Permuting the rows of q_proj and k_proj within each head so that row i + j*d/2
  becomes row 2i + j gives the same attention scores (q.k is a sum over the same pairs, just reordered).
* The tokenizer. llama.cpp's `gpt2` vocabulary is byte-level BPE: the same token strings and merges as
  tokenizer.json. Which words it splits the text into before merging is the pre-tokenizer `tokenizer.ggml.pre`:
  `gpt-2` is the GPT-2 regex, which is what tokenizers' ByteLevel(use_regex=True) splits with (bpe.py trains
  that). A tokenizer with another pre-tokenizer or a normalizer (a copied one, tokenizer.source) is refused.
The astrai special tokens are control tokens (matched whole in text, as tokenizers does); no BOS is added, as
`astrai generate` adds none; <|end_of_text|> is EOS and <|end_of_turn|> EOT (both stop llama.cpp's generation).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from astrai_core.model.config import ModelConfig
from astrai_core.runtime.errors import AstraiError

TYPES = ("f32", "q8_0", "bf16")
EXPORT = "astrai export-gguf"  # what atomic_path records as the writer of a GGUF file

# transformer.py parameter -> GGUF tensor (gguf.TENSOR_NAMES spells the same names). lm_head is absent when tied:
# llama.cpp then uses token_embd for the output too.
TOP_TENSORS = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
BLOCK_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",  # absent with relu2
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",  # qkv_bias: llama.cpp's qwen2 graph
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
# The graphs that rotate adjacent pairs (q/k rows permuted on export); qwen2's rotates half-split pairs, as astrai does.
ADJACENT_ROPE = ("llama", "arcee")

# Options the llama and arcee graphs do not compute, and what llama.cpp would need instead.
UNSUPPORTED = {
    "qk_norm": "per-head RMSNorm on q and k (llama.cpp's qwen3 graph; not mapped here)",
    "attn_gate": "a sigmoid gate on the attention output",
    "logit_softcap": "logit soft-capping (only inside gemma2's graph, with other norms and scalings)",
    "value_embeds": "value embeddings added in every layer",
    "x0_scalars": "learnt mixing of the embedding into every block's input",
}


def _refuse(why: str) -> AstraiError:
    return AstraiError(f"cannot export to GGUF: {why}; nothing was written")


def gguf_arch(cfg: ModelConfig) -> str:
    """The llama.cpp architecture that computes exactly what `cfg` does, or AstraiError naming the option."""
    for option, what in UNSUPPORTED.items():
        if getattr(cfg, option):
            raise _refuse(f"model.{option} is set: {what}; llama.cpp's llama, arcee and qwen2 architectures lack it")
    if cfg.attention == "mla":
        raise _refuse("model.attention is 'mla' (latent attention: llama.cpp's deepseek2 graph; not mapped here)")
    if cfg.n_experts:
        raise _refuse(f"model.n_experts is {cfg.n_experts} (mixture of experts; not mapped here)")
    if cfg.qkv_bias:
        if cfg.mlp != "swiglu":
            raise _refuse("model.qkv_bias with model.mlp relu2 (llama.cpp's qwen2 graph has a SwiGLU MLP)")
        return "qwen2"
    return "arcee" if cfg.mlp == "relu2" else "llama"


def rope_adjacent_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q_proj/k_proj weight, per head, from rotate-half order (i, i + d/2) to adjacent pairs (2i, 2i+1)."""
    out_features = w.shape[0]
    return w.reshape(n_heads, 2, out_features // n_heads // 2, -1).transpose(1, 2).reshape(out_features, -1)


def gguf_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """astrai state dict -> {GGUF tensor name: float32 array}, q/k rows (and biases) permuted where llama.cpp's graph
    rotates adjacent pairs."""
    out = {}
    permute = gguf_arch(cfg) in ADJACENT_ROPE
    for key, w in state.items():
        if cfg.tie_embeddings and key == "lm_head.weight":
            continue
        if key.startswith("layers."):
            _, layer, rest = key.split(".", 2)
            name = f"blk.{layer}.{BLOCK_TENSORS[rest]}"
            if permute and rest == "self_attn.q_proj.weight":
                w = rope_adjacent_pairs(w, cfg.n_heads)
            elif permute and rest == "self_attn.k_proj.weight":
                w = rope_adjacent_pairs(w, cfg.n_kv_heads)
        else:
            name = TOP_TENSORS[key]
        out[name] = w.detach().float().cpu().numpy()
    return out


def _tokenizer_json(path: Path) -> dict:
    """tokenizer.json as a dict, checked to split text exactly as llama.cpp's `gpt-2` pre-tokenizer does."""
    tok = json.loads(path.read_text())
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("continuing_subword_prefix") or \
            model.get("end_of_word_suffix"):
        raise _refuse(f"{path}: not a plain byte-level BPE model (llama.cpp's gpt2 vocabulary)")
    if tok.get("normalizer") is not None:
        raise _refuse(f"{path}: the tokenizer has a normalizer ({tok['normalizer'].get('type')}), which llama.cpp's "
                      "gpt2 vocabulary does not apply")
    if pre != {**pre, "type": "ByteLevel", "add_prefix_space": False, "use_regex": True}:
        raise _refuse(f"{path}: pre-tokenizer {json.dumps(pre)[:120]} is not ByteLevel(add_prefix_space=False, "
                      "use_regex=True), the GPT-2 split that llama.cpp's tokenizer.ggml.pre 'gpt-2' is; another "
                      "split would tokenize text differently")
    return tok


def gguf_vocab(tok: dict, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(token strings, token types, merges "a b") for GGUF's gpt2 tokenizer, `vocab_size` entries: ids the tokenizer
    does not use (the model's vocabulary may be larger) become unused [PADi] tokens."""
    from gguf import TokenType

    strings = {i: s for s, i in tok["model"]["vocab"].items()}
    types = {i: TokenType.NORMAL for i in strings}
    for added in tok.get("added_tokens", []):
        strings[added["id"]] = added["content"]
        types[added["id"]] = TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED
    if max(strings) >= vocab_size:
        raise _refuse(f"the tokenizer has ids up to {max(strings)}, beyond the model's vocab_size {vocab_size}")
    tokens = [strings.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [int(types.get(i, TokenType.UNUSED)) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]  # both tokenizers formats
    return tokens, token_types, merges


WRITTEN_BY_KEY = "astrai.written_by"  # a GGUF key holding EXPORT: how a later export knows the file is its own


def gguf_written_by(path: Path) -> str | None:
    """What wrote the file at `path` (its WRITTEN_BY_KEY), or None: not a GGUF file, or not one astrai wrote."""
    import gguf

    if path.open("rb").read(4) != b"GGUF":
        return None
    try:
        field = gguf.GGUFReader(path).fields.get(WRITTEN_BY_KEY)
        return field.contents() if field is not None else None
    except Exception:  # a truncated or malformed GGUF file: not one export_gguf finished
        return None


def export_gguf(ckpt_dir: str | os.PathLike, out: str | os.PathLike, out_type: str = "f32",
                force: bool = False) -> Path:
    """Write the GGUF file `out` (atomically) from the astrai checkpoint `ckpt_dir`. out_type: f32, q8_0 (every
    matrix in Q8_0, as llama.cpp's own converter does) or bf16 (every matrix rounded to bf16 as torch rounds it, the
    weights of a model loaded with dtype bf16); norms stay f32. An existing `out` is replaced only
    if an earlier export wrote it, or with `force`; never the checkpoint or a file inside it."""
    import gguf

    from astrai_core.tokenizer.chat import DEFAULT_TEMPLATE, TEMPLATE_FILE
    # NTK folded into the base as model/transformer.py does
    from astrai_core.checkpoint.model_dir import load_model
    from astrai_core.convert.hf import rope_parameters, special_token_ids
    from astrai_core.runtime.io import atomic_path, check_output

    if out_type not in TYPES:
        raise AstraiError(f"--type {out_type!r}: expected one of {', '.join(TYPES)}")
    ckpt_dir = Path(ckpt_dir)
    output = dict(force=force, inputs=[ckpt_dir], force_option="--force", file_kind=gguf_written_by)
    check_output(out, EXPORT, **output)  # before any work: never into or over the checkpoint or a user's file
    model, _, cfg = load_model(ckpt_dir)
    arch = gguf_arch(cfg)  # everything is checked before the file is opened
    tokens, token_types, merges = gguf_vocab(_tokenizer_json(ckpt_dir / "tokenizer.json"), cfg.vocab_size)
    ids = special_token_ids(ckpt_dir / "tokenizer.json")  # the model's own, or astrai's
    ids["end_of_turn"] = next((i for i in ids["eos_list"] or () if i != ids["eos"]), None)
    template = ckpt_dir / TEMPLATE_FILE
    tensors = gguf_tensors(cfg, model.state_dict())

    with atomic_path(out, EXPORT, **output) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(ckpt_dir.resolve().name)
        w.add_string(WRITTEN_BY_KEY, EXPORT)
        file_type, matrix_type = {"f32": (gguf.LlamaFileType.ALL_F32, None),
                                  "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
                                  "bf16": (gguf.LlamaFileType.MOSTLY_BF16, gguf.GGMLQuantizationType.BF16)}[out_type]
        w.add_file_type(file_type)
        w.add_vocab_size(cfg.vocab_size)
        w.add_context_length(cfg.max_seq_len)
        w.add_embedding_length(cfg.dim)
        w.add_block_count(cfg.n_layers)
        w.add_feed_forward_length(cfg.hidden_dim)
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        rope = rope_parameters(cfg)
        w.add_rope_freq_base(rope["rope_theta"])
        if rope["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])

        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_merges(merges)
        w.add_add_bos_token(False)  # as `astrai generate`: the prompt's ids are exactly the text's
        w.add_add_eos_token(False)
        for name, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id),
                          ("end_of_turn", w.add_eot_token_id)):
            if ids[name] is not None:
                add(ids[name])
        w.add_chat_template(template.read_text() if template.is_file() else DEFAULT_TEMPLATE)

        for name, array in tensors.items():
            # Q8_0 packs rows in blocks of 32 values; a matrix whose rows are not a multiple of 32 stays f32.
            block = gguf.GGML_QUANT_SIZES[matrix_type][0] if matrix_type is not None else 0
            if matrix_type is not None and array.ndim == 2 and array.shape[1] % block == 0:
                w.add_tensor(name, gguf.quants.quantize(array, matrix_type), raw_dtype=matrix_type)
            else:
                w.add_tensor(name, array)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return Path(out)
