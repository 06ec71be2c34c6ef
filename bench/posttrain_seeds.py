"""The post-training chain over several seeds: is the demo's result a lucky seed? (a benchmark, not a test)

    python bench/posttrain_seeds.py                      # seeds 0 1 2; writes bench/posttrain_seeds_report.json
    python bench/posttrain_seeds.py --seeds 0 1 --set sft.max_steps=50 --out /tmp/seeds.json   # a smoke run

Needs the pipeline's outputs up to the pretrained model and the chat data (`make demo`, or `astrai stage` up to
chat_data) in this directory. For each seed: a work directory whose data/ links the shared inputs (corpus,
tokenizer, packed, pretrain, chat), a copy of params.yaml with the seed of sft, dpo and grpo set (the evaluate
stage keeps its own, so every seed is scored on the same samples), its own MLflow sqlite store, and
`astrai stage sft dpo_reference dpo grpo evaluate` run there. The report gives every check of the evaluate stage
(each stage against its starting model, and the final model's forgetting) per seed, and over the seeds its
mean, standard deviation, min and max, with how many seeds passed it; and each model's task accuracy likewise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import cpu_name  # noqa: E402
from tasks.run.table import CHAT, CORPUS, EVALUATE, PACKED, TOKENIZER, TRAINING  # noqa: E402
from astrai_core.runtime.errors import AstraiError  # noqa: E402
from tasks.run.params import load_params  # noqa: E402

# what every seed starts from, linked, never written
SHARED = (CORPUS, TOKENIZER, PACKED, TRAINING["pretrain"].out, CHAT)
STAGES = ("sft", "dpo_reference", "dpo", "grpo", "evaluate")
SEEDED = ("sft", "dpo", "grpo")
MODELS = ("pretrain", "sft", "dpo", "grpo")


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.mean(values), 4),
            "sd": round(statistics.stdev(values), 4) if len(values) > 1 else None,
            "min": round(min(values), 4), "max": round(max(values), 4), "values": [round(v, 4) for v in values]}


def run_seed(seed: int, raw: dict, work: Path) -> dict:
    """The post-training chain with `seed` in `work` (raw: the resolved params): -> the evaluate stage's checks
    and metrics."""
    for path in SHARED:
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).symlink_to(ROOT / path)
    raw = json.loads(json.dumps(raw))
    for stage in SEEDED:
        raw[stage]["seed"] = seed
    (work / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    times = {}
    for stage in STAGES:
        start = time.perf_counter()
        with open(work / f"{stage}.log", "w") as log:
            done = subprocess.run([sys.executable, "-m", "astrai.cli", "stage", stage, "--params", "params.yaml"],
                                  cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode:
            raise SystemExit(f"posttrain_seeds: error: seed {seed}: stage {stage} failed (exit {done.returncode}); its log: "
                             f"{work / f'{stage}.log'}")
        times[stage] = round(time.perf_counter() - start, 1)
        print(f"seed {seed}: {stage} {times[stage]} s", flush=True)
    return {"seconds": times, "checks": json.loads((work / EVALUATE / "checks.json").read_text()),
            "metrics": json.loads((work / EVALUATE / "metrics.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a param for every seed (as `astrai pipeline --set`)")
    ap.add_argument("--work", type=Path, help="put each seed's work directory here and keep it (default: a "
                    "temporary directory, removed at the end)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "posttrain_seeds_report.json")
    args = ap.parse_args()
    missing = [str(p) for p in SHARED if not (ROOT / p).exists()]
    if missing:
        raise SystemExit(f"posttrain_seeds: error: missing {', '.join(missing)}: run the pipeline up to chat_data "
                         "first (make demo)")
    try:  # every bad value stops here, in one line, before any stage runs
        overrides = {}
        for item in args.overrides:
            key, eq, value = item.partition("=")
            if not eq:
                raise AstraiError(f"--set {item!r}: expected KEY=VALUE, e.g. sft.max_steps=50")
            overrides[key.strip()] = yaml.safe_load(value)
        raw = load_params(args.params, overrides).model_dump(mode="json")  # every default filled in
    except AstraiError as e:
        raise SystemExit(f"posttrain_seeds: error: {e}") from None
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = {}
    with contextlib.nullcontext(args.work) if args.work else tempfile.TemporaryDirectory() as base:
        for seed in args.seeds:
            work = Path(base) / f"seed-{seed}"
            work.mkdir(parents=True)
            runs[seed] = run_seed(seed, raw, work)

    checks = []
    for i, check in enumerate(runs[args.seeds[0]]["checks"]):
        per_seed = [runs[s]["checks"][i] for s in args.seeds]
        checks.append({k: check[k] for k in ("stage", "start", "metric", "rule")}
                      | {"difference": spread([c["difference"] for c in per_seed]),
                         "passed": f"{sum(c['passed'] for c in per_seed)} of {len(per_seed)}"})
    accuracy = {m: spread([runs[s]["metrics"][f"{m}/task_accuracy"] for s in args.seeds]) for m in MODELS}
    report = {"machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                          "started": started, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "seeds": args.seeds, "overrides": args.overrides, "checks": checks, "task_accuracy": accuracy,
              "seconds_per_seed": {s: runs[s]["seconds"] for s in args.seeds},
              "per_seed": {s: {"checks": runs[s]["checks"]} for s in args.seeds}}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for c in checks:
        d = c["difference"]
        print(f"{c['stage']} vs {c['start']} {c['metric']}: {d['mean']:+.4f} (sd {d['sd']}, {d['min']:+.4f} to "
              f"{d['max']:+.4f}); passed {c['passed']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
