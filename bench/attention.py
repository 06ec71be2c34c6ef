"""Causal GQA attention, forward + backward, per layer: the SDPA kernel the model uses against the alternatives.

    python bench/attention.py          # writes bench/attention_report.json

Attention is the one part of the training step whose kernel we choose (matmuls are oneDNN's either way), so this
measures, at each shape of bench/throughput.py (the demo's, 256 x 4 and 512 x 8 x 512), bf16 and fp32:

* sdpa: F.scaled_dot_product_attention(is_causal=True, enable_gqa=True), what astrai_core/model/transformer.py calls;
* sdpa_fp32_inside: the same on q, k, v cast to fp32 (bf16 in and out), in case the fp32 kernel is faster;
* sdpa_math: SDPA's unfused reference backend;
* explicit: q @ k^T, fp32 masked softmax, @ v, in eager and under torch.compile.

Milliseconds are medians over --reps runs after 2 warm-ups; the variants go round-robin --rounds times after a warm-up
round, and the report keeps the median of the rounds. max_abs_err is against fp32 SDPA on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import SHAPES as TRAIN_SHAPES  # noqa: E402  (the shapes the throughput benchmark trains)

# (batch, heads, kv heads, seq, head dim) of each of bench/throughput.py's shapes
SHAPES = {name: (s["batch_size"], s["model"]["n_heads"], s["model"]["n_kv_heads"], s["seq_len"],
                 s["model"]["dim"] // s["model"]["n_heads"]) for name, s in TRAIN_SHAPES.items()}


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_fp32_inside(q, k, v):
    return sdpa(q.float(), k.float(), v.float()).to(q.dtype)


def sdpa_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v)


def explicit(q, k, v):
    T, D, groups = q.shape[2], q.shape[3], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)).float() * D**-0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(-1).to(q.dtype) @ v


VARIANTS = {"sdpa": sdpa, "sdpa_fp32_inside": sdpa_fp32_inside, "sdpa_math": sdpa_math, "explicit": explicit,
            "explicit_compiled": torch.compile(explicit)}


def time_variant(fn, shape, dtype, reps: int) -> tuple[float, float]:
    B, H, KV, T, D = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, generator=gen).to(dtype).requires_grad_() for h in (H, KV, KV))
    grad = torch.randn(B, H, T, D, generator=gen).to(dtype)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        out = fn(q, k, v)
        out.backward(grad)
        times.append(time.perf_counter() - t0)
    ref = sdpa(q.detach().float(), k.detach().float(), v.detach().float())
    return statistics.median(times[2:]) * 1e3, (out.detach().float() - ref).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).with_name("attention_report.json")))
    args = parser.parse_args()
    ms: dict[tuple, list[float]] = {}
    err: dict[tuple, float] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up (compiles) and is not kept
        for shape in SHAPES:
            for dtype in (torch.bfloat16, torch.float32):
                for name, fn in VARIANTS.items():
                    key = (shape, str(dtype).removeprefix("torch."), name)
                    t, err[key] = time_variant(fn, SHAPES[shape], dtype, args.reps)
                    if round_:
                        ms.setdefault(key, []).append(t)
    rows = [{"shape": s, "dtype": d, "variant": n, "ms_fwd_bwd_per_layer": round(statistics.median(v), 2),
             "rounds_ms": [round(x, 2) for x in v], "max_abs_err": err[(s, d, n)]} for (s, d, n), v in ms.items()]
    for r in rows:
        print(json.dumps(r))
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "shapes": SHAPES,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "method": "Milliseconds" + __doc__.split("Milliseconds")[1].rstrip(),
              "results": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
