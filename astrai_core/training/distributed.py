"""Distributed setup in one place: the rank's view (init_distributed/cleanup; the Dist it returns and the device
helpers are astrai_core/runtime/device.py) and the launcher (run_torchrun).

Inside a rank, torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) says who we are; without
torchrun the same code runs as a single process with world_size 1 and no process group.
The launcher starts torchrun in its own process group so that a failure, Ctrl-C or a Prefect cancellation in
the caller kills every rank, never leaving orphans holding cores.

Multi-node is configuration, not code: run `python -m torch.distributed.run --nnodes=N --node_rank=i
--rdzv_backend=c10d --rdzv_endpoint=HOST:PORT --rdzv_id=RUN --nproc_per_node=G -m astrai_core.training.train
--config cfg.json --resume auto` on each node (checkpoint_dir on a filesystem every node can read: each rank
loads the checkpoint it resumes from; only global rank 0 writes).
"""

from __future__ import annotations

import ctypes
import datetime
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal, Mapping

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.rendezvous import rendezvous

from astrai_core.runtime.device import Dist, resolve_device
from astrai_core.runtime.errors import TrainingError
from astrai_core.runtime.io import write_json
from astrai_core.runtime.proc import stream_process
from astrai_core.training import PARENT_AT_START

if TYPE_CHECKING:
    from astrai_core.training.config import TrainConfig

# A rank's error line: train.main reports every error that ends a rank as one line starting with this.
ERROR_PREFIX = "error: "
_ERROR_LINE = re.compile(r"^(\[[^\]]*\]:)?error: ")  # torchrun may prefix a rank's lines with "[rank]:"
# ...and appends it to the file this names, when set. The Slurm launcher sets it: a line a rank prints reaches the
# job's log through srun on the job's first node, and when that node is the one lost, it never arrives.
ERROR_FILE = "ASTRAI_ERROR_FILE"


def report_error(message: str) -> None:
    """A rank's last word: its error line on stderr (and in ERROR_FILE)."""
    line = f"{ERROR_PREFIX}{message}"
    if path := os.environ.get(ERROR_FILE):
        try:
            with open(path, "a") as f:  # one short append per failing rank: its lines do not interleave
                f.write(line + "\n")
        except OSError as e:
            print(f"could not append the error line to {path}: {e}", file=sys.stderr, flush=True)
    print(line, file=sys.stderr, flush=True)  # last: the launcher reports a failed rank's last line


def rank_error(line: str) -> str | None:
    """The error a rank printed on this output line (the stage's error when the rank fails), else None."""
    return line.split(ERROR_PREFIX, 1)[1] if _ERROR_LINE.match(line) else None


def die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so SIGKILL of the launcher's process group (a stage
    killed, a job cancelled) would leave the ranks training and writing outputs: on Linux, ask the kernel to
    SIGKILL this rank when the torchrun agent that started it dies. An agent that died before the request (killed
    while this rank imported torch) is never reported: then this rank ends itself, as the kernel would have."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    pr_set_pdeathsig = 1  # from <sys/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != PARENT_AT_START:  # adopted: the agent is gone
        os.kill(os.getpid(), signal.SIGKILL)


def init_distributed(backend: str = "auto", device: str = "auto", timeout: float | None = None) -> Dist:
    """Join the process group torchrun set up (if any) and pick this rank's device; `timeout`: seconds a
    collective waits for the other ranks (None: torch's default)."""
    die_with_launcher()
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch_device = resolve_device(device)
    if torch_device.type == "cuda":
        torch_device = torch.device("cuda", local_rank)
        torch.cuda.set_device(torch_device)
    if backend == "auto":
        backend = "nccl" if torch_device.type == "cuda" else "gloo"
    if world_size > 1 and not dist.is_initialized():
        # torchrun's store outlives a restart of the group (--max-restarts), and so do the old group's keys: a new
        # rank could read its dead peer's gloo address and fail ("connectFullMesh ... Connection refused") or
        # hang. Each restart therefore keeps its keys under a prefix of its own.
        store = dist.PrefixStore(f"restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                                 _group_store(rank, world_size))
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                timeout=None if timeout is None else datetime.timedelta(seconds=timeout),
                                device_id=torch_device if torch_device.type == "cuda" else None)
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=torch_device)


