"""The registry lock: registrations and promotions of one registered model name, on any machine, one after the
other (a PostgreSQL advisory lock; none without a lock URI)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Iterator

from astrai_core.runtime.errors import AstraiError
from tasks.run.schema import Params

REGISTRY_LOCK_ENV = "ASTRAI_REGISTRY_LOCK_URI"  # wins over tracking.registry_lock_uri, as MLFLOW_TRACKING_URI does
REGISTRY_LOCK_CONNECT_TIMEOUT = 10  # s: how long the lock waits for its PostgreSQL to answer


def registry_lock_uri(params: Params) -> str | None:
    """Where the registry lock is: ASTRAI_REGISTRY_LOCK_URI, else tracking.registry_lock_uri, else none."""
    return os.environ.get(REGISTRY_LOCK_ENV) or params.tracking.registry_lock_uri


@contextlib.contextmanager
def registry_lock(uri: str | None, name: str) -> Iterator[bool]:
    """While held, no other registration of model `name` holds it, on any machine: a PostgreSQL advisory lock on
    `uri` (libpq form, postgresql://USER:PASS@HOST:PORT/DB; any database of a server every registration reaches).
    Yields True while held, False at once without a `uri`.

    MLflow's API has no compare-and-set for aliases, and a client reaches only that API; so the compare and the set
    are made one step by a lock every registration takes. An advisory lock is the session's: when the holder's
    connection ends (the stage finished, crashed or was killed), the server lets it go, so no stale lock remains
    for anyone to break by hand, unlike a lock file or a create-if-absent marker in the registry. A server that does
    not answer within REGISTRY_LOCK_CONNECT_TIMEOUT s, or refuses, is an AstraiError naming it: nothing waits unbounded.
    """
    if not uri:
        yield False
        return
    import psycopg2  # the team extra (pyproject.toml)
    from psycopg2.extensions import parse_dsn

    key = int.from_bytes(hashlib.sha256(f"astrai.register:{name}".encode()).digest()[:8], "big", signed=True)
    dsn = uri.replace("postgresql+psycopg2://", "postgresql://", 1)
    try:
        # libpq waits for a server that does not answer (down behind a firewall, stopped, a dead host) without end by
        # default: bounded here, unless the URI or PGCONNECT_TIMEOUT sets a wait of its own.
        bound = {} if "connect_timeout" in parse_dsn(dsn) or os.environ.get("PGCONNECT_TIMEOUT") \
            else {"connect_timeout": REGISTRY_LOCK_CONNECT_TIMEOUT}
        conn = psycopg2.connect(dsn, **bound)
    except psycopg2.Error as e:  # libpq's first line names the server and what failed, never the password
        raise AstraiError(f"registry lock ({REGISTRY_LOCK_ENV} or tracking.registry_lock_uri): "
                          f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    conn.autocommit = True  # session-level lock, no transaction held open while it is
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(%s)", (key,))
            if not cur.fetchone()[0]:
                print(f"registry: waiting for another registration or promotion of {name!r} to finish (registry lock)",
                      flush=True)
                cur.execute("SELECT pg_advisory_lock(%s)", (key,))
        yield True
    finally:
        conn.close()  # the session ends, and the lock with it
