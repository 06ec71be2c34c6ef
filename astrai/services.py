"""The team services: PostgreSQL, the MLflow tracking server and the Prefect server on it, a process work pool and
its worker; what `astrai services start|stop|env` runs (docs/scaling-out.md, "Team setup").

    astrai services start DIR                      # a trial PostgreSQL in DIR/postgres (Debian's postgresql-15)
    astrai services start DIR --postgres URI       # or the team's PostgreSQL: postgresql://USER:PASS@HOST:PORT
    eval "$(astrai services env DIR)"              # MLFLOW_TRACKING_URI, PREFECT_API_URL, ASTRAI_REGISTRY_LOCK_URI
    astrai services stop DIR

Each service is a process of its own session (it outlives the command that started it), with its log and pid in
DIR; DIR/services.json says what runs and where (mode 0600: it holds the database password). MLflow and Prefect
get a database each on the PostgreSQL, `mlflow` and `prefect`, and their schemas are migrated before the servers
start. MLflow serves the artifacts itself (--serve-artifacts from DIR/artifacts): clients, compute nodes included,
read and write them over HTTP (`mlflow-artifacts:/` URIs) and need no shared path to them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from astrai_core.runtime import env as astrai_env
from astrai_core.runtime.errors import AstraiError

PG_BIN = Path(os.environ.get("ASTRAI_PG_BIN", "/usr/lib/postgresql/15/bin"))  # Debian's postgresql-15
PG_USER = "postgres"  # PostgreSQL refuses to run as root: as root, the trial server runs as this system user
DATABASES = ("mlflow", "prefect")
VENV_BIN = Path(sys.executable).parent  # mlflow and prefect from the environment astrai runs in


def with_driver(uri: str, driver: str | None) -> str:
    """postgresql://... with SQLAlchemy's driver written out (postgresql+psycopg2://...), or none for libpq.
    SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3 (2.0 mapped it to psycopg2), so the driver is explicit."""
    scheme, _, rest = uri.partition("://")
    if scheme.split("+")[0] not in ("postgresql", "postgres") or not rest:
        raise AstraiError(f"--postgres {uri}: expected postgresql://USER:PASSWORD@HOST:PORT")
    return f"postgresql{'+' + driver if driver else ''}://{rest}"


def database(uri: str, name: str) -> str:
    """The server URI `uri` with its database path set to `name`."""
    parts = urllib.parse.urlsplit(uri)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))


def _pg(tool: str, *args: str, log: Path) -> None:
    cmd = [str(PG_BIN / tool), *args]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", PG_USER, "--", *cmd]
    with open(log, "ab") as out:
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise AstraiError(f"{tool} failed; see {log}")


def start_postgres(d: Path, host: str, port: int) -> str:
    """initdb (first time only) and start a PostgreSQL in d/postgres; returns its server URI (password auth)."""
    if not (PG_BIN / "initdb").exists():
        raise AstraiError(f"no PostgreSQL in {PG_BIN} (apt-get install postgresql-15, or set ASTRAI_PG_BIN); or give "
                          "a running one with --postgres URI")
    pg = d / "postgres"
    data, secret = pg / "data", pg / "password"
    if not data.exists():
        pg.mkdir(parents=True)
        secret.write_text(secrets.token_hex(16))
        secret.chmod(0o600)
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", PG_USER, str(pg)], check=True)
            if subprocess.run(["runuser", "-u", PG_USER, "--", "test", "-w", str(pg)]).returncode != 0:
                raise AstraiError(f"{pg}: user {PG_USER} cannot reach it (a parent directory closed to other users?); "
                                  "give a DIR it can reach, e.g. under /srv or /tmp")
        _pg("initdb", "-D", str(data), "-U", "astrai", "--auth=scram-sha-256", f"--pwfile={secret}", "-E", "UTF8",
            "--locale=C.UTF-8", log=pg / "initdb.log")
        # initdb lets in loopback clients only; --host ADDRESS is for the machines on ADDRESS's network (with the
        # password)
        with (data / "pg_hba.conf").open("a") as f:
            f.write("host all all samenet scram-sha-256\n")
    # The socket goes in the data directory: /var/run/postgresql may not exist or be writable.
    _pg("pg_ctl", "-D", str(data), "-l", str(pg / "server.log"), "-w", "-t", "120", "-o",
        f"-p {port} -c listen_addresses={host} -k {data}", "start", log=pg / "pg_ctl.log")
    return f"postgresql://astrai:{secret.read_text().strip()}@{'127.0.0.1' if host in ('0.0.0.0', '*') else host}:{port}"


def create_databases(server_uri: str) -> None:
    """The mlflow and prefect databases on the server, where missing."""
    import psycopg2

    try:
        conn = psycopg2.connect(database(with_driver(server_uri, None), "postgres"))
    except psycopg2.OperationalError as e:  # libpq's hint is a line of its own: one line, for the error line
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise AstraiError(f"PostgreSQL at {urllib.parse.urlsplit(server_uri).hostname}: {why}") from None
    conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
    try:
        with conn.cursor() as cur:
            for name in DATABASES:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{name}"')
    finally:
        conn.close()


def _spawn(d: Path, name: str, cmd: list[str], env: dict[str, str]) -> int:
    log = open(d / f"{name}.log", "ab")
    proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=d)
    return proc.pid


@contextlib.contextmanager
def temporary_prefect_server(home: Path):
    """A Prefect server (API only) for one `astrai pipeline` run without PREFECT_API_URL, on a free port of 127.0.0.1,
    its database and log (temporary-server.log) in PREFECT_HOME `home`; PREFECT_API_URL names it while the run lasts.

    Why not Prefect's own temporary server: Prefect starts it as a plain child, in the terminal's process group, so
    Ctrl-C stopped it at once; the flow could then not record how it ended (it stayed RUNNING) and retried for 76 s
    ("All connection attempts failed"). This one has a session of its own: it outlives the Ctrl-C until the run has
    ended its flow run, and is stopped on leaving (recorded too, for the next run to stop if this one is killed)."""
    from astrai_core.runtime.proc import record, start_ticks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    pid = _spawn(home, "temporary-server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                            "--port", str(port), "--no-ui", "--no-services"], dict(os.environ))
    record({"pid": pid, "start": start_ticks(pid), "group": True, "what": "prefect temporary server"})
    try:
        wait_healthy(f"{url}/health", pid, home / "temporary-server.log",
                     float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 120)))
        os.environ["PREFECT_API_URL"] = url
        yield url
    finally:
        if "prefect.logging.handlers" in sys.modules:  # the run's last log lines go to the server before it stops
            sys.modules["prefect.logging.handlers"].APILogWorker.drain_all(timeout=5)  # (not at exit, retrying 70 s)
        os.environ.pop("PREFECT_API_URL", None)
        _stop_pid(pid, signal.SIGTERM)


def _run(cmd: list, env: dict[str, str], what: str) -> None:
    out = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise AstraiError(f"{what} failed:\n{(out.stdout + out.stderr)[-3000:]}")


def wait_healthy(url: str, pid: int, log: Path, timeout: float = 180) -> None:
    """Until `url` answers 200; AstraiError with the end of `log` if process `pid` exits first, or on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if not _alive(pid):
            raise AstraiError(f"{url}: the server exited; its log {log} ends:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise AstraiError(f"{url}: no answer after {timeout:.0f} s; see {log}")


def check_serves(url: str, pid: int, option: str, log: Path) -> None:
    """AstraiError unless what answers at `url` is the server started as `pid`: a server that took the port first
    (another team's) answers too, while ours exits with "address in use"."""
    port = urllib.parse.urlsplit(url).port
    if not _group_listens(pid, port):
        raise AstraiError(f"{url}: another server answers on port {port} ({option}), not the one started here "
                          f"({'exited' if not _alive(pid) else 'not listening there'}; its log: {log}); choose a free "
                          f"port with {option}")


def _group_listens(pgid: int, port: int) -> bool:
    """Whether a process of group `pgid` holds a TCP socket listening on `port` (in that group's network namespace:
    /proc/PID/net is the namespace of PID)."""
    sockets = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pgid}/net/{table}").read_text().splitlines()[1:]
        except OSError:  # the group's leader is gone
            return False
        for row in rows:  # sl local_address rem_address st ... inode
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                sockets.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            fds = list((proc / "fd").iterdir())
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in sockets:
                    return True
            except OSError:  # a file closed meanwhile
                continue
    return False


