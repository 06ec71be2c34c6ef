"""What `astrai serve` runs once its model reference is resolved to a checkpoint (astrai/cli.py resolves it:
resolving a registry reference is the pipeline's, and serving never imports it).

    api_key = check_exposure("127.0.0.1", None, False, ())     # serving.auth: who must have a key (ValueError)
    check_port_free("127.0.0.1", 8000)                          # ValueError naming --port
    n_threads, why = torch_threads("auto", 135e6, True)        # torch's threads for the model's size, and why
    dtype, dtype_why = inference_dtype_of(checkpoint, "auto", torch.device("cpu"))  # bf16 where it pays
    engine, chat = load_engine(checkpoint, EngineConfig(), "cpu", n_threads, engine_process=True, dtype=dtype)
    status = serve(engine, chat, "astrai/3", (), host="127.0.0.1", port=8000, api_key=api_key, allowed_hosts=(),
                   device="cpu", threads=(n_threads, why),      # 0: stopped; 1: the engine died (server.py)
                   dtype_why=dtype_why,
                   reference="models:/astrai@champion", look_up=alias_version)  # the alias polled (AliasWatch)

Loading and serving are two calls so that a registry download can be deleted once the engine has loaded it,
before the server runs.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from astrai_core.checkpoint.model_dir import load_model
from astrai_core.inference.engine import Engine, EngineClient, EngineConfig, EngineProcess
from astrai_core.tokenizer.chat import ChatFormat, load_chat
from serving.app import create_app
from serving.auth import Hosts
from serving.model import AliasWatch
from serving.server import run


def check_port_free(host: str, port: int) -> None:
    """ValueError naming --port when nothing can listen on host:port: said before the model loads, in one line
    (uvicorn would say it after, in lines of its own, and exit 3)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); is another server "
                         "using it?") from None


# `--threads auto` gives the engine process every core for a model of this many parameters or more, and keeps one
# core for the HTTP process and the clients below it: a decode step of a large model outweighs their per-token
# work, a small model's does not. Served on 2 cores, compiled, 2 threads over 1 at 1 / 4 / 16 / 64 streams, one
# round each (bench/serving_threads_by_size_report.json): SmolLM2-135M 1.21 / 1.61 / 1.57 / 1.53x, 94M 1.40 / 1.48 /
# 1.29 / 1.17x, 43M 1.03 / 0.73 / 1.05 / 1.10x, 26M 0.96 / 0.89 / 0.92 / 0.80x, the demo's 0.66M 0.57 / 0.46 / 0.56 /
# 0.90x.
ALL_CORES_FROM_PARAMS = 60_000_000


def torch_threads(choice: str, parameters: int, engine_process: bool) -> tuple[int, str]:
    """(torch threads, why) for --threads `choice` (auto or a number; ValueError otherwise), for a model of
    `parameters` served by an engine in a process of its own or in a thread of the server's (where the event loop
    always keeps a core: its thread and the engine's share the GIL)."""
    if choice != "auto":
        if not choice.isdigit() or int(choice) < 1:
            raise ValueError(f"--threads {choice}: expected auto or a number >= 1")
        return int(choice), "--threads"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"])), "OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if engine_process and parameters >= ALL_CORES_FROM_PARAMS:
        return cores, f"{cores} core(s), all of them for a model of {parameters / 1e6:.0f}M parameters"
    return max(1, cores - 1), f"{cores} core(s), one left for the event loop"


def load_engine(checkpoint: Path, config: EngineConfig, device: str, threads: int, engine_process: bool,
                dtype: torch.dtype = torch.float32) -> tuple[EngineClient, ChatFormat]:
    """The engine over `checkpoint`'s model, not started, in a process of its own (EngineProcess) or in this one
    (Engine: torch then uses `threads` threads here), and the chat format of its tokenizer. Once this returns the
    checkpoint directory is no longer read. AstraiError or ValueError when the checkpoint cannot be served."""
    chat = load_chat(checkpoint / "tokenizer.json")
    if engine_process:
        return EngineProcess(checkpoint, config, device=device, threads=threads, dtype=dtype), chat
    torch.set_num_threads(threads)
    return Engine(load_model(checkpoint, device=device, dtype=dtype)[0], config), chat


def serve(engine: EngineClient, chat: ChatFormat, model_id: str, aliases: Sequence[str], *, host: str, port: int,
          api_key: str | None, allowed_hosts: Sequence[str], device: str, threads: tuple[int, str],
          dtype_why: str, reference: str = "", look_up: Callable[[str, str], str] | None = None, alias_poll: float = 60.0) -> int:
    """Serve `engine` (from load_engine) as `model_id` and `aliases` on host:port until stopped (-> 0) or until
    the engine dies (-> 1, server.py), after one start-up line on stderr that says what the engine's options came
    to; the engine is started here and stopped on the way out. `threads`: (count, why) as torch_threads gave them,
    `dtype_why`: why the weights have the dtype they have (model_dir.inference_dtype_of), for that line. `reference`: the model as the user named it; when that is a registry alias (models:/NAME@ALIAS)
    and `alias_poll` > 0, `look_up(name, alias)` gives the version it points to now (or raises), every
    `alias_poll` s (AliasWatch, reported by /health and /v1/models)."""
    watch = AliasWatch.started_by(reference, model_id) if alias_poll > 0 else None
    if watch is not None:
        threading.Thread(target=follow_alias, args=(watch, look_up, alias_poll), name="alias-poll",
                         daemon=True).start()
    application = create_app(engine, chat, model_id, api_key=api_key, aliases=aliases,
                             hosts=Hosts(host, tuple(allowed_hosts)), watch=watch)
    c, (n_threads, why), stats = engine.config, threads, engine.stats()
    where = "process" if isinstance(engine, EngineProcess) else "thread"
    seconds = stats["compile_seconds"]
    compiled = "" if not c.compile else f"; steps compiled in {seconds} s" if seconds is not None else \
        "; steps compiling in the background, eager until then"
    packed = f", {stats['packed_linears']} projections prepacked for oneDNN" if stats["packed_linears"] else ""
    print(f"astrai: serving {', '.join([model_id, *aliases])} on http://{host}:{port}/v1 ({device}, "
          f"{stats['weights_dtype']} weights: {dtype_why}{packed}; {n_threads} "
          f"torch thread(s): {why}; engine {where}; batch cap {c.max_batch_size}, {stats['kv_blocks_total']} "
          f"KV blocks of {c.block_size} tokens, queue {c.max_waiting}{compiled})", file=sys.stderr, flush=True)
    engine.start()
    try:
        return run(application, engine, host, port)
    finally:
        engine.stop()


def follow_alias(watch: AliasWatch, look_up: Callable[[str, str], str], every: float) -> None:
    """Look up where watch's alias points every `every` s, for as long as the server runs; a change is logged."""
    while True:
        time.sleep(every)
        try:
            line = watch.update(look_up(watch.name, watch.alias))
        except Exception as e:  # noqa: BLE001 - a registry that cannot be read is reported, and looked at again
            line = watch.update(None, str(e).splitlines()[0] if str(e) else type(e).__name__)
        if line:
            print(f"astrai: {line}", file=sys.stderr, flush=True)
