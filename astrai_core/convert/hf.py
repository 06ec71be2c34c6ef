"""Hugging Face interop: an astrai checkpoint <-> a `transformers` model directory, with the same numbers.

    astrai export-hf data/pretrain hf_out     # config.json, model.safetensors, tokenizer files, generation_config.json
    astrai import-hf path/to/hf_model ckpt    # an astrai checkpoint directory, a starting point for any stage

Which architecture a ModelConfig becomes (hf_model_type); anything else is refused, never exported approximately:

    plain (GQA/MQA/MHA, tied or not, RoPE none/linear/ntk)     -> llama
    qkv_bias                                                   -> qwen2
    qk_norm                                                    -> qwen3
    qk_norm + n_experts (no shared experts)                    -> qwen3_moe   (norm_topk_prob false)
    attention mla (dense, or n_experts with n_shared_experts)  -> deepseek_v2 (q_lora_rank null, greedy top-k)
    mlp relu2 (otherwise plain; zero_init_out is only an init) -> arcee
    attn_gate, MoE with plain attention or with shared experts but no mla, ...  -> refused with the reason
    logit_softcap, value_embeds, x0_scalars                    -> refused, naming the option

Import reads llama, mistral, arcee, qwen2, qwen3 (and qwen3_moe / deepseek_v2 as written above) straight from
config.json and *.safetensors: no `transformers` needed at run time; the tests use it as the reference.
The stages need astrai's special tokens (astrai_core/tokenizer/bpe.py): import adds the ones the HF tokenizer lacks
(reusing any it has, e.g. Llama-3's <|begin_of_text|>), growing the vocabulary if needed (see _init_new_rows);
summary.json records what was added, and the logits of the original vocabulary are unchanged.
The names in transformer.py already are HF's (without `model.`); the only rewrites are the MoE experts (stacked here,
one tensor per expert on disk) and MLA's RoPE part (rotate-half here, interleaved pairs in DeepSeek-V2).
NTK-aware RoPE has no static HF type: it is exported as rope_theta = theta * factor ** (d / (d - 2)), the same
frequencies, and imports back as plain RoPE with that base.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from astrai_core.model.config import ModelConfig
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path, check_output, write_json
from astrai_core.tokenizer.bpe import SPECIALS_FILE
from astrai_core.tokenizer.chat import DEFAULT_TEMPLATE

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM", "arcee": "ArceeForCausalLM"}

# Used when the checkpoint carries no chat_template.jinja: the astrai special tokens as turn markers.
CHAT_TEMPLATE = DEFAULT_TEMPLATE


# ---- architecture and config ----

def hf_model_type(cfg: ModelConfig) -> str:
    """The transformers model_type that computes exactly what `cfg` does, or AstraiError saying why none does."""
    def refuse(why: str) -> AstraiError:
        return AstraiError(f"cannot export to Hugging Face: {why}; no transformers architecture computes the same "
                           "function, so nothing was written")

    # The speedrun options (transformer.py) with no transformers counterpart. logit_softcap: Gemma 2/3 have
    # final_logit_softcapping, but also sandwich norms, a scaled embedding and (1 + w) norm gains.
    for option in ("logit_softcap", "value_embeds", "x0_scalars"):
        if getattr(cfg, option):
            raise refuse(f"model.{option} is set")
    if cfg.mlp == "relu2":  # Arcee is Llama with a non-gated relu^2 MLP (zero_init_out is only an init: exports)
        if cfg.attention == "mla" or cfg.n_experts or cfg.qk_norm or cfg.qkv_bias:
            raise refuse("model.mlp 'relu2' with mla, experts, qk_norm or qkv_bias (relu2 exists in transformers "
                         "as Arcee, a plain Llama otherwise)")
        return "arcee"
    if cfg.attn_gate:
        raise refuse("attn_gate (gated attention) exists in transformers only inside Qwen3-Next, whose norms and "
                     "linear-attention layers differ from this model")
    if cfg.attention == "mla":
        if cfg.n_experts and not cfg.n_shared_experts:
            raise refuse("mla with routed experts but n_shared_experts 0 (DeepSeek-V2 always has shared experts)")
        return "deepseek_v2"
    if cfg.n_experts:
        if cfg.n_shared_experts:
            raise refuse("shared experts with grouped-query attention (DeepSeekMoE with shared experts is in "
                         "transformers only as DeepSeek-V2, with attention: mla)")
        if not cfg.qk_norm or cfg.qkv_bias:
            raise refuse("routed experts without qk_norm (Mixtral renormalizes the top-k weights; the matching "
                         "architecture, Qwen3-MoE, needs qk_norm: true and qkv_bias: false)")
        return "qwen3_moe"
    if cfg.qk_norm:
        if cfg.qkv_bias:
            raise refuse("qk_norm with qkv_bias (Qwen3's attention_bias also puts a bias on o_proj)")
        return "qwen3"
    return "qwen2" if cfg.qkv_bias else "llama"


def rope_parameters(cfg: ModelConfig) -> dict:
    """`cfg`'s RoPE settings as Hugging Face writes them (config.json's rope_parameters); the GGUF export's too."""
    if cfg.rope_scaling == "ntk":  # folded into the base: identical inverse frequencies (see rope_tables)
        d = cfg.rope_head_dim
        return {"rope_type": "default", "rope_theta": cfg.rope_theta * cfg.rope_factor ** (d / (d - 2))}
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor}
    return {"rope_type": "default", "rope_theta": cfg.rope_theta}