def _check_ports_free(host: str, ports: dict[str, int]) -> None:
    """AstraiError naming every port of `ports` (option: port) that something listens on already at `host`: the
    servers would fail to bind it, while what listens there answered in their place."""
    seen: dict[int, str] = {}
    for option, port in ports.items():
        if port in seen:
            raise AstraiError(f"{seen[port]} {port} and {option} {port}: each server needs a port of its own")
        seen[port] = option
    busy = []
    for option, port in ports.items():
        bind_host = "0.0.0.0" if host == "*" else host  # PostgreSQL's "every address"
        try:
            with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is free
                s.bind((bind_host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise AstraiError(f"--host {host}: cannot listen on {host}:{port} ({e.strerror or e})") from None
            busy.append(option)
    if busy:
        which = "a free port" if len(busy) == 1 else "free ports"
        raise AstraiError(f"in use already: {', '.join(f'{host}:{ports[o]} ({o})' for o in busy)}; stop what listens "
                          f"there (another team's services?) or choose {which} with {', '.join(busy)}; nothing was "
                          "started")


def _check_start(d: Path, postgres: str | None, ports: dict[str, int]) -> None:
    """Bad input to `start`, before anything is written or started."""
    for option, port in ports.items():
        if not 1 <= port <= 65535:
            raise AstraiError(f"{option} {port}: expected a TCP port, 1-65535")
    if postgres is not None:
        parts = urllib.parse.urlsplit(with_driver(postgres, None))
        try:
            port_ok = parts.port is None or parts.port > 0  # .port: ValueError unless a number up to 65535
        except ValueError:
            port_ok = False
        if not (parts.hostname and port_ok):
            raise AstraiError(f"--postgres {postgres}: expected postgresql://USER:PASSWORD@HOST:PORT")
    if d.exists() and not d.is_dir():
        raise AstraiError(f"{d}: not a directory; give a new one or one `astrai services start` used before")
    if d.is_dir() and not (d / "services.json").exists() and any(d.iterdir()):  # a user's folder: not written into
        raise AstraiError(f"{d}: a folder `astrai services start` did not make (it holds other files); give a new or "
                          "empty one, or one it used before")


def _alive(pid: int) -> bool:
    try:  # a zombie (exited, not yet reaped by whoever adopted it) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def base_env(d: Path) -> dict[str, str]:
    """The services' environment: the entry points' (telemetry off, ...), then this one's, the Prefect home in `d`."""
    return {**astrai_env.DEFAULTS, **os.environ, "PREFECT_HOME": str(d / "prefect")}


def client_env(state: dict) -> dict[str, str]:
    """What a checkout needs to use the services: the tracking server, the Prefect API and the registry lock."""
    return {"MLFLOW_TRACKING_URI": state["mlflow_url"], "PREFECT_API_URL": state["prefect_api_url"],
            "ASTRAI_REGISTRY_LOCK_URI": state["lock_uri"]}


def running_env(d: Path) -> dict[str, str]:
    """client_env of the services that run from d. Refused where its servers do not run: after a stop or a failed
    start, its URLs (if it got that far) name ports where nothing, or another team's servers, answer."""
    state = load(d)
    if not all(name in state["pids"] and _alive(state["pids"][name]) for name in ("mlflow", "prefect")):
        raise AstraiError(f"{d.resolve() / 'services.json'}: its servers do not run (stopped, or their start failed: "
                          f"see the logs there); start them with `astrai services start {d}`")
    return client_env(state)


def start(d: Path, host: str = "127.0.0.1", postgres: str | None = None, pg_port: int = 5432,
          mlflow_port: int = 5000, prefect_port: int = 4200, pool: str = "astrai-local") -> dict:
    """Start every service (on failure, stop what started, then raise); returns the state in d/services.json.
    Bad input, a port in use included, is refused before anything is written or started."""
    d = d.resolve()
    ports = {"--pg-port": pg_port, "--mlflow-port": mlflow_port, "--prefect-port": prefect_port}
    _check_start(d, postgres, ports)
    if (d / "services.json").exists() and any(_alive(p) for p in load(d)["pids"].values()):
        raise AstraiError(f"{d}: services already run from here; `astrai services stop {d}` first")
    if postgres is not None:
        del ports["--pg-port"]  # the trial database's
    _check_ports_free(host, ports)
    d.mkdir(parents=True, exist_ok=True)
    state: dict = {"dir": str(d), "pids": {}, "trial_postgres": postgres is None}
    save(d, state)  # first: a failed start stops what it started from here
    try:
        server = postgres or start_postgres(d, host, pg_port)
        state["postgres"] = server
        save(d, state)
        create_databases(server)
        state["lock_uri"] = database(with_driver(server, None), "mlflow")
        env = base_env(d)

        mlflow_db = database(with_driver(server, "psycopg2"), "mlflow")
        _run([VENV_BIN / "mlflow", "db", "upgrade", mlflow_db], env, "mlflow db upgrade")
        (d / "artifacts").mkdir(exist_ok=True)
        # No job execution and one worker: ~500 MB instead of 2.4 GB (measured on the 2-core machine).
        state["pids"]["mlflow"] = _spawn(d, "mlflow", [
            VENV_BIN / "mlflow", "server", "--host", host, "--port", str(mlflow_port), "--workers", "1",
            "--backend-store-uri", mlflow_db, "--artifacts-destination", d / "artifacts", "--serve-artifacts"],
            {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        reach = "127.0.0.1" if host in ("0.0.0.0", "*") else host  # where this machine reaches them
        state["mlflow_url"] = f"http://{reach}:{mlflow_port}"
        save(d, state)

        prefect_env = {**env, "PREFECT_API_DATABASE_CONNECTION_URL": database(with_driver(server, "asyncpg"), "prefect")}
        _run([VENV_BIN / "prefect", "server", "database", "upgrade", "-y"], prefect_env, "prefect server database upgrade")
        state["prefect_api_url"] = f"http://{reach}:{prefect_port}/api"
        # The UI's pages call the API at PREFECT_SERVER_UI_API_URL, by default 127.0.0.1:4200 whatever --port says
        # (as the Makefile's `server` target sets it).
        state["pids"]["prefect"] = _spawn(d, "prefect", [VENV_BIN / "prefect", "server", "start", "--host", host,
                                                         "--port", str(prefect_port)],
                                          {**prefect_env, "PREFECT_SERVER_UI_API_URL": state["prefect_api_url"]})
        save(d, state)
        for name, url, option in (("mlflow", f"{state['mlflow_url']}/health", "--mlflow-port"),
                                  ("prefect", f"{state['prefect_api_url']}/health", "--prefect-port")):
            wait_healthy(url, state["pids"][name], d / f"{name}.log")
            check_serves(url, state["pids"][name], option, d / f"{name}.log")

        worker_env = {**env, **client_env(state)}  # flow runs inherit it: they log to the server, lock the registry
        _run([VENV_BIN / "prefect", "work-pool", "create", pool, "--type", "process", "--overwrite"], worker_env,
             f"prefect work-pool create {pool}")
        state["pids"]["worker"] = _spawn(d, "worker", [VENV_BIN / "prefect", "worker", "start", "--pool", pool],
                                         worker_env)
        state["pool"] = pool
        save(d, state)
    except BaseException:
        stop(d)
        raise
    return state


def save(d: Path, state: dict) -> None:
    path = d / "services.json"
    path.touch(mode=0o600)
    path.write_text(json.dumps(state, indent=2))


def load(d: Path) -> dict:
    path = d.resolve() / "services.json"
    if not path.is_file():
        raise AstraiError(f"{d}: no services.json (start them with `astrai services start {d}`)")
    try:
        state = json.loads(path.read_text())
    except ValueError:  # cut short (a full disk, a killed start) or not ours; UnicodeDecodeError is one too
        state = None
    if not isinstance(state, dict) or not isinstance(state.get("pids"), dict) or "dir" not in state:
        raise AstraiError(f"{path}: not a state file of `astrai services start` (cut short?); stop by hand what "
                          f"still runs from {d.resolve()} (its logs are there), then remove the file")
    return state


def _group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies aside, as in _alive)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def _stop_pid(pid: int, *signals: int) -> None:
    """Each signal in turn to the process group, 10 s for all of it to end; then SIGKILL. The whole group, not its
    leader only: the worker's flow runs (and what they started) are in it, and outlive a worker that exits."""
    for sig in (*signals, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        for _ in range(100):
            if not _group_alive(pid):
                return
            time.sleep(0.1)


def stop(d: Path) -> None:
    """Stop what d/services.json says runs: the worker (SIGTERM, then SIGINT: an idle worker needs both), the
    servers, then the trial PostgreSQL (its data stays in d/postgres; `start` again reuses it)."""
    d = d.resolve()
    state = load(d)
    for name, sigs in (("worker", (signal.SIGTERM, signal.SIGINT)), ("prefect", (signal.SIGTERM,)),
                       ("mlflow", (signal.SIGTERM,))):
        if name in state["pids"]:
            _stop_pid(state["pids"][name], *sigs)
    state["pids"] = {}
    if state.get("trial_postgres") and (d / "postgres" / "data" / "postmaster.pid").exists():
        _pg("pg_ctl", "-D", str(d / "postgres" / "data"), "-m", "fast", "-w", "stop", log=d / "postgres" / "pg_ctl.log")
    save(d, state)
