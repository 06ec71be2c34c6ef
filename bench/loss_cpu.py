"""The summed cross-entropy on the CPU: losses._CrossEntropySum (cache-sized chunks, what token_loss_sum runs on the
eager CPU) against F.cross_entropy on the whole (rows, vocab) in one pass (what it runs elsewhere), forward and
backward, bf16 and fp32 logits, at three vocabularies. Why the CPU keeps its chunks (docs/gpu.md).

    python bench/loss_cpu.py      # prints one line per shape and dtype: the better of two interleaved medians of 7

Measured 2026-11-27 on the AVX-512 BF16 EPYC, 2 threads, load ~1.3: bf16 chunked 48.6 / 46.3 / 95.8 ms against one
pass 87.0 / 90.2 / 176.6 ms (vocab 2,048 / 8,192 / 32,768); fp32 chunked 62.1 / 62.7 / 116.1 against 56.2 / 54.9 /
109.9 ms.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from astrai_core.model.losses import IGNORE_INDEX, _CrossEntropySum  # noqa: E402


def median_ms(fn, vocab: int, rows: int, dtype: torch.dtype, runs: int = 7) -> float:
    x = torch.randn(rows, vocab, dtype=dtype, requires_grad=True)
    t = torch.randint(0, vocab, (rows,))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(x, t).backward()
        times.append(time.perf_counter() - t0)
        x.grad = None
    return statistics.median(times) * 1e3


def chunked(x, t):
    return _CrossEntropySum.apply(x, t, IGNORE_INDEX, 0.0)


def one_pass(x, t):
    return F.cross_entropy(x.float(), t, reduction="sum")


def main() -> None:
    torch.set_num_threads(2)
    for vocab, rows in ((2048, 8192), (8192, 2048), (32768, 1024)):
        for dtype in (torch.bfloat16, torch.float32):
            a, b = [], []
            for _ in range(2):  # interleaved: the machine's drift hits both alike
                a.append(median_ms(chunked, vocab, rows, dtype))
                b.append(median_ms(one_pass, vocab, rows, dtype))
            print(f"vocab {vocab:>6} x {rows:>5} rows, {str(dtype).removeprefix('torch.'):>8}: chunked {min(a):6.1f} ms,"
                  f" one pass {min(b):6.1f} ms")


if __name__ == "__main__":
    main()
