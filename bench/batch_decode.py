"""generate_batch's speed (what GRPO's rollouts and evaluate's tasks run) in this checkout against another revision's,
each in its own process, the rounds interleaved.

    python bench/batch_decode.py --baseline 2001f44 [--model CHECKPOINT] [--rounds 3] [--threads 1]
                                 [--out bench/batch_decode_report.json]

Workloads (the prompts random token ids of 16-96 tokens, fixed by a seed; a model's own stop ids when --model is
a checkpoint with a chat format, else none; --max-new tokens each):
* greedy: 64 prompts, temperature 0, rows_per_batch 64 at once (evaluate's task accuracy, GRPO's validation);
* rollouts: 8 prompts x 8 samples, temperature 1 (GRPO's rollouts; each revision's generate_batch with
  samples_per_prompt 8).
Figures: generated tokens (stop tokens included) per second of wall time (the median of 3 calls in a process),
median over --rounds, and the ratio of
this checkout's to the baseline's. The baseline is checked out with `git worktree` into a temporary folder. The
default model is the demo's shape (params.yaml) with random weights: it rarely stops early, so every row runs to
--max-new (the case where a batch that retires finished rows gains least).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(root: Path, model_dir: str | None, threads: int, max_new: int) -> dict:
    """Run in a child process with `root` first on sys.path: tokens/s of each workload with root's generate_batch."""
    sys.path.insert(0, str(root))
    import torch

    from astrai_core.inference.generate import generate_batch
    from astrai_core.model.transformer import Transformer
    from tasks.run.params import load_params

    torch.set_num_threads(threads)
    stop_ids: tuple[int, ...] = ()
    if model_dir:
        from astrai_core.checkpoint.model_dir import load_model
        from astrai_core.tokenizer.chat import load_chat
        model, _, cfg = load_model(Path(model_dir))
        stop_ids = tuple(load_chat(Path(model_dir) / "tokenizer.json").stop_ids)
    else:
        cfg = load_params(ROOT / "params.yaml").model
        torch.manual_seed(0)
        model = Transformer(cfg)
    model.eval()
    rng = random.Random(0)
    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(16, 96))] for _ in range(n)]
    out = {}
    for name, rows, kw in (("greedy", prompts(64), {}),
                           ("rollouts", prompts(8), {"temperature": 1.0, "samples_per_prompt": 8})):
        generate_batch(model, rows[:2], 4, **{**kw, "samples_per_prompt": 1})  # warm-up
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            new = generate_batch(model, rows, max_new, stop_ids=stop_ids, generator=torch.Generator().manual_seed(0),
                                 **kw)
            seconds.append(time.perf_counter() - start)
        tokens = sum(map(len, new))
        out[name] = {"tokens": tokens, "seconds": statistics.median(seconds),
                     "tokens_per_s": round(tokens / statistics.median(seconds), 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="a git revision of this repository")
    ap.add_argument("--model", help="a checkpoint directory (default: the demo's shape, random weights)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "batch_decode_report.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(Path(args.worker), args.model, args.threads, args.max_new)))
        return
    sys.path.insert(0, str(ROOT))
    from bench.serving import machine

    report = {"machine": machine(), "settings": {k: v for k, v in vars(args).items() if k not in ("out", "worker")},
              "rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline], check=True,
                       capture_output=True)
        try:
            for r in range(args.rounds):
                row = {}
                for label, root in (("baseline", base), ("this", ROOT)):
                    cmd = [sys.executable, __file__, "--baseline", args.baseline, "--worker", str(root),
                           "--threads", str(args.threads), "--max-new", str(args.max_new)]
                    cmd += ["--model", args.model] if args.model else []
                    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root,
                                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
                    if done.returncode:
                        sys.exit(f"{label} ({root}) failed:\n{done.stderr[-3000:]}")
                    row[label] = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"round {r + 1}:", json.dumps(row), flush=True)
                report["rounds"].append(row)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    summary = {}
    for name in report["rounds"][0]["this"]:
        med = {label: statistics.median(r[label][name]["tokens_per_s"] for r in report["rounds"])
               for label in ("baseline", "this")}
        summary[name] = {"baseline_tokens_per_s": med["baseline"], "this_tokens_per_s": med["this"],
                         "ratio": round(med["this"] / med["baseline"], 2)}
    report["summary"] = summary
    report["machine"]["load_average_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
