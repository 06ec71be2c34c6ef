"""The training core's only link to MLflow, used by rank 0; every other rank gets a logger that does nothing.

The run belongs to whoever launched training (the Prefect task, the CLI): it starts the run and passes
MLFLOW_RUN_ID (and MLFLOW_TRACKING_URI, which MLflow reads itself) through the environment. This module only
logs into that run and never starts or ends one. Without MLFLOW_RUN_ID, metrics go to metrics.jsonl only.

The metrics reach MLflow from a thread of their own, not from the training step: an HTTP call to a tracking server
(and its retries while the server's database restarts) would otherwise stall every rank at the next collective.
That thread sends what was logged in one log_batch at most every SEND_EVERY_S seconds: one request per logged step
made the server and its database (a commit each) take CPU the training needed when they share its cores.
bench/tracking_overhead.py measures both.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

MAX_PARAM_CHARS = 500  # MLflow's limit on a param value
PARAMS_PER_BATCH = 100  # MLflow's limit on params per log_batch call
METRICS_PER_BATCH = 1000  # MLflow's limit on metrics per log_batch call
SEND_EVERY_S = 10.0  # the sender's log_batch calls are at least this far apart (what a run shows lags by at most this)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}"""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def mlflow_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys and MLflow-sized string values (log the full config as an artifact as well)."""
    return {k: str(v)[:MAX_PARAM_CHARS] for k, v in flatten(tree, prefix).items()}


class MetricLogger:
    """Append metrics to `out_dir`/metrics.jsonl and, if MLFLOW_RUN_ID is set, to that MLflow run.

    `enabled=False` (non-zero ranks) turns every method into a no-op, so the training loop calls it unconditionally.
    The file is truncated when the logger is created (one file per training run), except that a run resumed
    at step `resume_step` keeps the lines up to that step and appends after them. The file is written in the
    call; MLflow gets the metrics from a sender thread, in order: the first logged step at once,
    then everything logged since the last send every `send_every` seconds. `flush` sends the rest and waits for it.
    A send that fails (after the MLflow client's retries, astrai_core/runtime/env.defaults) is raised by the next `log`
    or `flush`, so the run fails as if it had failed in the step.
    """

    send_every = SEND_EVERY_S  # 0: a log_batch per logged step, as before (bench/tracking_overhead.py compares)

    def __init__(self, out_dir: str | os.PathLike, enabled: bool = True, resume_step: int | None = None) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.run_id = os.environ.get("MLFLOW_RUN_ID") or None
        self._client = None
        self._queue: queue.Queue[list | None] = queue.Queue()
        self._sender: threading.Thread | None = None
        self._failed: BaseException | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = ""
            if resume_step is not None and self.path.is_file():
                lines = self.path.read_text().splitlines(keepends=True)
                kept = "".join(line for line in lines if line.endswith("\n") and json.loads(line)["step"] <= resume_step)
            self.path.write_text(kept)

    @property
    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient  # imported lazily: ~1 s, and only when a run is attached

            # the run's store as the environment names it, whatever this process's mlflow module was pointed at
            self._client = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI"))
        return self._client

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self.enabled:
            return
        now_ms = int(time.time() * 1000)
        with self.path.open("a") as f:  # open per call: every line is on disk even if the run is killed
            f.write(json.dumps({"step": step, "time": now_ms / 1000, **metrics}) + "\n")
        if self.run_id:
            from mlflow.entities import Metric

            batch = [Metric(key=k, value=float(v), timestamp=now_ms, step=step) for k, v in metrics.items()]
            self._raise_failed()
            if self._sender is None:
                self._sender = threading.Thread(target=self._send, name="mlflow-metrics", daemon=True)
                self._sender.start()
            self._queue.put(batch)

    def _send(self) -> None:
        """The sender thread: what was logged since its last log_batch (in calls of up to MLflow's limit), once
        `send_every` seconds have passed since that call, and the rest at the None that `flush` queues."""
        pending: list = []
        due = time.monotonic()
        while True:
            try:  # wait for a logged step, or, with one pending, until it is due
                item = self._queue.get(timeout=max(0.0, due - time.monotonic()) if pending else None)
            except queue.Empty:
                item = []
            if item is not None:
                pending += item
                if time.monotonic() < due:
                    continue
            try:
                for i in range(0, len(pending), METRICS_PER_BATCH):
                    self.client.log_batch(self.run_id, metrics=pending[i : i + METRICS_PER_BATCH])
            except BaseException as e:  # noqa: BLE001 - raised in the training thread by the next log or flush
                self._failed = e
                return
            if item is None:
                return
            pending, due = [], time.monotonic() + self.send_every

    def _raise_failed(self) -> None:
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    def flush(self) -> None:
        """Wait until every logged metric is in MLflow; raise a send that failed."""
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join()
            self._sender = None
        self._raise_failed()

    def log_params(self, params: Mapping[str, Any]) -> None:
        if not self.enabled or not self.run_id:
            return
        from mlflow.entities import Param

        flat = [Param(k, v) for k, v in mlflow_params(params).items()]
        for i in range(0, len(flat), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=flat[i : i + PARAMS_PER_BATCH])

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if not self.enabled or not self.run_id:
            return
        self.client.log_artifact(self.run_id, str(path), artifact_path)


@contextlib.contextmanager
def system_metrics(local_rank: int) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory, disk, network; GPU with nvidia-ml-py where there is one) into the run
    MLFLOW_RUN_ID names, sampled every 10 s (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL) by local rank 0 of each node:
    `system/cpu_utilization_percentage` on one node, `system/node_<N>/...` per node (torchrun's GROUP_RANK) on
    several. Every other rank, and a run without MLFLOW_RUN_ID, logs none."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if local_rank != 0 or not run_id:
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop lines are noise in a log
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    monitor = SystemMetricsMonitor(run_id, node_id=f"node_{os.environ.get('GROUP_RANK', '0')}" if nodes > 1 else None)
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()
        # MLflow's loop drops the sample it is taking when it is stopped: a run shorter than the interval (a quick
        # profile's stage lasts seconds) logged none. One more sample at the end, as the next step.
        with contextlib.suppress(Exception):  # a tracking server gone by now: the run's own end says so
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
