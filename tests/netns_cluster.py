"""A three-machine test cluster out of Linux network namespaces, on one host (docs/scaling-out.md, "The test cluster").

    root namespace: bridge astb<PID>, 10.99.N.1 (the test reaches the cluster through it)
      |-- veth -- namespace astrai<PID>-login  10.99.N.10  munged, slurmctld, PostgreSQL, MLflow, Prefect + worker
      |-- veth -- namespace astrai<PID>-n1     10.99.N.11  slurmd -N astrai<PID>-n1
      `-- veth -- namespace astrai<PID>-n2     10.99.N.12  slurmd -N astrai<PID>-n2

The host's filesystem is the cluster's shared storage (the project, the job scripts and logs, munge's socket, which
a path names and so every namespace reaches). Names resolve through /etc/hosts lines this module adds, each marked
with MARK and the run's tag, and removes. Only slurmctld gets a host name of its own (unshare --uts: it must be
the SlurmctldHost it reads in slurm.conf); the compute namespaces keep the host's name, which resolves to loopback
here, as a real node's name may resolve to an address the other nodes cannot reach: the Slurm launcher must use
each node's NodeAddr, not its host name, for torchrun and gloo (tasks/run/slurm.py).

Every name carries the pid of the process that built it (astrai<PID>): whatever an earlier run left (its process
gone) is removed before a new cluster starts; a cluster of a live process is left alone and the new one refuses to
start. `stop` removes everything, daemons, namespaces, links and hosts lines, and is safe to call twice.

Alone: `python tests/netns_cluster.py DIR` builds one, prints its settings, and removes it on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import slurm_cluster

MARK = "# astrai-netns-cluster"
HOSTS = Path("/etc/hosts")
NAME = re.compile(r"^astrai(\d+)-(login|n1|n2)$")  # namespaces
LINK = re.compile(r"^ast[bv](\d+)")  # the bridge astb<PID>, the veths astv<PID><i>
NODES = ("n1", "n2")
VENV_BIN = Path(sys.executable).parent


def missing() -> str | None:
    """Why no namespace cluster can be built here, or None."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (ip netns, veth, a bridge)"
    for tool in ("ip", "nsenter", "unshare", "runuser"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install iproute2 util-linux)"
    if (why := slurm_cluster.missing()) is not None:
        return why
    from astrai.services import PG_BIN

    if not (PG_BIN / "initdb").exists():
        return f"no PostgreSQL in {PG_BIN} (apt-get install postgresql-15)"
    if (why := clean_stale()) is not None:
        return why
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    return [m.group(1).split("@")[0] for m in re.finditer(r"^\d+: (\S+?):", _ip("-o", "link").stdout, re.M)]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in `ns` and wait (10 s at most) until none is left."""
    for _ in range(100):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


# Each compute node's slurmd and everything it starts run in a freezer cgroup (v1) of their own, so that a node can
# die at once (NetnsCluster.kill). Killed one by one, the processes still running reacted to the others' deaths:
# srun on the first node, seeing its task killed, had Slurm kill the job's tasks on the other node (--kill-on-bad-
# exit) before they could report the lost node, then died itself, and nothing ended the job until Slurm found the
# node not responding (300 s: the CI failure of stop 55, seen in slurmd's debug2 log; stopping them one by one with
# SIGSTOP first was not enough either: srun logged "got SIGCONT", "forcing job termination").
FREEZER = Path("/sys/fs/cgroup/freezer")


def _freeze_and_kill(cgroup: Path) -> None:
    """Freeze every process of `cgroup`, SIGKILL them all, then thaw: each dies before it runs again."""
    (cgroup / "freezer.state").write_text("FROZEN")
    end = time.monotonic() + 10
    while (cgroup / "freezer.state").read_text().strip() != "FROZEN" and time.monotonic() < end:
        time.sleep(0.01)
    for pid in (cgroup / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    (cgroup / "freezer.state").write_text("THAWED")


def _remove(tag: str) -> None:
    """Everything of the cluster tagged `tag`: its namespaces' processes, the namespaces, its freezer cgroups, its
    links, hosts lines."""
    for ns in _namespaces():
        if ns.startswith(f"{tag}-"):
            _kill_namespace(ns)
            _ip("netns", "del", ns, check=False)
    for cgroup in FREEZER.glob(f"{tag}-*") if FREEZER.is_dir() else ():
        _freeze_and_kill(cgroup)  # whatever is left (a run stopped mid-test), and thawed: then it can go
        for _ in range(100):
            try:
                cgroup.rmdir()
                break
            except OSError:  # its last processes not yet reaped
                time.sleep(0.1)
    number = tag.removeprefix("astrai")
    for link in _links():
        if (m := LINK.match(link)) and m.group(1) == number:
            _ip("link", "del", link, check=False)
    lines = HOSTS.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.rstrip().endswith(f"{MARK} {tag}")]
    if kept != lines:
        with HOSTS.open("r+") as f:  # in place: /etc/hosts may be a bind mount, which a rename would not update
            f.write("".join(kept))
            f.truncate()


def clean_stale() -> str | None:
    """Remove what clusters of processes that are gone left behind; the reason a new cluster cannot start (a live
    one's or something left that would not go), or None."""
    pids = {int(m.group(1)) for ns in _namespaces() if (m := NAME.match(ns))}
    pids |= {int(m.group(1)) for link in _links() if (m := LINK.match(link))}
    pids |= {int(m.group(1)) for m in re.finditer(rf"{MARK} astrai(\d+)$", HOSTS.read_text(), re.M)}
    for pid in sorted(pids):
        if pid == os.getpid() or _alive(pid):
            return f"a namespace cluster of process {pid} is up (astrai{pid}-*); one at a time"
        _remove(f"astrai{pid}")
    left = [n for n in _namespaces() if NAME.match(n)] + [link for link in _links() if LINK.match(link)]
    if left or MARK in HOSTS.read_text():
        return f"could not remove an earlier test cluster's {left or 'lines in ' + str(HOSTS)}"
    return None


def _free_subnet() -> str:
    """10.99.N, the first N with no address of this host in 10.99.N.0/24."""
    used = _ip("-o", "-4", "addr").stdout
    return next(f"10.99.{n}" for n in range(256) if f" 10.99.{n}." not in used)


class NetnsCluster(slurm_cluster.Cluster):
    """The namespaces, the Slurm daemons in them and the team services in the login namespace; `env` reaches
    Slurm (SLURM_CONF) and the services (MLFLOW_TRACKING_URI, PREFECT_API_URL) from any namespace."""

    def __init__(self, root: Path, cpus: int = 1, extra_conf: str = ""):
        self.tag = f"astrai{os.getpid()}"
        net = _free_subnet()
        self.bridge = (f"astb{os.getpid()}", f"{net}.1")
        self.ns = {role: f"{self.tag}-{role}" for role in ("login", *NODES)}
        self.addr = {self.ns["login"]: f"{net}.10", **{self.ns[n]: f"{net}.{11 + i}" for i, n in enumerate(NODES)}}
        self.services_dir = Path(tempfile.mkdtemp(prefix="astrai-team-"))  # user postgres must reach it
        self.services_dir.chmod(0o755)
        self.services: dict = {}
        super().__init__(root, cpus, (self.ns["login"], self.addr[self.ns["login"]]),
                         {self.ns[n]: self.addr[self.ns[n]] for n in NODES}, extra_conf)

    def enter(self, role: str) -> list[str]:
        """The command prefix that runs a command in the network namespace of `role` (login, n1, n2). nsenter, not
        `ip netns exec`: that mounts a /sys of its own, without the cgroup filesystem slurmd looks for."""
        return ["nsenter", f"--net=/run/netns/{self.ns[role]}"]

    def wrap(self, daemon: str, node: str | None) -> list[str]:
        role = next(r for r, ns in self.ns.items() if ns == node) if node else "login"
        if daemon == "slurmctld":  # slurmctld runs only where its host name is the SlurmctldHost's
            return [*self.enter(role), "unshare", "--uts", "--", "sh", "-c", f'hostname {self.ns[role]} && exec "$@"',
                    "sh"]
        if daemon == "slurmd" and FREEZER.is_dir():  # the node's processes in its freezer cgroup (kill)
            cgroup = self._cgroup(role)
            cgroup.mkdir(exist_ok=True)
            return [*self.enter(role), "sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"]
        return self.enter(role)

    def run(self, role: str, cmd: list, **kw) -> subprocess.CompletedProcess:
        """subprocess.run of `cmd` in the namespace of `role`, with the cluster's env."""
        return subprocess.run([*self.enter(role), *map(str, cmd)], **{"env": self.env, **kw})

    def start(self, timeout: float = 60.0) -> "NetnsCluster":
        try:
            self._network()
            super().start(timeout)
            self._services()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        bridge, gateway = self.bridge
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{gateway}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, ns in enumerate(self.ns.values()):
            outside, inside = f"astv{os.getpid()}{i}", f"astv{os.getpid()}{i}p"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            for args in (("addr", "add", f"{self.addr[ns]}/24", "dev", inside), ("link", "set", inside, "up"),
                         ("link", "set", "lo", "up")):
                _ip("-n", ns, *args)
        with HOSTS.open("a") as f:
            f.writelines(f"{addr} {ns} {MARK} {self.tag}\n" for ns, addr in self.addr.items())

    def kill(self, role: str) -> None:
        """Every process in `role`'s namespace (its slurmd and whatever runs there) dies at once: the machine dies.
        Frozen first where the freezer cgroup exists (FREEZER); else killed one by one."""
        if (cgroup := self._cgroup(role)).is_dir():
            _freeze_and_kill(cgroup)
        _kill_namespace(self.ns[role])

    def _cgroup(self, role: str) -> Path:
        return FREEZER / self.ns[role]

    def heal(self, timeout: float = 300.0) -> None:
        """Whatever a test did to the nodes, undone: no job left, every link up, a slurmd in every compute namespace
        and every node idle (a node Slurm set DOWN while it was lost is resumed). Raises (and stops the cluster)
        when that does not happen within `timeout`, so that the tests after it fail at once instead of waiting on
        a job that can never start. Slurm resends a lost node's TERMINATE_JOB once a minute and sees it respond
        on its next ping: a CI run beside other load took 102 s from the kill to "now responding", hence 300 s."""
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True)
        self.procs = [p for p in self.procs if p.poll() is None]
        for role in NODES:
            self.link(role, up=True)
            if not any(p.args[-3:-2] == [self.ns[role]] for p in self.procs):  # slurmd ... -N NODE -f CONF
                self.start_slurmd(self.ns[role])
        end = time.monotonic() + timeout
        while not self._idle() and time.monotonic() < end:
            down = subprocess.run(["sinfo", "-h", "-N", "-t", "down,drain", "-o", "%N"], env=self.env,
                                  capture_output=True, text=True).stdout.split()
            for node in down:
                subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=self.env,
                               capture_output=True)
            time.sleep(1)
        self.wait_idle(max(1.0, end - time.monotonic()))

    def wait_idle(self, timeout: float = 120.0) -> None:
        self._wait(self._idle, timeout, "nodes idle again")

    def link(self, role: str, up: bool) -> None:
        """Set the link of `role`'s namespace up or down (its veth's end in the namespace)."""
        i = list(self.ns).index(role)
        _ip("-n", self.ns[role], "link", "set", f"astv{os.getpid()}{i}p", "up" if up else "down")

    def _services(self) -> None:
        """`astrai services start` in the login namespace, on its address: PostgreSQL, MLflow, Prefect, a worker."""
        d = self.services_dir
        # The worker's flow runs submit the jobs: the launcher picks each node's gloo interface (none set here)
        env = {k: v for k, v in self.env.items() if k != "GLOO_SOCKET_IFNAME"}
        out = self.run("login", [VENV_BIN / "astrai", "services", "start", d, "--host", self.addr[self.ns["login"]]],
                       env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"astrai services start in {self.ns['login']} failed:\n{out.stdout}\n{out.stderr}")
        self.services = json.loads((d / "services.json").read_text())
        self.env.update(dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines()))

    def stop(self) -> None:
        """Stop the services and daemons, then remove the namespaces (with whatever still runs in them), the links
        and the hosts lines; every step is tried whatever the ones before did."""
        try:
            if (self.services_dir / "services.json").exists():
                subprocess.run([VENV_BIN / "astrai", "services", "stop", self.services_dir], capture_output=True,
                               timeout=120)
        except (OSError, subprocess.SubprocessError):
            pass
        finally:
            try:
                super().stop()
            finally:
                _remove(self.tag)
                shutil.rmtree(self.services_dir, ignore_errors=True)


if __name__ == "__main__":
    if (why := missing()) is not None:
        sys.exit(why)
    cluster = NetnsCluster(Path(sys.argv[1]).resolve()).start()
    for key in ("SLURM_CONF", "MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        print(f"export {key}={cluster.env[key]}", flush=True)
    print(f"# namespaces: {' '.join(cluster.ns.values())}; e.g. ip netns exec {cluster.ns['login']} sinfo",
          flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
