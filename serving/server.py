"""Running the app on uvicorn, for as long as its engine lives (what `astrai serve` does).

    status = run(app, engine, host="127.0.0.1", port=8000)    # 0: stopped (Ctrl-C, SIGTERM); 1: the engine died

An engine that died does not come back (its loop raised, or its process was killed), and a server that answers
503 forever looks alive to everything but a health check. So when the engine dies, the server logs one line
("astrai: the engine died ..."), stops taking connections, lets the open requests end (the engine has already
ended each one with an error: a stream gets its error event, a whole reply a 500; at most GRACE_SECONDS), and
run() returns ENGINE_DIED, the process's exit status, so that a supervisor (systemd's Restart=on-failure,
Kubernetes' restart policy) starts a fresh server.
"""

from __future__ import annotations

import logging
import signal
import threading

import uvicorn
from fastapi import FastAPI

from astrai_core.inference.engine import EngineClient

ENGINE_DIED = 1  # exit status
GRACE_SECONDS = 5  # for open requests when the server stops

log = logging.getLogger("uvicorn.error")  # uvicorn's own log, set up by uvicorn


def run(app: FastAPI, engine: EngineClient, host: str, port: int) -> int:
    """Serve until stopped (-> 0) or until `engine` dies (-> ENGINE_DIED). The engine must be started already."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=GRACE_SECONDS))
    died = threading.Event()

    def watch() -> None:  # an after_step listener: the engine calls it once more after its loop died
        if not engine.alive and not died.is_set():
            died.set()
            log.error("astrai: the engine died (%s); ending the open requests and exiting with status %d so that "
                      "a supervisor restarts the server", engine.error, ENGINE_DIED)
            server.should_exit = True

    engine.after_step.append(watch)
    watch()  # it may have died before the listener was in place
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the handler it found:
    # Python's default would end the process there (status -15, the engine never stopped), so it finds a no-op one.
    stopped = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        engine.after_step.remove(watch)  # the engine is stopped next (launch.serve): that is no death
        for sig, handler in stopped.items():
            signal.signal(sig, handler)
    return ENGINE_DIED if died.is_set() else 0
