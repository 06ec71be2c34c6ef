"""Tune the demo's defaults by measurement: train each variant for a wall-clock budget, compare validation bpc.

    python bench/tune_defaults.py --minutes 5 [--only NAME ...]

Each variant is params.yaml plus overrides. The corpus comes from data/corpus (run `astrai stage corpus` first);
each vocabulary size gets its own tokenizer and packed files under bench/out/. Steps are set from a short probe
of the variant's throughput so every variant gets the same wall-clock budget (what the demo has), then the
validation split's bits per character is measured (the test split stays untouched for the final report).
Prints one JSON line per variant and writes bench/out/tune_results.json. `--steps N` trains every variant for
exactly N steps instead (for variants of one shape, e.g. learning rates, at equal tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from astrai_core.checkpoint import load_model
from astrai_core.data import PackedTokens
from astrai_core.distributed import resolve_nproc, run_torchrun
from astrai_core.scoring import sequence_nll, summarize, unigram_nll
from astrai_core.io import sha256_file, write_json
from tasks.pack import pack
from tasks.params import load_params, train_config
from tasks.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"

VARIANTS = {
    "d256_l4_v2048_lr3e-3": {},
    "d256_l4_v2048_lr1e-3": {"pretrain.optim.lr": 1e-3, "pretrain.optim.min_lr": 1e-4},
    "d256_l4_v2048_lr6e-3": {"pretrain.optim.lr": 6e-3, "pretrain.optim.min_lr": 6e-4},
    "d192_l6_v2048": {"model.dim": 192, "model.n_layers": 6, "model.n_heads": 3, "model.n_kv_heads": 1},
    "d384_l4_v2048": {"model.dim": 384, "model.n_layers": 4, "model.n_heads": 6, "model.n_kv_heads": 2},
    "d256_l4_v1024": {"tokenizer.vocab_size": 1024, "model.vocab_size": 1024},
    "d256_l4_v4096": {"tokenizer.vocab_size": 4096, "model.vocab_size": 4096},
    "d256_l4_v512": {"tokenizer.vocab_size": 512, "model.vocab_size": 512},
    "d256_l4_v1024_lr1.5e-3": {"tokenizer.vocab_size": 1024, "model.vocab_size": 1024,
                               "pretrain.optim.lr": 1.5e-3, "pretrain.optim.min_lr": 1.5e-4},
    "d256_l4_v512_lr1.5e-3": {"tokenizer.vocab_size": 512, "model.vocab_size": 512,
                              "pretrain.optim.lr": 1.5e-3, "pretrain.optim.min_lr": 1.5e-4},
    "d256_l4_v1024_lr6e-3": {"tokenizer.vocab_size": 1024, "model.vocab_size": 1024,
                             "pretrain.optim.lr": 6e-3, "pretrain.optim.min_lr": 6e-4},
    "d256_l4_v2048_seq128_b32": {"pretrain.seq_len": 128, "pretrain.batch_size": 32},
}


def data_for(params, corpus: Path) -> tuple[Path, Path]:
    vocab = params.tokenizer.vocab_size
    tok_dir, packed = OUT / f"tokenizer_{vocab}", OUT / f"packed_{vocab}"
    if not (tok_dir / "tokenizer.json").exists():
        build_tokenizer(params.tokenizer, corpus, tok_dir)
    if not (packed / "validation.h5").exists():
        pack(params.pack, corpus, tok_dir / "tokenizer.json", packed)
    return tok_dir / "tokenizer.json", packed


def train(params, packed: Path, tok: Path, out: Path, steps: int) -> dict:
    params.pretrain.max_steps = steps
    params.pretrain.eval_every = 0
    cfg = train_config(params, "pretrain", ROOT).model_copy(update={
        "train_data": str(packed / "train.h5"), "val_data": str(packed / "validation.h5"), "tokenizer": str(tok),
        "out_dir": str(out)})
    if steps <= params.pretrain.optim.warmup_steps:
        cfg.optim.warmup_steps = max(1, steps // 10)
    cfg_path = out.with_suffix(".json")
    write_json(cfg_path, cfg.model_dump(mode="json"))
    t0 = time.time()
    run_torchrun(cfg_path, resolve_nproc(params.pretrain.nproc, params.pretrain.device), on_line=lambda _: None)
    summary = json.loads((out / "summary.json").read_text())
    summary["wall"] = time.time() - t0
    return summary


def val_bpc(ckpt: Path, packed: Path) -> dict:
    model, tok, cfg = load_model(ckpt)
    with PackedTokens(packed / "validation.h5", expected_tokenizer_sha256=sha256_file(ckpt / "tokenizer.json")) as v:
        tokens = np.asarray(v.tokens[:])
    n_chars = len(tok.decode(tokens[1:].tolist(), skip_special_tokens=True))
    nll, n = sequence_nll(model, tokens, cfg.max_seq_len, 16)
    base, _ = unigram_nll(tokens, cfg.vocab_size)
    return {"val_bpc": summarize(nll, n, n_chars)["bits_per_char"], "unigram_bpc": summarize(base, n, n_chars)["bits_per_char"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0, help="training wall-clock budget per variant")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--steps", type=int, default=None, help="fixed step count instead of the wall-clock budget "
                    "(compares variants of one shape at equal tokens, immune to machine load)")
    args = ap.parse_args()
    corpus = ROOT / "data" / "corpus"
    results = json.loads((OUT / "tune_results.json").read_text()) if (OUT / "tune_results.json").exists() else {}
    for name, overrides in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        params = load_params(ROOT / "params.yaml", overrides)
        tok, packed = data_for(params, corpus)
        if args.steps:
            steps = args.steps
        else:
            # Scale steps to fill the budget at the speed a short probe run measured (startup excluded).
            probe = train(params.model_copy(deep=True), packed, tok, OUT / f"{name}_probe", 12)
            tokens_per_step = (params.pretrain.batch_size * params.pretrain.seq_len * params.pretrain.grad_accum
                               * probe["world_size"])
            steps = max(20, int(args.minutes * 60 * probe["tokens_per_sec"] / tokens_per_step))
        summary = train(params, packed, tok, OUT / name, steps)
        result = {"variant": name, "overrides": overrides, "steps": steps, "n_params": summary["n_params"],
                  "tokens_per_sec": round(summary["tokens_per_sec"]), "train_wall_s": round(summary["wall"], 1),
                  "final_train_loss": round(summary["final_train_loss"], 4)}
        result |= {k: round(v, 4) for k, v in val_bpc(OUT / name, packed).items()}
        print(json.dumps(result), flush=True)
        results[name] = result
        write_json(OUT / "tune_results.json", results)


if __name__ == "__main__":
    main()
