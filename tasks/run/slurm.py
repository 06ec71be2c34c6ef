"""The Slurm launcher (`cluster.launcher: slurm`): a training stage as one sbatch job.

The stage writes its train config and a batch script to the shared directory and submits it; in the job, `srun`
starts one torchrun agent per node (`--nnodes` = nodes, `--node-rank` = the task's SLURM_PROCID, c10d rendezvous
on the job's first node), the ranks train as they do locally and rank 0 writes the checkpoints and outputs under
the project directory (on shared storage). The job's output is streamed into the stage's log, Slurm job id first;
the first error line a rank printed is the stage's error. Ctrl-C, a Prefect cancellation (SIGTERM) or any
failure while waiting cancels the job (scancel) and waits until it has left the nodes. `--signal` sends SIGTERM
`signal_seconds` before the time limit (and Slurm sends it on preemption): the ranks checkpoint and the next run
of the stage resumes from there (`resume: auto`). A node lost mid-job fails the stage within about
`cluster.peer_timeout` + 2 x `cluster.kill_wait` seconds (docs/scaling-out.md, "When a node is lost").

Slurm's accounting (sacct) is not needed: the job's state comes from `scontrol show job`, which keeps a finished
job for MinJobAge seconds (300 by default).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from astrai_core.runtime.errors import TrainingError
from astrai_core.runtime.io import write_json
from astrai_core.training.config import TrainConfig
from astrai_core.training.distributed import ERROR_FILE, rank_error
from tasks.run.schema import ClusterParams

POLL_SECONDS = 1.0
# Job states after which nothing of the job runs any more (squeue/scontrol JobState).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}


def batch_script(cfg: TrainConfig, cluster: ClusterParams, nproc: int, max_restarts: int, config_path: Path,
                 log_path: Path, root: Path) -> str:
    """The sbatch script of one stage: its #SBATCH options, then srun starting one torchrun agent per task."""
    stage = Path(cfg.out_dir).name
    options = [f"--job-name=astrai-{stage}", f"--nodes={cluster.nodes}", f"--ntasks={cluster.nodes}",
               f"--cpus-per-task={cluster.cpus_per_task}", f"--output={log_path}", f"--chdir={root}",
               f"--signal=TERM@{cluster.signal_seconds}"]
    options += [f"--gpus-per-node={cluster.gpus_per_node}"] if cluster.gpus_per_node else []
    options += [f"--{key}={getattr(cluster, key)}" for key in ("partition", "account", "time") if getattr(cluster, key)]
    options += cluster.sbatch  # last: they override the ones above
    agent = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={cluster.nodes}",
             f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-id=$SLURM_JOB_ID",
             "--rdzv-endpoint=$ASTRAI_RDZV",
             f"--rdzv-conf=is_host=$((SLURM_PROCID == 0)),join_timeout={cluster.peer_timeout}", "--local-addr=$addr",
             "--node-rank=$SLURM_PROCID",
             f"--max-restarts={max_restarts}", "-m", "astrai_core.training.train", "--config", str(config_path)]
    # On each node: its own address, and gloo on the interface that carries it (a GLOO_SOCKET_IFNAME set by the
    # user wins). The first node's agent hosts the rendezvous store (is_host: torch would decide by comparing the
    # endpoint with what the host name resolves to).
    interface = """$(ip -o -4 addr show to "$addr" | awk '{print $2; exit}')"""
    # When the first node is lost, the agents of the others lose the rendezvous store it hosted and stop their
    # ranks before any rank can report it; the job's log, written through srun on that node, gets nothing more.
    # So when an agent fails on another node and the store no longer answers, the node says so in the error file.
    # The shell stays (no exec) to say it; `trap :` keeps a signal to the step (Slurm signals every process of
    # it: --signal, scancel) from ending the shell before the agent and its ranks have checkpointed and exited.
    store = '"exec 3<>/dev/tcp/${ASTRAI_RDZV%:*}/${ASTRAI_RDZV##*:}"'
    # The file first: with srun on the first node gone, the step's output pipe may be closed, and a write to it
    # kills the writer (SIGPIPE): `... | tee -a FILE >&2` dies on its stdout before it writes FILE.
    lost_first = (f'[ "$SLURM_PROCID" -gt 0 ] && ! timeout 5 bash -c {store} 2>/dev/null && '
                  '{ line="error: node $SLURMD_NODENAME (node rank $SLURM_PROCID) lost node $ASTRAI_RDZV_NODE '
                  '(node rank 0): the rendezvous at $ASTRAI_RDZV no longer answers"; '
                  'echo "$line" >> "$ASTRAI_ERROR_FILE"; echo "$line" >&2; }')
    on_node = ['addr=$(node_addr "$SLURMD_NODENAME")',
               f"export GLOO_SOCKET_IFNAME=${{GLOO_SOCKET_IFNAME:-{interface}}}",
               'echo "astrai: node $SLURMD_NODENAME (rank $SLURM_PROCID) at $addr, gloo on $GLOO_SOCKET_IFNAME"',
               "trap : TERM", " ".join(agent), "rc=$?", f"[ $rc -eq 0 ] || {{ {lost_first}; }}", "exit $rc"]
    # ranks share the task's cores (torchrun alone would give each rank one thread)
    threads = max(1, cluster.cpus_per_task // nproc)
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {shlex.quote(o)}" for o in options),
        "set -euo pipefail",
        "# A node's address: the one Slurm reaches it at (NodeAddr; else its name), not what its host name resolves",
        "# to (often a loopback line in /etc/hosts); torchrun advertises it to the other nodes.",
        "node_addr() { getent ahostsv4 \"$(scontrol show node -o \"$1\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')\" |"
        " awk '{print $1; exit}'; }",
        "export -f node_addr",
        "# c10d rendezvous on the job's first node, on a port that differs between jobs",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'export ASTRAI_RDZV=$(node_addr "$head"):$((20000 + SLURM_JOB_ID % 20000)) ASTRAI_RDZV_NODE=$head',
        'echo "astrai: rendezvous at $ASTRAI_RDZV"',
        f"export OMP_NUM_THREADS={threads} PYTHONUNBUFFERED=1",
        "# each failing rank also appends its error line here, on the shared directory",
        "# (astrai_core.training.distributed)",
        f"export {ERROR_FILE}=" + '"$SLURM_JOB_ID"'.join(map(shlex.quote, str(errors_path(log_path)).split("%j"))),
        f"export PYTHONPATH={shlex.quote(str(Path(__file__).resolve().parents[2]))}${{PYTHONPATH:+:$PYTHONPATH}}",
        # one task per node: SLURM_PROCID is the node's rank; the agent's arguments are expanded on its node
        f"srun --kill-on-bad-exit=1 bash -c {shlex.quote('; '.join(on_node))}",
        "",
    ])


