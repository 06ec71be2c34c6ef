"""Sampling a decode step's rows in one call (sample_rows) against one call per row, of the same sampler and of
the one before it (--before: sample_next as the scheduler called it, row by row, read from git). Temperature
0.8 and top-p 0.95, each row its own seeded
generator (as served requests with a seed have), the chosen ids read to the host. Interleaved, medians.
The logits are Gaussian with standard deviation --scale: 5 is peaked like a trained model's next token (at 49,152
tokens: entropy about 2 nats, the 0.95 nucleus a few dozen tokens), 3 is flat (the nucleus beyond the sampler's
top-k candidates: the worst case, a full sort of every row either way).

    python bench/sampling.py [--rows 1 16 64] [--vocab 512 49152] [--scale 5 3] [--reps 100]
                             [--out bench/sampling_report.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.inference.sampling import sample_rows  # noqa: E402
from bench.serving import machine  # noqa: E402


def sample_next_at(rev: str):
    """The scheduler's sampler as it was at git revision `rev` (one call per row: sample_next, in the core's
    generate.py then), from git itself."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:astrai_core/generate.py"], capture_output=True,
                         text=True, check=True).stdout
    namespace: dict = {}
    exec(compile(src, f"{rev}:astrai_core/generate.py", "exec"), namespace)
    return namespace["sample_next"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, nargs="*", default=[512, 49152])
    ap.add_argument("--scale", type=float, nargs="*", default=[5.0, 3.0])
    ap.add_argument("--before", default="a3e78e5", help="the git revision whose per-row sampler is the baseline")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "sampling_report.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    before = sample_next_at(args.before)
    torch.manual_seed(0)
    for vocab, scale, rows in itertools.product(args.vocab, args.scale, args.rows):
        logits = torch.randn(rows, vocab) * scale
        probs = torch.softmax(logits / 0.8, dim=-1)
        entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1).mean().item()
        nucleus = (probs.sort(dim=-1, descending=True).values.cumsum(-1) < 0.95).sum(-1).float().mean().item() + 1
        gens = [torch.Generator().manual_seed(i) for i in range(rows)]
        runs = {
            "bulk": lambda: sample_rows(logits, [0.8] * rows, [None] * rows, [0.95] * rows, gens).tolist(),
            "per_row": lambda: [int(sample_rows(logits[i:i + 1], [0.8], [None], [0.95], [g])[0])
                                for i, g in enumerate(gens)],
            "before": lambda: [int(before(logits[i:i + 1], 0.8, None, 0.95, g)[0]) for i, g in enumerate(gens)],
        }
        spent = {name: [] for name in runs}
        for _ in range(args.reps):  # interleaved: the machine's noise falls on all alike
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                spent[name].append(time.perf_counter() - t)
        us = {k: round(statistics.median(v) * 1e6, 1) for k, v in spent.items()}
        row = {"vocab": vocab, "scale": scale, "entropy_nats": round(entropy, 2), "nucleus_tokens": round(nucleus),
               "rows": rows} | {f"{k}_us": v for k, v in us.items()}
        row |= {"bulk_over_before": round(us["before"] / us["bulk"], 2),
                "bulk_over_per_row": round(us["per_row"] / us["bulk"], 2)}
        print(json.dumps(row), flush=True)
        results.append(row)
    report = {"machine": machine(), "settings": vars(args) | {"out": str(args.out)}, "results": results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
