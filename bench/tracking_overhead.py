"""Training steps/s with its metrics tracked to an MLflow server on PostgreSQL, against tracking off.

    python bench/tracking_overhead.py                         # starts the team services in a temporary directory
    python bench/tracking_overhead.py --services /srv/astrai-team    # or uses running ones (astrai services start)
    python bench/tracking_overhead.py --quick                 # 1 repeat, fewer steps: a smoke run, nothing written

What is measured, in one run on one machine: the pretrain stage's run config with profiles/quick.yaml over
params.yaml (a small model whose short steps make logging weigh more; `--configs demo` takes params.yaml as is,
~4x longer steps with log_every 10) trained in this process on synthetic packed tokens
(astrai_core.training.train.train, one rank, every core) for 40 and 10 logging intervals (INTERVALS), three ways: "off"
(no MLFLOW_RUN_ID: metrics.jsonl only); "tracked" (MLFLOW_RUN_ID set to a run on the MLflow server: rank 0's
MetricLogger sends what was logged with one log_batch over HTTP every SEND_EVERY_S from its sender thread, the server
writes it to PostgreSQL; MLflow's system metrics sampled as in every run); "tracked_every_step" (the same, one log_batch
per logged step, as before: MetricLogger.send_every = 0). steps/s is taken from metrics.jsonl's own time stamps, from
the first logged step to the last: what the run sees (the loop's tokens_per_sec leaves the logging out). The runs
of a repeat go in a rotating order, so load drift on this shared machine hits every side alike; the report gives
each side's median and its ratio to off, the median time the training thread spent in MetricLogger.log per call,
and where the CPU went during a run, in cores (CPU seconds / the run's seconds, median): the MLflow server's
processes, PostgreSQL's (its backends serve Prefect as well: "off" shows that base), the sender thread and the
system-metrics thread (each thread's own CPU clock). Before the runs, log_batch_cpu_ms: the CPU one log_batch call
takes in those processes and in the calling thread, for one logged step and for sixty (200 and 20 calls in a row).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from astrai_core.runtime import env  # noqa: E402

env.apply()  # telemetry off, the MLflow client's retries: as every astrai command has them

from astrai_core.training.metric_log import flatten  # noqa: E402
from tasks.run.configs import train_config  # noqa: E402
from tasks.run.params import load_params, load_profile  # noqa: E402
from throughput import machine, synthetic_data  # noqa: E402

TARGET = 0.03  # tracking may cost at most 3% of the steps/s
INTERVALS = {"quick": 40, "demo": 10}  # logged intervals a run: ~6 s and ~11 s on the idle 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(profile: str | None):
    """pretrain's TrainConfig from params.yaml (with profiles/PROFILE.yaml over it)."""
    overrides = flatten(load_profile(ROOT, profile)) if profile else {}
    return train_config(load_params(ROOT / "params.yaml", overrides), "pretrain", ROOT)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` and all its children, live and exited (0 without one)."""
    import psutil

    if pid is None:
        return 0.0
    root = psutil.Process(pid)
    t = root.cpu_times()
    total = t.children_user + t.children_system
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def log_batch_cpu_ms(client, exp_id: str, services: dict[str, int | None], steps: int, calls: int) -> dict:
    """CPU milliseconds per log_batch call of `steps` logged steps of 4 metrics (what the training loop logs), in
    each of `services` (name: pid) and in the calling thread: `calls` calls in a row into a run of their own.
    Unlike steps/s, this does not depend on what else the machine runs."""
    from mlflow.entities import Metric

    run_id = client.create_run(exp_id, run_name=f"log-batch-{steps}").info.run_id
    cpu0, t0 = {name: cpu_seconds(pid) for name, pid in services.items()}, time.thread_time()
    for call in range(calls):
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(key, 1.0, now, call * steps + i) for i in range(steps)
                                          for key in ("loss", "lr", "grad_norm", "tokens_per_sec")])
    caller = time.thread_time() - t0
    client.set_terminated(run_id)
    used = {name: cpu_seconds(pid) - cpu0[name] for name, pid in services.items()} | {"caller": caller}
    return {name: round(1000 * v / calls, 2) for name, v in used.items()}


def steps_per_sec(cfg, data: dict, out: Path, steps: int, run_id: str | None, every_step: bool,
                  log_seconds: list[float], services: dict[str, int | None]) -> tuple[float, dict[str, float]]:
    """One training run of `steps` steps, tracked to MLflow run `run_id` (or not; `every_step`: a log_batch per
    logged step); its steps/s between the first and the last logged step, and the cores each of `services` (name:
    pid), the sender thread and the system-metrics thread used during it. Appends the seconds each
    MetricLogger.log call took."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    from astrai_core.training.metric_log import MetricLogger
    from astrai_core.training.train import train

    log, send, every = MetricLogger.log, MetricLogger._send, MetricLogger.send_every
    monitor = SystemMetricsMonitor.monitor
    threads = {"sender": 0.0, "system_metrics": 0.0}

    def timed(self, metrics, step):
        t0 = time.perf_counter()
        log(self, metrics, step)
        log_seconds.append(time.perf_counter() - t0)

    def on_clock(name, f):
        def run(self):
            t0 = time.thread_time()
            try:
                f(self)
            finally:
                threads[name] += time.thread_time() - t0
        return run

    MetricLogger.log, MetricLogger._send = timed, on_clock("sender", send)
    SystemMetricsMonitor.monitor = on_clock("system_metrics", monitor)
    MetricLogger.send_every = 0.0 if every_step else every

    shutil.rmtree(out, ignore_errors=True)
    run_cfg = cfg.model_copy(update=dict(train_data=str(data["train"]), val_data=None, tokenizer=str(data["tokenizer"]),
                                         out_dir=str(out / "model"), max_steps=steps, eval_every=0,
                                         checkpoint_every=0, device="cpu", resume="never"))
    if run_id:
        os.environ["MLFLOW_RUN_ID"] = run_id
    else:
        os.environ.pop("MLFLOW_RUN_ID", None)
    cpu0, t0 = {name: cpu_seconds(pid) for name, pid in services.items()}, time.perf_counter()
    try:
        train(run_cfg)
    finally:
        MetricLogger.log, MetricLogger._send, SystemMetricsMonitor.monitor = log, send, monitor
        MetricLogger.send_every = every
    seconds = time.perf_counter() - t0
    cores = {name: (cpu_seconds(pid) - cpu0[name]) / seconds for name, pid in services.items()}
    cores |= {name: v / seconds for name, v in threads.items()}
    lines = [json.loads(line) for line in (out / "model.logs" / "metrics.jsonl").read_text().splitlines()]
    first, last = lines[0], lines[-1]
    return (last["step"] - first["step"]) / (last["time"] - first["time"]), cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=Path, default=None, help="a directory of running team services "
                        "(astrai services start DIR); default: start them in a temporary directory")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: INTERVALS logging intervals)")
    parser.add_argument("--configs", nargs="+", default=["quick"], choices=["demo", "quick"],
                        help="demo: params.yaml as is (steps ~10x longer: long runs on 2 cores); quick: the profile")
    parser.add_argument("--out", default=str(ROOT / "bench" / "tracking_overhead.json"))
    parser.add_argument("--quick", action="store_true", help="1 repeat of 3 logging intervals, nothing written")
    parser.add_argument("--note", default=None, help="a line on the conditions (other load), kept in the report")
    args = parser.parse_args()
    import mlflow
    import torch

    from astrai import services
    from astrai_core.training.metric_log import SEND_EVERY_S

    torch.set_num_threads(os.cpu_count() or 1)
    report = {"machine": machine(), "method": __doc__.split("What is measured", 1)[1].strip(),
              "command": " ".join(sys.argv), "retries": {k: os.environ[k] for k in env.DEFAULTS
                                                         if k.startswith("MLFLOW_HTTP")},
              "send_every_s": SEND_EVERY_S, "system_metrics_sampling_s": _sampling_interval(), "note": args.note}
    with tempfile.TemporaryDirectory(prefix="astrai-bench-") as tmp:
        tmp = Path(tmp)
        if args.services:
            state = services.load(args.services)
        else:
            (tmp / "services").mkdir(mode=0o755)  # as root, user postgres must reach its directory
            tmp.chmod(0o755)
            t0 = time.time()
            state = services.start(tmp / "services", pg_port=free_port(), mlflow_port=free_port(),
                                   prefect_port=free_port())
            print(f"services up in {time.time() - t0:.0f} s", flush=True)
        try:
            client = mlflow.MlflowClient(state["mlflow_url"])
            os.environ["MLFLOW_TRACKING_URI"] = state["mlflow_url"]
            pg_pid = Path(state["dir"]) / "postgres" / "data" / "postmaster.pid"  # a trial PostgreSQL's
            pids = {"mlflow_server": state["pids"]["mlflow"],
                    "postgres": int(pg_pid.read_text().split()[0]) if pg_pid.is_file() else None}
            exp = client.get_experiment_by_name("tracking-overhead") or None
            exp_id = exp.experiment_id if exp else client.create_experiment("tracking-overhead")
            # one logged step per call (send_every = 0), and the 60 that quick's ~30 steps/s log in SEND_EVERY_S
            report["log_batch_cpu_ms"] = {f"{steps}_steps": log_batch_cpu_ms(client, exp_id, pids, steps, calls)
                                          for steps, calls in ((1, 5 if args.quick else 200),
                                                               (60, 2 if args.quick else 20))}
            print(json.dumps(report["log_batch_cpu_ms"]), flush=True)
            results = []
            for name in args.configs:
                cfg = run_config(None if name == "demo" else name)
                steps = args.steps or cfg.log_every * (3 if args.quick else INTERVALS[name]) + 1
                data = synthetic_data(_fresh(tmp / name), cfg.model.vocab_size)
                sides = ("off", "tracked", "tracked_every_step")
                runs: dict[str, list[float]] = {side: [] for side in sides}
                log_seconds: dict[str, list[float]] = {side: [] for side in sides}
                cores: dict[str, list[dict]] = {side: [] for side in sides}
                for repeat in range(1 if args.quick else args.repeats):
                    for side in sides[repeat % 3:] + sides[:repeat % 3]:  # rotating order
                        run_id = None
                        if side != "off":
                            run_id = client.create_run(exp_id, run_name=f"{name}-{side}-{repeat}").info.run_id
                        rate, used = steps_per_sec(cfg, data, tmp / name / "run", steps, run_id,
                                                   side == "tracked_every_step", log_seconds[side], pids)
                        runs[side].append(rate)
                        cores[side].append(used)
                        if run_id:
                            client.set_terminated(run_id)
                        print(f"{name} {side}: {rate:.3f} steps/s, cores {json.dumps(used)}", flush=True)
                median = {side: statistics.median(v) for side, v in runs.items()}
                row = {"config": name, "dtype": cfg.dtype, "model_dim": cfg.model.dim, "n_layers": cfg.model.n_layers,
                       "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "log_every": cfg.log_every,
                       "steps_per_run": steps}
                for side in sides:
                    row[side] = {"steps_per_sec": round(median[side], 3),
                                 "log_call_ms_median": round(1000 * statistics.median(log_seconds[side]), 2),
                                 "runs": [round(v, 3) for v in runs[side]],
                                 "cores_median": {k: round(statistics.median(c[k] for c in cores[side]), 3)
                                                  for k in cores[side][0]}}
                    if side != "off":
                        ratio = median[side] / median["off"]
                        row[side] |= {"ratio_vs_off": round(ratio, 4), "overhead_pct": round(100 * (1 - ratio), 2),
                                      "within_target": 1 - ratio <= TARGET,
                                      "ratio_per_repeat": [round(a / b, 3) for a, b in zip(runs[side], runs["off"])]}
                print(json.dumps(row), flush=True)
                results.append(row)
        finally:
            if not args.services:
                services.stop(tmp / "services")
    report["results"] = results
    report["target"] = f"tracked steps/s >= {1 - TARGET:.2f} x off"
    report["machine"]["load_average_at_end"] = os.getloadavg()
    if not args.quick:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


def _sampling_interval() -> float:
    """The system metrics' sampling interval in seconds, as SystemMetricsMonitor takes it."""
    import inspect

    from mlflow.environment_variables import MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    default = inspect.signature(SystemMetricsMonitor).parameters["sampling_interval"].default
    return MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() or default


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


if __name__ == "__main__":
    main()
