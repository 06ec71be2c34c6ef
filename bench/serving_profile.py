"""Where a served token's CPU time goes: `astrai serve` under the streams load of bench/serving.py at each level,
with the CPU seconds of each process over the measured window (from /proc: the HTTP server's process, the
engine's process, and this load generator), as cores busy, beside the tokens/s.

    python bench/serving_profile.py --model data/pretrain --corpus data/corpus [--levels 1 4 16 64] [--seconds 8]
    python bench/serving_profile.py --compile   # astrai serve --compile, the demo's shape with random weights

A process near 1.0 core is a limit on 2 cores (each process's busy threads are counted together); py-spy
(`py-spy record --threads -p PID`) then says which function: README.md's serving section reports both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving import astrai_server, demo_shape_checkpoint, machine, run_load, stream_prompts  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def engine_pid(server_pid: int) -> int:
    ps = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server_pid)], capture_output=True, text=True)
    return next(int(line.split()[0]) for line in ps.stdout.splitlines() if "spawn_main" in line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: random weights at the demo shape)")
    ap.add_argument("--compile", action="store_true", help="serve with --compile")
    ap.add_argument("--corpus", type=Path)
    ap.add_argument("--levels", type=int, nargs="*", default=[1, 2, 4, 16, 64])
    ap.add_argument("--seconds", type=float, default=8.0, help="measured window per level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("serving_profile_report.json"))
    args = ap.parse_args()
    report = {"machine": machine(), "settings": {"levels": args.levels, "seconds": args.seconds,
                                                 "max_tokens": args.max_tokens, "model": str(args.model),
                                                 "compile": args.compile},
              "levels": []}
    with tempfile.TemporaryDirectory() as tmp, astrai_server(args.model or demo_shape_checkpoint(Path(tmp)), Path(tmp),
                                                             ("--compile",) if args.compile else ()) as server:
        model_id = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        pids = {"http_server": server.proc.pid, "engine": engine_pid(server.proc.pid), "load_generator": os.getpid()}
        asyncio.run(run_load(server.url, model_id, [("the king", 4)] * 2, concurrency=2))
        for c in args.levels:
            requests = stream_prompts(args.corpus, 4096, args.max_tokens, seed=c)
            before = {k: cpu_seconds(p) for k, p in pids.items()}
            start, rows, i = time.perf_counter(), [], 0
            while time.perf_counter() - start < args.seconds:
                batch = requests[i:i + max(2 * c, 8)]
                i += len(batch)
                rows.append(asyncio.run(run_load(server.url, model_id, batch, concurrency=c)))
            wall = time.perf_counter() - start
            busy = {k: round((cpu_seconds(p) - before[k]) / wall, 2) for k, p in pids.items()}
            tokens = sum(r["output_tokens"] for r in rows)
            row = {"streams": c, "output_tokens_per_s": round(tokens / wall, 1), "cores_busy": busy,
                   "cores_busy_total": round(sum(busy.values()), 2)}
            report["levels"].append(row)
            print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
