"""Can a checkpoint copy from its context (induction)? Its loss on random token sequences shown twice in a row.

    python bench/induction.py data/pretrain data/sft [--out bench/induction_report.json]

A model that copies predicts the second copy far better than the first (the loss drops toward 0 and top-1 rises
toward 1); one that does not scores both copies alike. The copying task families (first_speaker, last_word) need this.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from astrai_core.checkpoint.model_dir import load_model  # noqa: E402


def induction(ckpt: Path, rows: int = 32, length: int = 60, seed: int = 0) -> dict:
    model, _, cfg = load_model(ckpt)
    seq = torch.randint(10, cfg.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))
    x = torch.cat([seq, seq], 1)
    with torch.no_grad():
        logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(rows, -1)
    return {"checkpoint": str(ckpt), "ln_vocab": round(math.log(cfg.vocab_size), 2),
            "loss_first_copy": round(loss[:, :length - 1].mean().item(), 3),
            "loss_second_copy": round(loss[:, length:].mean().item(), 3),
            "top1_second_copy": round((logits[:, length:].argmax(-1) == x[:, length + 1:]).float().mean().item(), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("induction_report.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [induction(c) for c in args.checkpoints]
    for r in rows:
        print(json.dumps(r))
    args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