def hf_config(cfg: ModelConfig, special_ids: dict[str, int | None]) -> dict:
    """config.json of the HF model. rope_theta/rope_scaling (transformers 4.x) and rope_parameters (5.x) both."""
    model_type = hf_model_type(cfg)
    rope = rope_parameters(cfg)
    out = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "relu2" if cfg.mlp == "relu2" else "silu", "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "use_cache": True,
        "rope_theta": rope["rope_theta"], "rope_parameters": rope,
        "rope_scaling": {"rope_type": "linear", "factor": cfg.rope_factor} if rope["rope_type"] == "linear" else None,
        "bos_token_id": special_ids.get("bos"), "eos_token_id": special_ids.get("eos"),
        "pad_token_id": special_ids.get("pad"), "torch_dtype": "float32",
    }
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if model_type == "qwen3_moe":
        out.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k, norm_topk_prob=False,
                   moe_intermediate_size=cfg.expert_hidden_dim, decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=cfg.moe_aux_loss_coef)
    if model_type == "deepseek_v2":
        out.update(num_key_value_heads=cfg.n_heads, head_dim=cfg.mla_rope_dim, q_lora_rank=None,
                   kv_lora_rank=cfg.mla_kv_rank, qk_nope_head_dim=cfg.head_dim, qk_rope_head_dim=cfg.mla_rope_dim,
                   v_head_dim=cfg.head_dim, topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
                   n_group=None, topk_group=None)
        if cfg.n_experts:
            out.update(first_k_dense_replace=0, n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                       n_shared_experts=cfg.n_shared_experts, moe_intermediate_size=cfg.expert_hidden_dim)
        else:  # every layer dense
            out.update(first_k_dense_replace=cfg.n_layers, n_routed_experts=1, num_experts_per_tok=1,
                       n_shared_experts=1, moe_intermediate_size=cfg.hidden_dim)
    return out


def _refuse_import(path: Path, why: str) -> AstraiError:
    return AstraiError(f"{path}: cannot import: {why}")


