"""Wall-clock training throughput of each architecture option under torchrun (not a test).

Every variant trains the demo's shape (params.yaml `model`, with its seq_len and batch size) on the
packed demo data for a few steps with 2 gloo ranks, bf16 autocast, batch 16 per rank, exactly as the pretrain
stage runs it; tokens/s excludes the first step. The plain Llama baseline runs first, in the middle and last, so
drift from other load on the machine shows. Needs `astrai stage pack` to have run (data/packed, data/tokenizer).

    python bench/options.py [--steps 12] [--nproc 2] [--out bench/options_report.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "llama": {},
    "mqa": {"n_kv_heads": 1},
    "mha": {"n_kv_heads": 4},
    "untied": {"tie_embeddings": False},
    "qkv_bias (qwen2)": {"qkv_bias": True},
    "qk_norm (qwen3)": {"qk_norm": True},
    "attn_gate": {"attn_gate": True},
    "rope linear x4": {"rope_scaling": "linear", "rope_factor": 4.0},
    "rope ntk x4": {"rope_scaling": "ntk", "rope_factor": 4.0},
    "mla (deepseek-v2)": {"attention": "mla", "mla_kv_rank": 64, "mla_rope_dim": 16},
    "moe 8 top-2": {"n_experts": 8, "moe_top_k": 2, "moe_ffn_dim": 192},
    "moe 8 top-2 + shared": {"n_experts": 8, "moe_top_k": 2, "n_shared_experts": 1, "moe_ffn_dim": 192},
    "qk_norm + moe (qwen3-moe)": {"qk_norm": True, "n_experts": 8, "moe_top_k": 2, "moe_ffn_dim": 192},
    "mla + moe + shared": {"attention": "mla", "mla_kv_rank": 64, "mla_rope_dim": 16, "n_experts": 8,
                           "moe_top_k": 2, "n_shared_experts": 1, "moe_ffn_dim": 192},
}


def run_variant(name: str, overrides: dict, steps: int, nproc: int, tmp: Path) -> dict:
    from astrai_core.model.config import ModelConfig
    from astrai_core.model.transformer import Transformer
    from astrai_core.training.config import TrainConfig
    from astrai_core.training.distributed import run_torchrun
    from tasks.run.params import load_params

    params = load_params(ROOT / "params.yaml")
    model = ModelConfig(**{**params.model.model_dump(), **overrides})
    out = tmp / name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "p")
    cfg = TrainConfig(model=model, optim=params.pretrain.optim, train_data=str(ROOT / "data/packed/train.h5"),
                      tokenizer=str(ROOT / "data/tokenizer/tokenizer.json"), out_dir=str(out),
                      seq_len=params.pretrain.seq_len, batch_size=params.pretrain.batch_size, max_steps=steps,
                      dtype="bf16", device="cpu", log_every=steps)
    config_path = tmp / f"{out.name}.json"
    config_path.write_text(cfg.model_dump_json())
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    t0 = time.perf_counter()
    run_torchrun(config_path, nproc, env=env, on_line=lambda line: None)
    summary = json.loads((out / "summary.json").read_text())
    return {"variant": name, "options": overrides, "params": Transformer(model).num_params(),
            "tokens_per_sec": round(summary["tokens_per_sec"]), "wall_seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "options_report.json"))
    args = parser.parse_args()
    names = list(VARIANTS)
    order = ["llama"] + names[1: len(names) // 2] + ["llama"] + names[len(names) // 2:] + ["llama"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in order:
            row = run_variant(name, VARIANTS[name], args.steps, args.nproc, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = sorted(r["tokens_per_sec"] for r in rows if r["variant"] == "llama")[1]  # median of 3
    for r in rows:
        r["vs_llama"] = round(r["tokens_per_sec"] / base, 3)
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                          "load_average_before": os.getloadavg()},
              "setup": f"{args.nproc} torchrun ranks (gloo), bf16 autocast, demo shape, batch 16/rank, seq 256, "
                       f"{args.steps} steps, tokens/s excluding the first step",
              "llama_median_tokens_per_sec": base, "runs": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
