"""The environment every entry point sets before Prefect, MLflow or DVC is imported: the one place it is written
(the Makefile exports the telemetry switches too, for the prefect and mlflow commands it runs itself)."""

import os
import tempfile
from pathlib import Path

DEFAULTS = {
    # Telemetry off: the network here is closed and they would stall.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "DVC_NO_ANALYTICS": "1",
    "DO_NOT_TRACK": "1",
    # The temporary Prefect server migrates a fresh database before it answers; Prefect waits 20 s for it, which a
    # busy 2-core machine exceeded ("Timed out while attempting to connect to ephemeral Prefect API server").
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # A call to the MLflow tracking server that fails (refused, or a 5xx while its database restarts) is tried again
    # 6 times, after 0, 2, 4, 8, 16 and 32 s (backoff factor 1, plus up to 1 s of MLflow's jitter each): a database
    # outage of about a minute is survived, and a dead server fails the stage after about a minute, not MLflow's
    # default 4 (7 retries, factor 2). Every stage, training rank and flow run inherits these; set them to change it.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "6", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


def apply() -> None:
    """Set each default the environment does not set already; make the directory PREFECT_HOME is in if it is missing
    (Prefect makes PREFECT_HOME itself, when it first needs it, but not its parents: its temporary server then fails
    to open its database, and the run waits 120 s for it and stops with "Timed out while attempting to connect")."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    if os.environ.get("PREFECT_HOME"):
        try:
            Path(os.environ["PREFECT_HOME"]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # Prefect says what it could not make
            pass


def prefect_home_problem() -> str | None:
    """Why a temporary Prefect server could not keep its database in PREFECT_HOME (default ~/.prefect), or None.
    Checked just before `astrai pipeline` starts one, by making PREFECT_HOME (as Prefect would a moment later) and a
    file in it: otherwise the run waits out the start-up timeout and ends on Prefect's "Timed out while attempting to
    connect", which does not say where. (Permission bits alone do not tell: root may write anywhere but /proc.)"""
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser().absolute()
    try:
        home.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=home).close()
    except OSError as e:
        return (f"PREFECT_HOME={home}: the temporary Prefect server cannot keep its database there "
                f"({e.strerror or e}); set PREFECT_HOME to a writable directory, or PREFECT_API_URL to a Prefect server")
    return None
