"""A decode step's attention (one new token per row over S cached keys), grouped-query heads, per 30 layers:
astrai_core/model/transformer.py causal_attention (the query heads of a KV head folded into that head's queries)
against SDPA with enable_gqa=True and one query per head, what it called before.

    python bench/decode_attention.py [--rounds 5] [--out bench/decode_attention_report.json]

Shapes as the engine's runner gives them: keys and values gathered from a paged pool (strided views), a boolean mask
(B, 1, 1, S) whose last eighth of keys is padding; heads of SmolLM2-135M (9 query / 3 KV heads of 64) and of the
demo's model (params.yaml); bf16 and fp32; B rows of 1, 4, 16 and 64; S 128 and 512. 1 torch thread (what `astrai
serve` gives its engine on 2 cores). Milliseconds for 30 calls (SmolLM2's layers), median of --reps after warm-ups;
the two forms alternate --rounds times and the report keeps the medians of the rounds, their ratio, and the largest
difference between the two outputs.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.model.transformer import causal_attention  # noqa: E402
from bench.serving import machine  # noqa: E402
from tasks.run.params import load_params  # noqa: E402


def per_30_layers(f, reps: int) -> float:
    for _ in range(2):
        f()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(30):
            f()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "decode_attention_report.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    demo = load_params(ROOT / "params.yaml").model
    heads = {"smollm2_135m": (9, 3, 64), "demo": (demo.n_heads, demo.n_kv_heads, demo.dim // demo.n_heads)}
    rows = []
    for name, (h, kv, d) in heads.items():
        for dtype in (torch.bfloat16, torch.float32):
            for B in (1, 4, 16, 64):
                for S in (128, 512):
                    torch.manual_seed(0)
                    q = torch.randn(B, h, 1, d, dtype=dtype)
                    pool = torch.randn(2, B * S, kv, d, dtype=dtype)
                    k, v = (p.index_select(0, torch.randperm(B * S)).view(B, S, kv, d).movedim(1, -2) for p in pool)
                    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
                    mask[..., S - S // 8:] = False
                    forms = {"folded": lambda: causal_attention(q, k, v, enable_gqa=kv != h, mask=mask),
                             "sdpa_enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                       enable_gqa=kv != h)}
                    ms = {f: [] for f in forms}
                    for _ in range(args.rounds):
                        for f, call in forms.items():
                            ms[f].append(per_30_layers(call, args.reps))
                    row = {"heads": name, "dtype": str(dtype).removeprefix("torch."), "rows": B, "keys": S,
                           **{f"{f}_ms": round(statistics.median(v), 3) for f, v in ms.items()},
                           "max_abs_diff": (forms["folded"]().float() - forms["sdpa_enable_gqa"]().float()).abs().max().item()}
                    row["speedup"] = round(row["sdpa_enable_gqa_ms"] / row["folded_ms"], 2)
                    print(row, flush=True)
                    rows.append(row)
    args.out.write_text(json.dumps({"machine": machine(), "settings": vars(args) | {"out": str(args.out)},
                                    "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
