"""Where one engine decode step's time goes, eager and compiled (EngineConfig.compile): the engine alone (no HTTP),
B requests decoding together, each part of Engine.step() timed around its call, medians over the steps; and the
step that prefills new prompts (1 or 4 of 16 or 64 tokens), eager and compiled.

    python bench/decode_step.py [--batches 1 4 16 64] [--steps 200] [--modes eager compiled eager+packed compiled+packed]
                                [--temperature 0.8 --top-p 0.95 --seeded] [--out bench/decode_step_report.json]
                                [--model CHECKPOINT [--dtype auto]] [--threads 1 2]

Parts: schedule (Scheduler.schedule: admission, block tables), inputs (Runner.run around the forward: the tensors
built from the sequences, the logits picked), forward (the model with the paged KV: Runner._forward eager, or the
compiled graph), sample (Scheduler.postprocess: the sampling of every row, bookkeeping; greedy unless
--temperature, each request its own generator with --seeded), rest (Engine.step's own: events,
the inbox). The demo's shape (params.yaml) with random weights, or --model's checkpoint; 1 torch thread (what
`astrai serve` picks on 2 cores below 60M parameters), or each of --threads in turn for every batch size (interleaved). Compile time (the warm-up at Engine construction, and when each graph was ready: decode's first) is
reported too; torch caches compiled code on disk,
so a second run compiles faster.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.checkpoint.model_dir import inference_dtype_of, load_model  # noqa: E402
from astrai_core.inference.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from astrai_core.model.transformer import Transformer  # noqa: E402
from bench.serving import machine  # noqa: E402
from tasks.run.params import load_params  # noqa: E402

PARTS = ("schedule", "inputs", "forward", "sample", "rest")


def timed(spent: list[float], fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent.append(time.perf_counter() - t)
    return wrapper


def profile(engine: Engine, batch: int, steps: int, params: Callable[[int], SamplingParams]) -> dict:
    """Median milliseconds per decode step of each part, with `batch` requests decoding."""
    runner, scheduler = engine.runner, engine.scheduler
    spent: dict[str, list[float]] = {k: [] for k in ("step", "schedule", "run", "forward", "sample")}
    for i in range(batch):
        engine.submit([1 + i % 100, 2, 3, 4, 5, 6, 7, 8], params(i), lambda *a: None)
    for _ in range(3):  # the prefill and the first decodes
        engine.step()
    attr = "compiled" if runner.graphs else "_forward"
    originals = {"schedule": scheduler.schedule, "postprocess": scheduler.postprocess, "run": runner.run,
                 attr: getattr(runner, attr)}
    scheduler.schedule = timed(spent["schedule"], originals["schedule"])
    scheduler.postprocess = timed(spent["sample"], originals["postprocess"])
    runner.run = timed(spent["run"], originals["run"])
    setattr(runner, attr, timed(spent["forward"], originals[attr]))
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            spent["step"].append(time.perf_counter() - t)
    finally:
        for name, fn in originals.items():
            setattr(scheduler if name in ("schedule", "postprocess") else runner, name, fn)
    while engine.step():  # finish the requests
        pass
    ms = {k: [v * 1e3 for v in vals] for k, vals in spent.items()}
    parts = {
        "schedule": ms["schedule"],
        "inputs": [r - f for r, f in zip(ms["run"], ms["forward"])],
        "forward": ms["forward"],
        "sample": ms["sample"],
        "rest": [st - sc - r - sa for st, sc, r, sa in zip(ms["step"], ms["schedule"], ms["run"], ms["sample"])],
    }
    row = {"batch": batch, "step_ms": round(statistics.median(ms["step"]), 3)}
    row |= {f"{k}_ms": round(statistics.median(v), 3) for k, v in parts.items()}
    row["tokens_per_s"] = round(batch / row["step_ms"] * 1e3)
    return row


def prefill(engine: Engine, rows: int, tokens: int, reps: int) -> dict:
    """Median milliseconds of the engine step that prefills `rows` new prompts of `tokens` tokens each (one
    chunk: tokens <= EngineConfig.prefill_chunk), the prefix cache off so that every prompt is computed."""
    spent = []
    for rep in range(reps):
        for i in range(rows):
            prompt = [1 + (rep * 7 + i * 13 + j) % 400 for j in range(tokens)]
            engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0), lambda *a: None)
        t = time.perf_counter()
        engine.step()
        spent.append(time.perf_counter() - t)
        while engine.step():  # the decode and the end
            pass
    ms = statistics.median(spent) * 1e3
    return {"rows": rows, "tokens": tokens, "step_ms": round(ms, 3), "prompt_tokens_per_s": round(rows * tokens / ms * 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--steps", type=int, default=200, help="decode steps measured per batch size")
    ap.add_argument("--modes", nargs="*", default=["eager", "compiled"],
                    choices=["eager", "compiled", "eager+packed", "compiled+packed"],
                    help="+packed: EngineConfig.pack_weights (a bf16 model's projections on prepacked weights)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy requests")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seeded", action="store_true", help="each request its own seed (a generator per row)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill steps")
    ap.add_argument("--model", type=Path, help="a checkpoint directory (default: the demo's shape, random weights)")
    ap.add_argument("--threads", type=int, nargs="*", default=[1], help="torch threads; with several, each batch "
                    "size and prefill shape runs at each in turn")
    ap.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"), help="--model's weights, as `astrai "
                    "serve --dtype` chooses them (auto: bf16 where native and the model is 2M parameters or more)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "decode_step_report.json")
    args = ap.parse_args()
    if args.model:
        model, _, cfg = load_model(args.model, dtype=inference_dtype_of(args.model, args.dtype, torch.device("cpu"))[0])
    else:
        cfg = load_params(ROOT / "params.yaml").model
        torch.manual_seed(0)
        model = Transformer(cfg)
    model.eval()
    if args.steps + 20 > cfg.max_seq_len:
        sys.exit(f"--steps {args.steps}: at most {cfg.max_seq_len - 20} (the model's max_seq_len - 20)")
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=args.steps + 10, temperature=args.temperature, top_p=args.top_p,
                              seed=i if args.seeded else None)

    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
    report = {"machine": machine(), "settings": settings, "modes": {}}
    for mode in args.modes:
        torch.set_num_threads(args.threads[0])
        start = time.perf_counter()
        compiled, packed = mode.startswith("compiled"), mode.endswith("+packed")
        engine = Engine(copy.deepcopy(model), EngineConfig(compile=compiled, pack_weights=packed))  # packing swaps layers
        built = round(time.perf_counter() - start, 1)
        graphs = engine.runner.graph_seconds  # when each graph was ready (decode's first), from the compile's start
        print(mode, f"engine built in {built} s; graphs at {graphs}", flush=True)
        rows: dict[int, list[dict]] = {t: [] for t in args.threads}
        for b in args.batches:
            for t in args.threads:
                torch.set_num_threads(t)
                rows[t].append(profile(engine, b, args.steps, params))
                print(mode, f"{t} thread(s)", json.dumps(rows[t][-1]), flush=True)
        engine = Engine(copy.deepcopy(model), EngineConfig(compile=compiled, pack_weights=packed, prefix_cache=False))
        prefills: dict[int, list[dict]] = {t: [] for t in args.threads}
        for r, n in () if args.no_prefill else ((1, 16), (1, 64), (4, 64)):
            for t in args.threads:
                torch.set_num_threads(t)
                prefills[t].append(prefill(engine, r, n, reps=20))
                print(mode, f"{t} thread(s)", json.dumps(prefills[t][-1]), flush=True)
        if len(args.threads) == 1:  # the report's layout of one thread count
            report["modes"][mode] = {"engine_built_s": built, "graphs_built_s": graphs, "rows": rows[args.threads[0]],
                                     "prefill": prefills[args.threads[0]]}
        else:
            report["modes"][mode] = {"engine_built_s": built, "graphs_built_s": graphs, **{f"{t}_threads": {"rows": rows[t], "prefill":
                                                                                    prefills[t]} for t in args.threads}}
    report["machine"]["load_average_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
