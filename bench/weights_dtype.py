"""Decode steps with a model's weights in fp32 and in bf16, side by side: where `--dtype auto` (astrai serve,
astrai generate) should start picking bf16 (astrai_core/runtime/device.py BF16_FROM_PARAMETERS).

    python bench/weights_dtype.py [--shapes demo 256x4 512x8] [--model CHECKPOINT ...] [--batches 1 4 16 64]
                                  [--rounds 3] [--out bench/weights_dtype_report.json]

For each model: two engines (EngineConfig's defaults, eager), the same weights in fp32 and in bf16; B greedy requests
decode together, and the median milliseconds of a decode step (bench/decode_step.py's profile) is taken for each
dtype in turn, --rounds times interleaved. 1 torch thread (what `astrai serve` picks on 2 cores). Shapes: `demo`
(params.yaml's model, random weights) or DIMxLAYERS (a swiglu model, 64-wide heads, vocabulary 8,192); --model adds
checkpoints. Reported: parameters, step ms per dtype and round, and bf16's speed over fp32 (medians).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.checkpoint.model_dir import load_model  # noqa: E402
from astrai_core.inference.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from astrai_core.model.config import ModelConfig  # noqa: E402
from astrai_core.model.transformer import Transformer  # noqa: E402
from bench.decode_step import profile  # noqa: E402
from bench.serving import machine  # noqa: E402
from tasks.run.params import load_params  # noqa: E402


def shape_model(shape: str) -> Transformer:
    if shape == "demo":
        cfg = load_params(ROOT / "params.yaml").model
    else:
        dim, layers = (int(x) for x in shape.split("x"))
        cfg = ModelConfig(vocab_size=8192, dim=dim, n_layers=layers, n_heads=dim // 64, n_kv_heads=dim // 64,
                          mlp="swiglu", max_seq_len=512)
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["demo", "256x4", "512x8"])
    ap.add_argument("--model", type=Path, nargs="*", default=[], help="checkpoint directories")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--steps", type=int, default=30, help="decode steps measured per batch size and dtype")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "weights_dtype_report.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = {s: (lambda s=s: shape_model(s)) for s in args.shapes}
    models |= {str(m): (lambda m=m: load_model(m)[0]) for m in args.model}
    report = {"machine": machine(), "settings": {k: v for k, v in vars(args).items() if k != "out"}, "models": {}}
    for name, make in models.items():
        fp32 = make()
        engines = {"fp32": Engine(fp32, EngineConfig()),
                   "bf16": Engine(copy.deepcopy(fp32).to(torch.bfloat16), EngineConfig())}
        params = lambda i: SamplingParams(max_tokens=args.steps + 10, temperature=0)  # noqa: E731
        rows = []
        for b in args.batches:
            ms: dict[str, list[float]] = {d: [] for d in engines}
            for _ in range(args.rounds):
                for d, engine in engines.items():
                    ms[d].append(profile(engine, b, args.steps, params)["step_ms"])
            row = {"batch": b, **{f"{d}_step_ms": v for d, v in ms.items()},
                   "bf16_speedup": round(statistics.median(ms["fp32"]) / statistics.median(ms["bf16"]), 2)}
            print(name, json.dumps(row), flush=True)
            rows.append(row)
        report["models"][name] = {"parameters": sum(p.numel() for p in fp32.parameters()), "rows": rows}
    report["machine"]["load_average_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
