"""Does pretraining on repeated random sequences give the demo's model induction within the demo's budget? (a probe)

    python bench/induction_probe.py --packed data/packed --fraction 0.25 --steps 450

Trains params.yaml's model with the pretrain section's optimizer (one process, bf16 autocast, batch 16 rows of
max_seq_len: the demo's tokens per step), a --fraction of each batch's rows replaced by a random token sequence of
8 to max_seq_len/2 tokens repeated to the row's end; then reports validation loss (on natural text) and
bench/induction.py's check (loss on a random 60-token sequence shown twice: first copy against second).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from astrai_core.model.transformer import Transformer  # noqa: E402
from astrai_core.training.optim import build_optimizer  # noqa: E402
from tasks.run.configs import train_config  # noqa: E402
from tasks.run.params import load_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packed", type=Path, required=True, help="the pack stage's folder (train.h5, validation.h5)")
    ap.add_argument("--fraction", type=float, default=0.25, help="rows of each batch that are repeated random tokens")
    ap.add_argument("--steps", type=int, default=450)
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    params = load_params(ROOT / "params.yaml")
    cfg, optim = params.model, train_config(params, "pretrain", ROOT).optim
    train = h5py.File(args.packed / "train.h5")["tokens"][:].astype(np.int64)
    val = h5py.File(args.packed / "validation.h5")["tokens"][:].astype(np.int64)
    T, rng = cfg.max_seq_len, np.random.default_rng(0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt, sched = build_optimizer(model, optim, torch.device("cpu"), args.steps)
    start = time.perf_counter()
    for _ in range(args.steps):
        x = torch.tensor(np.stack([train[i:i + T + 1] for i in rng.integers(0, len(train) - T - 1, args.rows)]))
        if k := round(args.fraction * args.rows):
            period = int(rng.integers(8, T // 2))
            x[:k] = torch.randint(10, cfg.vocab_size, (k, period)).repeat(1, (T + 1) // period + 1)[:, :T + 1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        vx = torch.tensor(np.stack([val[i:i + T + 1] for i in range(0, min(len(val) - T - 1, 64 * T), T)]))
        val_loss = F.cross_entropy(model(vx[:, :-1]).flatten(0, 1), vx[:, 1:].flatten()).item()
        seq = torch.randint(10, cfg.vocab_size, (32, 60), generator=torch.Generator().manual_seed(1))
        xx = torch.cat([seq, seq], 1)
        logits = model(xx[:, :-1])
        per_token = F.cross_entropy(logits.flatten(0, 1), xx[:, 1:].flatten(), reduction="none").view(32, -1)
    print(json.dumps({"fraction": args.fraction, "steps": args.steps, "seconds": round(seconds, 1),
                      "val_loss": round(val_loss, 3), "loss_first_copy": round(per_token[:, :59].mean().item(), 2),
                      "loss_second_copy": round(per_token[:, 60:].mean().item(), 2),
                      "top1_second_copy": round((logits[:, 60:].argmax(-1) == xx[:, 61:]).float().mean().item(), 3)}))


if __name__ == "__main__":
    main()