def astrai_config(hf: dict, path: Path) -> ModelConfig:
    """The ModelConfig of an HF config.json (dict); AstraiError naming the key for anything not representable."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise _refuse_import(path, f"model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    act = "relu2" if model_type == "arcee" else "silu"
    if hf.get("hidden_act", act) != act:
        raise _refuse_import(path, f"hidden_act {hf['hidden_act']!r} (only {act} for {model_type})")
    if hf.get("mlp_bias"):
        raise _refuse_import(path, "mlp_bias true (the MLP here has no biases)")
    if model_type in ("llama", "mistral", "arcee") and hf.get("attention_bias"):
        raise _refuse_import(path, "attention_bias true (a bias on o_proj too; only q/k/v biases as in Qwen2 are supported)")
    if model_type in ("qwen3", "qwen3_moe") and hf.get("attention_bias"):
        raise _refuse_import(path, "attention_bias true with qk-norm (bias on o_proj is not supported)")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise _refuse_import(path, f"pretraining_tp {hf['pretraining_tp']}")
    n_layers = hf["num_hidden_layers"]
    max_len = hf.get("max_position_embeddings", 2048)
    # Sliding-window attention equals full attention for sequences up to the window: cap max_seq_len there.
    window = hf.get("sliding_window")
    uses_window = window is not None and (model_type == "mistral" or hf.get("use_sliding_window"))
    if uses_window:
        max_len = min(max_len, window)
    # RoPE: transformers 5 writes rope_parameters, 4.x rope_theta + rope_scaling.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if rope_type not in ("default", "linear"):
        raise _refuse_import(path, f"rope type {rope_type!r} (supported: default, linear)")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse_import(path, "partial_rotary_factor != 1")
    n_heads = hf["num_attention_heads"]
    kw = dict(vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=n_layers, n_heads=n_heads,
              n_kv_heads=hf.get("num_key_value_heads") or n_heads, ffn_dim=hf["intermediate_size"],
              max_seq_len=max_len, rope_theta=theta, norm_eps=hf.get("rms_norm_eps", 1e-6),
              tie_embeddings=bool(hf.get("tie_word_embeddings", False)), init_std=hf.get("initializer_range", 0.02),
              rope_scaling="linear" if rope_type == "linear" else "none",
              rope_factor=float(rope["factor"]) if rope_type == "linear" else 1.0)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    if model_type != "deepseek_v2" and head_dim * n_heads != hf["hidden_size"]:
        kw["attn_head_dim"] = head_dim
    if model_type == "arcee":
        kw["mlp"] = "relu2"
    if model_type == "qwen2":
        kw["qkv_bias"] = True  # Qwen2 always has q/k/v biases (and none on o_proj)
    if model_type in ("qwen3", "qwen3_moe"):
        kw["qk_norm"] = True
    if model_type == "qwen3_moe":
        if hf.get("norm_topk_prob", False):
            raise _refuse_import(path, "norm_topk_prob true (the top-k router weights here are not renormalized)")
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise _refuse_import(path, "decoder_sparse_step / mlp_only_layers (every layer must be MoE)")
        kw.update(n_experts=hf.get("num_experts", hf.get("num_local_experts")), moe_top_k=hf["num_experts_per_tok"],
                  moe_ffn_dim=hf["moe_intermediate_size"])
    if model_type == "deepseek_v2":
        if hf.get("q_lora_rank") is not None:
            raise _refuse_import(path, "q_lora_rank (a low-rank query; only q_lora_rank null, as in V2-Lite)")
        if hf["qk_nope_head_dim"] != hf["v_head_dim"]:
            raise _refuse_import(path, "qk_nope_head_dim != v_head_dim")
        if hf.get("topk_method", "greedy") != "greedy" or hf.get("routed_scaling_factor", 1.0) != 1.0:
            raise _refuse_import(path, "topk_method other than greedy or routed_scaling_factor != 1")
        dense = hf.get("first_k_dense_replace", 0)
        if dense not in (0, n_layers):
            raise _refuse_import(path, f"first_k_dense_replace {dense} (all layers dense or all MoE)")
        kw.update(attention="mla", attn_head_dim=hf["qk_nope_head_dim"], mla_kv_rank=hf["kv_lora_rank"],
                  mla_rope_dim=hf["qk_rope_head_dim"], n_kv_heads=1)
        if dense == 0:
            kw.update(n_experts=hf["n_routed_experts"], moe_top_k=hf["num_experts_per_tok"],
                      n_shared_experts=hf["n_shared_experts"], moe_ffn_dim=hf["moe_intermediate_size"])
    try:
        return ModelConfig(**kw)
    except ValueError as e:
        raise _refuse_import(path, " ".join(str(e).split())) from None


# ---- weights ----

def _rope_interleave(n: int) -> torch.Tensor:
    """Row order that turns rotate-half pairs (i, i + n/2) into adjacent pairs (2i, 2i + 1), as DeepSeek-V2's
    complex-number RoPE expects; argsort of it goes back."""
    return torch.stack([torch.arange(n // 2), torch.arange(n // 2) + n // 2], dim=1).flatten()


def _mla_rope_rows(cfg: ModelConfig, state: dict, perm: torch.Tensor) -> None:
    """Reorder the RoPE output rows of q_proj (per head) and kv_a_proj_with_mqa (the last mla_rope_dim) in place."""
    r, nope = cfg.mla_rope_dim, cfg.head_dim
    for i in range(cfg.n_layers):
        q = state[f"layers.{i}.self_attn.q_proj.weight"].view(cfg.n_heads, nope + r, cfg.dim)
        state[f"layers.{i}.self_attn.q_proj.weight"] = torch.cat([q[:, :nope], q[:, nope:][:, perm]], 1).reshape(-1, cfg.dim)
        kv = state[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]
        state[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] = torch.cat([kv[:-r], kv[-r:][perm]])


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """astrai state dict -> HF checkpoint tensors (on-disk names: one tensor per expert)."""
    state = dict(state)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    if cfg.attention == "mla":
        _mla_rope_rows(cfg, state, _rope_interleave(cfg.mla_rope_dim))
    out = {}
    for key, w in state.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix, h = key[: -len("gate_up_proj")], w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"model.{prefix}{e}.gate_proj.weight"] = w[e, :h]
                out[f"model.{prefix}{e}.up_proj.weight"] = w[e, h:]
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key[: -len("down_proj")]
            for e in range(w.shape[0]):
                out[f"model.{prefix}{e}.down_proj.weight"] = w[e]
        else:
            out[key if key.startswith("lm_head.") else f"model.{key}"] = w
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def from_hf_state(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors (per-expert or stacked experts) -> astrai state dict."""
    state, experts = {}, {}
    for key, w in hf_state.items():
        key = key.removeprefix("model.")
        parts = key.split(".")
        if len(parts) == 7 and parts[2:4] == ["mlp", "experts"]:  # layers.i.mlp.experts.e.gate_proj.weight
            experts.setdefault((int(parts[1]), parts[5]), {})[int(parts[4])] = w
        else:
            state[key] = w
    for (layer, proj), per_expert in experts.items():
        state[f"layers.{layer}.mlp.experts.{proj}"] = torch.stack([per_expert[e] for e in range(len(per_expert))])
    for layer in {k[0] for k in experts}:
        gate, up = state.pop(f"layers.{layer}.mlp.experts.gate_proj"), state.pop(f"layers.{layer}.mlp.experts.up_proj")
        state[f"layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.attention == "mla":
        _mla_rope_rows(cfg, state, torch.argsort(_rope_interleave(cfg.mla_rope_dim)))
    return state


def _read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise _refuse_import(hf_dir, "no *.safetensors weights (convert pytorch_model.bin with save_pretrained "
                                     "(safe_serialization=True) first)")
    state = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as g:
                for key in g.keys():
                    state[key] = g.get_tensor(key).float()
        except (SafetensorError, OSError) as e:
            raise _refuse_import(f, f"not a readable safetensors file ({str(e).splitlines()[0]}); the file is "
                                    "truncated or corrupt") from None
    return state


def _read_hf_config(path: Path) -> dict:
    try:
        hf = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise _refuse_import(path, f"not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(hf, dict):
        raise _refuse_import(path, f"expected a JSON object, got {type(hf).__name__}")
    return hf


# ---- tokenizer ----

def special_token_ids(tokenizer_json: Path) -> dict:
    """bos, eos, pad, eos_list (where generation stops: eos first) and their texts, of a checkpoint's tokenizer: the
    model's own (special_tokens.json) or astrai's, with the role tokens the default template needs (None: absent)."""
    from astrai_core.tokenizer.bpe import SPECIAL_TOKENS, read_tokenizer, specials

    tok = read_tokenizer(tokenizer_json)
    if tokenizer_json.with_name(SPECIALS_FILE).is_file():
        sp = specials(tok, tokenizer_json)
        ids = {"bos": sp.bos, "eos": sp.eos, "pad": sp.pad, "eos_list": list(dict.fromkeys((sp.eos, *sp.stop)))}
    else:
        ids = {name: tok.token_to_id(text) for name, text in SPECIAL_TOKENS.items()}
        ids["eos_list"] = [i for i in (ids["eos"], ids["end_of_turn"]) if i is not None] or None
    ids["texts"] = {name: tok.id_to_token(ids[name]) for name in ("bos", "eos", "pad") if ids[name] is not None}
    return ids


def _load_hf_tokenizer(path: Path):
    from astrai_core.tokenizer.bpe import read_tokenizer

    try:
        return read_tokenizer(path)
    except AstraiError as e:
        raise _refuse_import(path, str(e).removeprefix(f"{path}: ")) from None


def _add_special_tokens(tok) -> tuple[dict[str, int], dict[str, int]]:
    """Give the HF tokenizer `tok` (in place) every astrai special token, which load_tokenizer and the chat format
    need. One it already has keeps its id (Llama-3's <|begin_of_text|> and <|end_of_text|> are astrai's bos and
    eos); a missing one becomes a special added token with a new id after the vocabulary.
    Returns ({name: id} added, {name: id} reused)."""
    from tokenizers import AddedToken

    from astrai_core.tokenizer.bpe import SPECIAL_TOKENS

    reused = {name: tok.token_to_id(text) for name, text in SPECIAL_TOKENS.items() if tok.token_to_id(text) is not None}
    # Also the reused ones: a string that is only a BPE vocabulary entry would be split when encoded; declaring it
    # an added token keeps its id and makes it atomic (a no-op for one that already is).
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in SPECIAL_TOKENS.values()])
    added = {name: tok.token_to_id(text) for name, text in SPECIAL_TOKENS.items() if name not in reused}
    return added, reused


