"""A single-host Slurm cluster for the tests: munged, slurmctld and slurmd with their state in one temp directory.

Needs Debian's `slurm-wlm` and `munge` and root (slurmd runs jobs as their user). The one node is named
`localhost` (slurmd -N), so the first node of every job, where torchrun's c10d rendezvous meets, is a loopback
address. No cgroups: proctrack/linuxproc and task/none. Alone: `python tests/slurm_cluster.py DIR` starts one and
prints its SLURM_CONF; Ctrl-C (or SIGTERM) stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest import free_port, stop_group

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> str | None:
    """Why no test cluster can start here, or None."""
    for tool in (*DAEMONS, "sbatch", "srun", "scancel", "sinfo"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"{tool} not found (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the test Slurm cluster needs root (slurmd runs jobs as their user)"
    return None


def _conf(d: Path, cpus: int, controller: tuple[str, str], nodes: dict[str, str]) -> str:
    ctld_port, slurmd_port = free_port(), free_port()
    node_lines = "\n".join(f"NodeName={name} NodeAddr={addr} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
                            for name, addr in nodes.items())
    return f"""ClusterName=astrai-test
SlurmctldHost={controller[0]}({controller[1]})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
KillWait=5
MinJobAge=600
InactiveLimit=0
{node_lines}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class Cluster:
    """A running test cluster; `env` is what a client (sbatch, srun, squeue) needs to reach it. By default one node,
    `localhost`, and the controller on loopback; `controller` (name, address) and `nodes` (name: address) describe
    others, and a subclass's `wrap` says how each daemon is started where it runs (tests/netns_cluster.py)."""

    def __init__(self, root: Path, cpus: int = 2, controller: tuple[str, str] = ("localhost", "127.0.0.1"),
                 nodes: dict[str, str] | None = None, extra_conf: str = ""):
        self.root = root
        self.nodes = nodes or {"localhost": "127.0.0.1"}
        for sub in ("state", *(f"spool/{node}" for node in self.nodes)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        # munged runs as the munge user, who may not enter `root` (pytest's temp dirs are private to root)
        self.munge = Path(tempfile.mkdtemp(prefix="astrai-munge-"))
        self.conf = root / "slurm.conf"
        self.conf.write_text(_conf(root, cpus, controller, self.nodes) + extra_conf)
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout: float = 30.0) -> "Cluster":
        m = self.munge
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        shutil.chown(m, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        m.chmod(0o700)
        socket_path = m / "munge.socket"
        self.env["MUNGE_SOCKET"] = str(socket_path)  # unused by Slurm (AuthInfo below), kept for `munge -n` by hand
        with self.conf.open("a") as f:
            f.write(f"AuthInfo=socket={socket_path}\n")
        self._spawn("munged", ["runuser", "-u", "munge", "--", "munged", "-F", f"--key-file={key}",
                               f"--socket={socket_path}", f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                               f"--seed-file={m}/seed", "--force"])
        self._wait(lambda: socket_path.exists(), timeout, "munged")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self.start_slurmd(node)
        self._wait(self._idle, timeout, "slurmd (nodes idle)")
        return self

    def start_slurmd(self, node: str) -> None:
        self._spawn("slurmd", ["slurmd", "-D", "-N", node, "-f", str(self.conf)], node)

    def wrap(self, daemon: str, node: str | None) -> list[str]:
        """The command prefix that runs `daemon` where it belongs (node: the slurmd's node); here, this host."""
        return []

    def _spawn(self, daemon: str, cmd: list[str], node: str | None = None) -> None:
        log = open(self.root / f"{daemon}{'-' + node if node else ''}.out", "ab")
        self.procs.append(subprocess.Popen([*self.wrap(daemon, node), *cmd], env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def _idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True)
        states = out.stdout.split()
        return out.returncode == 0 and len(states) == len(self.nodes) and set(states) == {"idle"}

    def _wait(self, ready, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not ready():
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > end:
                logs = "\n".join(f"{p.name}: {p.read_text()[-2000:]}" for p in
                                  sorted([*self.root.glob("*.log"), *self.root.glob("*.out"), *self.munge.glob("*.log")]))
                self.stop()
                raise RuntimeError(f"test Slurm cluster: {what} not ready ({'exited: ' + str(dead) if dead else 'timeout'})"
                                   f"\n{logs}")
            time.sleep(0.3)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True)
        for p in reversed(self.procs):  # slurmd, slurmctld, munged
            stop_group(p, timeout=15)
        self.procs.clear()
        shutil.rmtree(self.munge, ignore_errors=True)


if __name__ == "__main__":
    cluster = Cluster(Path(sys.argv[1]).resolve()).start()
    print(f"export SLURM_CONF={cluster.conf}", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops it too, as Ctrl-C does
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
