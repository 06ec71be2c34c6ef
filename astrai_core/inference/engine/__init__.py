"""The serving engine: continuous batching over a paged KV cache with prefix caching (no web code here).

    sequence.py       a request: tokens, sampling parameters, status, block table
    block_manager.py  the pool's blocks: free list, reference counts, prefix cache (hash chain), LRU eviction;
                      each running sequence's slot (what a decode step reads)
    scheduler.py      each step: admit, chunked prefill, decode, retire; preemption when out of blocks
    runner.py         the batch as tensors (a decode step: its bucket's buffers), the model run against the pool
    engine.py         Engine: submit / cancel / step, the loop thread, stats
    process.py        EngineProcess: an Engine in a child process (astrai serve's default), over two pipes
    client.py         EngineClient: the interface both implement, exactly what a server may use

The public API: Engine, EngineProcess, EngineConfig, SamplingParams, TokenLogprob, QueueFull, and EngineClient
(serving/ is typed with it and uses nothing else of the engine but the data types SamplingParams and TokenLogprob).
"""

from astrai_core.inference.engine.client import EngineClient
from astrai_core.inference.engine.engine import Engine, EngineConfig, QueueFull
from astrai_core.inference.engine.process import EngineProcess
from astrai_core.inference.engine.sequence import SamplingParams, TokenLogprob

__all__ = ["Engine", "EngineClient", "EngineConfig", "EngineProcess", "QueueFull", "SamplingParams", "TokenLogprob"]