def _tokenizer_size(tok) -> int:
    """One more than the largest id: what the embedding must cover (added tokens can leave gaps)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def _init_new_rows(cfg: ModelConfig, state: dict[str, torch.Tensor], rows: list[int], n_known: int) -> ModelConfig:
    """Give the token ids `rows` (new special tokens) embedding and lm_head rows, in place: vocab_size grows to
    cover them and each such row is the mean of the rows of the known vocabulary (ids < n_known; Qwen's padding
    rows, never trained, are not averaged in). The usual initialisation: the new token's input is an average
    token, and its logit h . mean(W) is the mean of the known logits, so the known logits are unchanged and a new
    token never wins a greedy pick before it is trained. Returns the config with the new vocab_size."""
    vocab_size = max(cfg.vocab_size, max(rows) + 1)
    for key in ("embed_tokens.weight", "lm_head.weight"):  # a tied lm_head is not in `state`
        if key in state:
            w = state[key]
            mean = w[: min(n_known, cfg.vocab_size)].mean(dim=0)
            w = torch.cat([w, mean.expand(vocab_size - w.shape[0], -1)])
            w[rows] = mean
            state[key] = w
    return ModelConfig(**{**cfg.model_dump(), "vocab_size": vocab_size})


def _tokenizer_config(ckpt: Path, cfg: ModelConfig, ids: dict[str, int | None]) -> dict:
    """tokenizer_config.json: the imported one when the checkpoint came from HF, else PreTrainedTokenizerFast over
    tokenizer.json with the astrai special tokens. The chat template comes from chat_template.jinja if present."""
    if (ckpt / "tokenizer_config.json").is_file():
        out = json.loads((ckpt / "tokenizer_config.json").read_text())
    else:
        out = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
               "clean_up_tokenization_spaces": False,  # decode must give back exactly what tokenizers decodes
               **{f"{name}_token": text for name, text in ids["texts"].items()}}
        if all(ids.get(n) is not None for n in ("system", "user", "assistant", "end_of_turn")):
            out["chat_template"] = CHAT_TEMPLATE
    if (ckpt / "chat_template.jinja").is_file():
        out["chat_template"] = (ckpt / "chat_template.jinja").read_text()
    return out


# ---- export / import ----

EXPORT = "astrai export-hf"  # what export_hf and import_hf write, for astrai_core.runtime.io.check_output
IMPORT = "astrai import-hf"


def export_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False,
              readme: str | None = None) -> Path:
    """Write the HF model directory `out_dir` (atomically) from the astrai checkpoint `ckpt_dir`, with `readme` as
    its README.md (the model card) when given. An existing `out_dir` is replaced only if it holds an earlier export,
    or with `force`; never the checkpoint itself."""
    from astrai_core.checkpoint.model_dir import load_model

    ckpt_dir = Path(ckpt_dir)
    check_output(out_dir, EXPORT, force=force, inputs=[ckpt_dir], force_option="--force", folder=True)  # before work
    model, _, cfg = load_model(ckpt_dir)
    hf_model_type(cfg)  # refuse before writing anything
    ids = special_token_ids(ckpt_dir / "tokenizer.json")
    generation = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos_list"], "pad_token_id": ids["pad"],
                  "do_sample": False}  # greedy, as `astrai generate` with temperature 0
    if (ckpt_dir / "generation_config.json").is_file():  # imported from HF: keep the original and its token ids
        generation = json.loads((ckpt_dir / "generation_config.json").read_text())
        ids = {**ids, **{k: generation.get(f"{k}_token_id") for k in ("bos", "eos", "pad")}}
    config = hf_config(cfg, ids)
    with atomic_path(out_dir, EXPORT, force=force, inputs=[ckpt_dir], force_option="--force") as tmp:
        tmp.mkdir()
        save_file(to_hf_state(cfg, model.state_dict()), tmp / "model.safetensors", metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json", generation)
        shutil.copyfile(ckpt_dir / "tokenizer.json", tmp / "tokenizer.json")
        write_json(tmp / "tokenizer_config.json", _tokenizer_config(ckpt_dir, cfg, ids))
        if readme is not None:
            (tmp / "README.md").write_text(readme)
    return Path(out_dir)


def import_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False,
              source: str | os.PathLike | None = None) -> Path:
    """Write an astrai checkpoint directory `out_dir` from the HF model directory `hf_dir` (`source`: what it was
    converted from, a GGUF file: astrai_core/convert/gguf_import.py). An existing `out_dir` is replaced only if it holds
    an earlier import, or with `force`; never the HF directory itself.

    A model that brings a chat template stays itself: its tokenizer byte for byte, nothing added, and its own special
    tokens (where it stops) in special_tokens.json. A model without one (a base model) gets astrai's special tokens
    and its default template, as the stages' own models have."""
    from astrai_core.checkpoint.model_dir import check_fits_in_memory, save_checkpoint
    from astrai_core.model.transformer import Transformer

    hf_dir = Path(hf_dir)
    source = Path(source or hf_dir)
    check_output(out_dir, IMPORT, force=force, inputs=[source], force_option="--force", folder=True)  # before work

    if not (hf_dir / "config.json").is_file():
        raise AstraiError(f"{hf_dir}: not a Hugging Face model directory (config.json missing) or a .gguf file")
    if not (hf_dir / "tokenizer.json").is_file():
        raise _refuse_import(hf_dir, "no tokenizer.json (a fast tokenizer file is needed; save the tokenizer with "
                                     "transformers' AutoTokenizer.save_pretrained first)")
    hf = _read_hf_config(hf_dir / "config.json")
    try:
        cfg = astrai_config(hf, hf_dir / "config.json")
    except KeyError as e:
        raise _refuse_import(hf_dir / "config.json", f"missing the key {e.args[0]!r}") from None
    tok = _load_hf_tokenizer(hf_dir / "tokenizer.json")
    check_fits_in_memory(cfg, hf_dir / "config.json", ", ".join(f"{k} {hf.get(k)}" for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")))
    state = from_hf_state(cfg, _read_safetensors(hf_dir))
    template = _chat_template(hf_dir)
    hf_vocab_size = cfg.vocab_size
    if template is not None:  # the model stays itself: nothing added
        own = _own_special_tokens(hf_dir, hf, tok)
        _check_template(tok, template, own, hf_dir)
        added, reused, rows = {}, {}, []
    else:
        own = None
        n_known = _tokenizer_size(tok)
        added, reused = _add_special_tokens(tok)
        rows = sorted(set(added.values()) | {i for i in reused.values() if i >= cfg.vocab_size})
        if rows:
            cfg = _init_new_rows(cfg, state, rows, n_known)
    if _tokenizer_size(tok) > cfg.vocab_size:
        raise _refuse_import(hf_dir / "tokenizer.json", f"ids up to {_tokenizer_size(tok) - 1}, beyond the model's "
                                                         f"vocab_size {cfg.vocab_size}")
    report = {"special_tokens_added": added, "special_tokens_reused": reused, "special_tokens": own,
              "vocab_size": {"hf": hf_vocab_size, "astrai": cfg.vocab_size}, "mean_initialized_rows": rows}
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise _refuse_import(hf_dir, f"weights do not match config.json (missing {missing[:4]}, unexpected {unexpected[:4]})")
    with tempfile.TemporaryDirectory() as tmp:
        extra_files = [hf_dir / name for name in ("tokenizer_config.json", "generation_config.json")
                       if (hf_dir / name).is_file()]
        tokenizer_path = hf_dir / "tokenizer.json"  # byte for byte when nothing was added
        if tok.to_str() != _load_hf_tokenizer(tokenizer_path).to_str():
            tokenizer_path = Path(tmp) / "tokenizer.json"
            tok.save(str(tokenizer_path))
        else:  # beside it, so that save_checkpoint carries the chat format and the special tokens along
            shutil.copyfile(hf_dir / "tokenizer.json", Path(tmp) / "tokenizer.json")
            tokenizer_path = Path(tmp) / "tokenizer.json"
        if template is not None:
            (Path(tmp) / "chat_template.jinja").write_text(template)
            write_json(Path(tmp) / SPECIALS_FILE, own)
        return save_checkpoint(out_dir, model, cfg, tokenizer_path, kind=IMPORT, force=force, inputs=[source],
                               extra={"imported_from": str(source.resolve()), "hf_model_type": hf["model_type"],
                                      **report}, files=extra_files)


def _chat_template(hf_dir: Path) -> str | None:
    """The model's own chat template: chat_template.jinja, else tokenizer_config.json's chat_template (a string, or
    transformers' list of named templates: the one named "default")."""
    if (hf_dir / "chat_template.jinja").is_file():
        return (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    config = _read_hf_config(hf_dir / "tokenizer_config.json") if (hf_dir / "tokenizer_config.json").is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) and template.strip() else None


def _own_special_tokens(hf_dir: Path, hf: dict, tok) -> dict:
    """The model's own special tokens as texts (special_tokens.json, astrai_core/tokenizer/bpe.py): where it stops (the
    eos ids of generation_config.json, else config.json's: often a list), its end of text, bos and pad; AstraiError
    naming the file and key for an id or token the tokenizer lacks."""
    files = {name: _read_hf_config(hf_dir / name) if (hf_dir / name).is_file() else {}
             for name in ("generation_config.json", "tokenizer_config.json")}
    files["config.json"] = hf

    def text(file: str, key: str, value) -> str | None:
        """A token's text from its id or text (or transformers' AddedToken as JSON), checked against tok."""
        value = value.get("content") if isinstance(value, dict) else value
        if value is None:
            return None
        if isinstance(value, str) and tok.token_to_id(value) is not None:
            return value
        if isinstance(value, int) and not isinstance(value, bool) and tok.id_to_token(value) is not None:
            return tok.id_to_token(value)
        raise _refuse_import(hf_dir / file, f"{key} {value!r} is not a token of tokenizer.json's vocabulary")

    def one(file: str, key: str) -> str | None:
        return text(file, key, files[file].get(key))

    def stops(file: str) -> list[str]:
        value = files[file].get("eos_token_id")
        return [text(file, "eos_token_id", v) for v in (value if isinstance(value, list) else [value]) if v is not None]

    stop = stops("generation_config.json") or stops("config.json")
    eos = one("tokenizer_config.json", "eos_token") or (stop[0] if stop else None)
    if eos is None:
        raise _refuse_import(hf_dir, "no end of turn: neither generation_config.json, config.json nor "
                                     "tokenizer_config.json names an eos token")
    bos = one("tokenizer_config.json", "bos_token") or one("config.json", "bos_token_id")
    pad = one("tokenizer_config.json", "pad_token") or one("config.json", "pad_token_id") or eos
    return {"bos": bos, "eos": eos, "pad": pad, "stop": list(dict.fromkeys(stop or [eos]))}


def _check_template(tok, template: str, own: dict, hf_dir: Path) -> None:
    """The template renders a conversation whose turns can be masked (SFT's loss on the assistant's turns only):
    refused now, in one line, rather than at the first training stage."""
    from astrai_core.tokenizer.bpe import Specials
    from astrai_core.tokenizer.chat import ChatFormat

    special = Specials(eos=tok.token_to_id(own["eos"]), pad=tok.token_to_id(own["pad"]),
                       stop=tuple(tok.token_to_id(t) for t in own["stop"]))
    chat = ChatFormat(tok, template, f"{hf_dir}: chat template", special)
    conversation = [{"role": "user", "content": "Is the sky blue?"},
                    {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And grass?"},
                    {"role": "assistant", "content": "Green."}]
    _, mask = chat.encode(conversation)
    if not any(mask):
        raise AstraiError(f"{hf_dir}: chat template: a conversation renders with no assistant tokens to train on")