def job_state(job_id: str) -> tuple[str, str]:
    """(JobState, ExitCode) of a job as scontrol reports it; ("GONE", "") once Slurm has forgotten it."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return fields.get("JobState", "GONE"), fields.get("ExitCode", "")


def cancel(job_id: str, on_line: Callable[[str], None], timeout: float = 120.0) -> None:
    """scancel the job and wait until it has ended: no process of it is left on any node."""
    subprocess.run(["scancel", job_id], capture_output=True)
    on_line(f"Slurm job {job_id}: cancelled")
    end = time.monotonic() + timeout
    while job_state(job_id)[0] not in ENDED | {"GONE"} and time.monotonic() < end:
        time.sleep(POLL_SECONDS)


def errors_path(log_path: Path) -> Path:
    """Where the job's ranks append their error lines: beside the job's log (same %j pattern)."""
    return log_path.with_suffix(".errors")


def follow(log_path: Path, offset: int, on_line: Callable[[str], None]) -> int:
    """Pass the job log's complete new lines to on_line; returns the offset read up to."""
    if not log_path.exists():
        return offset
    with log_path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    done = data.rfind(b"\n") + 1
    for line in data[:done].decode(errors="replace").splitlines():
        on_line(line)
    return offset + done


def launch_slurm(cfg: TrainConfig, cluster: ClusterParams, nproc: int, max_restarts: int, root: Path, *,
                 run_id: str | None = None, on_line: Callable[[str], None] = print) -> dict:
    """Run the training core as one Slurm job with `cfg`; returns the summary rank 0 wrote to cfg.out_dir, like
    astrai_core.training.distributed.launch. A failure raises TrainingError with the failing rank's one-line error."""
    stage = Path(cfg.out_dir).name
    shared = cluster.shared_path(root)
    shared.mkdir(parents=True, exist_ok=True)
    config_path, script = shared / f"{stage}.train_config.json", shared / f"{stage}.sbatch"
    cfg = cfg.model_copy(update={"peer_timeout": cluster.peer_timeout})
    write_json(config_path, cfg.model_dump(mode="json"))
    log_pattern = shared / f"{stage}-%j.out"
    script.write_text(batch_script(cfg, cluster, nproc, max_restarts, config_path, log_pattern, root))
    env = {**os.environ, **({"MLFLOW_RUN_ID": run_id} if run_id else {})}  # sbatch exports it to the job
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True)
    if submitted.returncode != 0:
        raise TrainingError(f"sbatch refused {script}: {submitted.stderr.strip() or submitted.stdout.strip()}")
    job_id = submitted.stdout.strip().split(";")[0]
    log_path = Path(str(log_pattern).replace("%j", job_id))
    on_line(f"{stage}: Slurm job {job_id}, {cluster.nodes} node(s) x {nproc} process(es), strategy {cfg.strategy}, "
            f"log {log_path}")
    errors: list[str] = []

    def collect(line: str) -> None:  # from the log, and from the error file: the log may never get a rank's line
        if (error := rank_error(line)) is not None:  # (its node lost: ERROR_FILE)
            errors.append(error)

    def watch(line: str) -> None:
        collect(line)
        on_line(line)

    # A Prefect cancellation or `kill` sends SIGTERM: raise so that the job is cancelled below.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    error_file = errors_path(log_path)
    offset, error_offset, state, code, failed_at = 0, 0, "PENDING", "", None
    try:
        while state not in ENDED | {"GONE"}:
            time.sleep(POLL_SECONDS)
            state, code = job_state(job_id)
            offset = follow(log_path, offset, watch)
            error_offset = follow(error_file, error_offset, collect)
            failed_at = failed_at or (time.monotonic() if errors else None)
            if failed_at and time.monotonic() - failed_at > cluster.kill_wait:  # a node that no longer answers
                cancel(job_id, on_line, timeout=cluster.kill_wait)
                break
        time.sleep(POLL_SECONDS)  # the last lines reach the (shared) log after the state changes
        follow(log_path, offset, watch)
        follow(error_file, error_offset, collect)
    except BaseException:
        cancel(job_id, on_line)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if state != "COMPLETED":
        raise TrainingError(errors[0] if errors else f"Slurm job {job_id} ended {state} (exit {code}); see {log_path}")
    config_path.unlink(missing_ok=True)
    shutil.rmtree(cfg.checkpoints, ignore_errors=True)  # they only serve to resume an unfinished run
    return json.loads((Path(cfg.out_dir) / "summary.json").read_text())