def lost_peers(e: BaseException) -> str | None:
    """When `e` is a collective's failure (a peer's connection closed, a timeout waiting on it): who this rank lost,
    to lead its error line ("rank 0 on NODE lost rank 1"; with more ranks, every other one: gloo does not say
    which, though a closed connection's message names the peer's address)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if not isinstance(e, dist.DistError) and "/gloo/" not in str(e):
        return None
    me = dist.get_rank()
    others = [str(r) for r in range(dist.get_world_size()) if r != me]
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return f"rank {me} on {node} lost rank{'s' if len(others) > 1 else ''} {', '.join(others)}"


def _group_store(rank: int, world_size: int) -> dist.Store:
    """The store the ranks meet in. torch's env:// rendezvous has rank 0 host a TCPStore (when the torchrun agent
    hosts none), and a TCPStore listens on every interface whatever MASTER_ADDR says; when MASTER_ADDR is a loopback
    address (run_torchrun's single-node launch) rank 0 hosts it on that address alone, through a socket bound there."""
    addr = os.environ.get("MASTER_ADDR", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not _is_loopback(addr):
        return next(rendezvous("env://", rank, world_size))[0]
    port = int(os.environ["MASTER_PORT"])
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        listen_fd = socket.create_server((addr, port), family=family).detach()  # the store owns the socket now
    return dist.TCPStore(addr, port, world_size, rank == 0, timeout=default_pg_timeout, multi_tenant=True,
                         master_listen_fd=listen_fd)


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name: left to torch
        return False


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_nproc(nproc: int | Literal["auto"], device: str = "auto") -> int:
    """auto: one rank per GPU, else one per CPU core."""
    if nproc != "auto":
        return int(nproc)
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def run_torchrun(
    config_path: str | os.PathLike,
    nproc: int,
    *,
    env: Mapping[str, str] | None = None,
    on_line: Callable[[str], None] = print,
    max_restarts: int = 0,
) -> None:
    """Run `astrai_core.training.train --config config_path` on `nproc` local ranks; stream every output
    line to on_line.

    `env` entries are added to this process's environment. With max_restarts > 0 torchrun restarts the whole
    group when a rank dies (the config's `resume: auto` makes the new group continue from the last checkpoint).
    Raises TrainingError (the first error line a rank printed) if any rank fails for good; on any exception while
    waiting (including KeyboardInterrupt) the whole process group is killed.
    """
    # One node, so nothing needs to listen beyond this host. --standalone would have the agent host two TCPStores
    # on every interface (torch gives them no bind address): here the agent's rendezvous meets in a file, the agent
    # hosts no store for the ranks (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), rank 0 hosts it on MASTER_ADDR = 127.0.0.1
    # alone (_group_store), and gloo binds the loopback interface.
    rdzv_dir = tempfile.mkdtemp(prefix="astrai-rdzv-")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_dir}/store", "--rdzv-conf=store_type=file",
        f"--rdzv-id={uuid.uuid4().hex}", "--local-addr=127.0.0.1",
        f"--max-restarts={max_restarts}", "-m", "astrai_core.training.train", "--config", str(config_path),
    ]
    child_env = {**os.environ, **(env or {}), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if sys.platform.startswith("linux"):
        child_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # torchrun would set 1 thread per rank; share the cores instead (2 ranks on 8 cores: 4 threads each).
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    child_env.setdefault("PYTHONUNBUFFERED", "1")  # progress lines arrive as they are printed
    # The ranks must import this very package, installed or not.
    root = str(Path(__file__).resolve().parents[1])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)

    errors: list[str] = []

    def watch(line: str) -> None:
        if (error := rank_error(line)) is not None:
            errors.append(error)
        on_line(line)

    try:
        stream_process(cmd, env=child_env, on_line=watch, what=f"torchrun ({nproc} ranks)")
    except RuntimeError as e:
        # torchrun's failure report fills the tail; the first error a rank printed says what actually went wrong.
        raise TrainingError(errors[0] if errors else str(e).splitlines()[0]) from None
    finally:
        shutil.rmtree(rdzv_dir, ignore_errors=True)


def launch(cfg: TrainConfig, nproc: int, max_restarts: int = 0, *, run_id: str | None = None,
           on_line: Callable[[str], None] = print) -> dict:
    """Run the training core under torchrun with `cfg` (every training stage and `astrai train` do); returns the
    summary of the checkpoint it wrote to cfg.out_dir. Metrics go to MLflow run `run_id` (rank 0 only). A failure
    raises TrainingError with the failing rank's one-line error."""
    out_dir = Path(cfg.out_dir)
    config_path = out_dir.parent / f"{out_dir.name}.train_config.json"
    write_json(config_path, cfg.model_dump(mode="json"))
    env = {"MLFLOW_RUN_ID": run_id} if run_id else {}
    on_line(f"{out_dir.name}: torchrun with {nproc} process(es), strategy {cfg.strategy}, config {config_path}")
    new = [Path(p) for p in (cfg.checkpoints, cfg.logs) if not Path(p).exists()]
    try:
        run_torchrun(config_path, nproc, env=env, on_line=on_line, max_restarts=max_restarts)
    except BaseException:
        for path in new:  # a failed run leaves what it wrote (steps logged, checkpoints), not empty folders
            if path.is_dir() and not any(f.stat().st_size for f in path.rglob("*") if f.is_file()):
                shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        config_path.unlink(missing_ok=True)
    shutil.rmtree(cfg.checkpoints, ignore_errors=True)  # they only serve to resume an unfinished run
    return json.loads((out_dir / "summary.json").read_text())
