"""The engine: a queue of requests in, token events out, one scheduler loop in a background thread.

    engine = Engine(model, EngineConfig(kv_blocks=256)); engine.start()
    req_id = engine.submit(prompt_ids, SamplingParams(max_tokens=32, temperature=0), on_event)
    # on_event(new_token_ids, finish_reason) from the engine thread, finish_reason set on the last call only;
    # SamplingParams(logprobs=k, prompt_logprobs=k) add a third argument, the logprobs (sequence.OnEvent)
    engine.after_step.append(flush)  # called on the engine thread once each step's events are out

submit and cancel only touch a locked inbox, so any thread may call them; everything else (scheduler, blocks,
runner) belongs to the thread that calls step(). If step() raises, the loop stops, alive turns False and every
request gets a last event with finish_reason "error": a client never waits forever on a dead engine.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from astrai_core.inference.engine.block_manager import BlockManager
from astrai_core.inference.engine.packed import can_pack, pack_linears
from astrai_core.inference.engine.runner import KVPool, Runner, bytes_per_block
from astrai_core.inference.engine.scheduler import Scheduler
from astrai_core.inference.engine.sequence import OnEvent, SamplingParams, Sequence, Status
from astrai_core.model.transformer import Transformer

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """max_waiting requests already wait: try again later (HTTP 503)."""


@dataclass
class EngineConfig:
    # Running sequences at most. 64, not 16: at 128 requests at once (demo model, 1 thread, in process) 64 rows
    # decoded 6,400-6,700 tokens/s against 5,100-5,300 at 16, with time to first token p99 1.3 s against 2.8 s.
    max_batch_size: int = 64
    block_size: int = 16  # tokens per KV block
    kv_blocks: int | None = None  # blocks in the pool; None: as many as kv_memory_mb holds
    # None: 256 MiB, or two full contexts where the model's context needs more (a published model's 8k context), so
    # that any model serves with no sizing option and one long request never holds the whole pool
    kv_memory_mb: float | None = None
    # Tokens one request may hold (prompt and generated); None: the model's max_seq_len. A batch whose requests are
    # all short (generate_batch's) needs a pool of its own size, not one that holds a published model's 8k context.
    max_model_len: int | None = None
    prefill_chunk: int = 64  # prompt tokens prefilled per step per newcomer (chunked prefill)
    max_waiting: int = 256  # queue bound; submit raises QueueFull beyond it
    prefix_cache: bool = True
    # Bit-identical logits for a request whatever else runs (runner.Runner), at a measured cost: off by default.
    batch_invariant: bool = False
    # Decode steps and prefill chunks as torch.compile'd graphs (runner.Runner): fused kernels instead of a
    # dispatch per small op (a 1-row decode step of the demo's shape: 0.40 against 1.23 ms, bench/decode_step.py).
    # Compiling takes 60-90 s cold for the demo's shape on 2 cores, 6 s once torch's on-disk cache holds it.
    # Inductor may reorder float operations: logits can differ from eager's in the last bits
    # (tests/test_engine_compile.py bounds them). Off here; `astrai serve` turns it on, in the background.
    compile: bool = False
    # With compile: build the graphs on a thread of their own while the steps run eager, and switch to each once
    # it is built (stats()["compile_seconds"] is None until all are), instead of at Engine construction.
    compile_in_background: bool = False
    # The model's weights stay as they are while the engine lives (a served model's; not GRPO's policy): its bf16
    # projections run on weights prepacked for oneDNN (packed.py; a CPU with bf16 kernels), bit-identical to
    # F.linear's and faster. Off here; `astrai serve` turns it on.
    pack_weights: bool = False

    def __post_init__(self) -> None:
        if self.compile and self.batch_invariant:
            raise ValueError("compile and batch_invariant cannot be combined (compiled kernels are not batch-invariant)")
        for name in ("max_batch_size", "block_size", "prefill_chunk", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be at least 1")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError(f"kv_blocks ({self.kv_blocks}) must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be at least 2 (a prompt token and a new one)")
        if self.kv_memory_mb is not None and self.kv_memory_mb <= 0:
            raise ValueError(f"kv_memory_mb ({self.kv_memory_mb}) must be positive")

    def check_waiting(self, waiting: int) -> None:
        """The queue bound, for Engine and EngineProcess alike: QueueFull when `waiting` requests (submitted and not
        yet admitted to the batch) already wait."""
        if waiting >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are waiting already")


def check_prompt(prompt_ids: list[int], context_length: int, vocab_size: int) -> None:
    """ValueError for a prompt the engine cannot run: empty, leaving no room to generate, or holding a token id
    outside the vocabulary (the embedding would fail inside the loop, for the whole batch)."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    if len(prompt_ids) >= context_length:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context is {context_length}")
    if not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}): got {min(prompt_ids)}..{max(prompt_ids)}")


def run_listeners(listeners: list[Callable[[], None]]) -> None:
    """Call each after_step listener; one that raises is logged, and neither the engine nor the others stop."""
    for listener in listeners:
        try:
            listener()
        except Exception:  # noqa: BLE001
            log.exception("after_step listener %r raised", listener)


DEFAULT_KV_MEMORY_MB = 256
TTFT_KEPT = 1024  # recent time-to-first-token values kept for stats()


class Engine:
    def __init__(self, model: Transformer, config: EngineConfig | None = None) -> None:
        self.model, self.config = model.eval(), config or EngineConfig()
        cfg = self.config
        if cfg.batch_invariant and (dtype := next(model.parameters()).dtype) != torch.float32:
            raise ValueError(f"batch_invariant needs fp32 weights, not {str(dtype).removeprefix('torch.')}: bf16 gemms "
                             "give a row other bits as the batch grows past 32 rows (runner.Runner)")
        self.packed_linears = pack_linears(model) if cfg.pack_weights and can_pack(model) else 0
        self.context_length = min(cfg.max_model_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self.vocab_size = model.cfg.vocab_size
        block_bytes = bytes_per_block(model, cfg.block_size)
        per_context = -(-self.context_length // cfg.block_size)
        num_blocks = cfg.kv_blocks or (int(cfg.kv_memory_mb * 2**20 // block_bytes) if cfg.kv_memory_mb else
                                       max(DEFAULT_KV_MEMORY_MB * 2**20 // block_bytes, 2 * per_context))
        if num_blocks * cfg.block_size < self.context_length:  # else a long request could never be admitted
            raise ValueError(f"the KV pool ({num_blocks} blocks of {cfg.block_size} tokens) must hold at least one "
                             f"full context ({self.context_length} tokens): raise kv_blocks or kv_memory_mb")
        self.kv_bytes = num_blocks * block_bytes
        # width: at least 2 blocks, as Runner.run's tables (a width of 1 would be a compiled graph of its own)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_cache, max_seqs=cfg.max_batch_size,
                                   width=max(2, per_context))
        chunk = min(cfg.prefill_chunk, self.context_length)
        self.scheduler = Scheduler(self.blocks, cfg.max_batch_size, chunk, self.context_length)
        self.runner = Runner(model, KVPool(model, num_blocks, cfg.block_size), self.blocks.slots, cfg.batch_invariant,
                             cfg.compile)
        self.compile_seconds: float | None = 0.0
        if cfg.compile and cfg.compile_in_background:
            self.compile_seconds = None
            threading.Thread(target=self._compile, name="engine-compile", daemon=True).start()
        elif cfg.compile:
            self._compile()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: deque[Sequence] = deque()
        self._cancelled: set[int] = set()
        self._live: dict[int, Sequence] = {}  # every unfinished request, by id (owned by the engine thread)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Called on the engine thread after each step of the loop (and after a crash's last events): a consumer
        # that hands events to another thread wakes it once per step here, not once per event (serving's relay).
        self.after_step: list[Callable[[], None]] = []
        self.alive = True
        self.error: BaseException | None = None
        self.prompt_tokens_total = self.generated_tokens_total = self.requests_finished_total = 0
        self.ttft_sum, self.ttft_count, self.ttft_recent = 0.0, 0, deque(maxlen=TTFT_KEPT)

    def _compile(self) -> None:
        """Build the compiled graphs (Runner.warm_up); the steps use each from the next one on. In the background,
        a failure (no C++ compiler, say) leaves the steps eager and says so on stderr, as the end does."""
        background, start = self.config.compile_in_background, time.perf_counter()
        try:
            self.runner.warm_up()
        except Exception as e:
            if not background:
                raise
            print(f"astrai: compiling the engine's steps failed ({type(e).__name__}: {str(e)[:300]}); they stay eager",
                  file=sys.stderr, flush=True)
            return
        self.compile_seconds = round(time.perf_counter() - start, 1)
        if background:
            print(f"astrai: engine steps compiled in {self.compile_seconds} s (in the background; decode steps ran "
                  f"compiled from {self.runner.graph_seconds['decode']} s); they run compiled from now on",
                  file=sys.stderr, flush=True)

    # --- any thread -------------------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: OnEvent) -> int:
        """Queue a request; -> its id. Raises ValueError (empty prompt, one that leaves no room to generate, a token
        id outside the vocabulary), QueueFull, or RuntimeError when the engine loop has died."""
        check_prompt(prompt_ids, self.context_length, self.vocab_size)
        with self._lock:
            if not self.alive:
                raise RuntimeError(f"the engine has stopped after an error: {self.error!r}")
            self.config.check_waiting(len(self._inbox) + len(self.scheduler.waiting))
            seq = Sequence(next(self._ids), list(prompt_ids), params, on_event)
            if params.seed is not None:
                seq.generator = torch.Generator(self.runner.device).manual_seed(params.seed)
            self._inbox.append(seq)
        self._wake.set()
        return seq.id

    def cancel(self, req_id: int) -> None:
        """Finish the request with "cancelled" at the next step (nothing happens if it has finished already)."""
        with self._lock:
            self._cancelled.add(req_id)
        self._wake.set()

    def stats(self) -> dict:
        """Gauges and counters (read without locking: each value is current within a step). ttft_seconds: the
        last TTFT_KEPT times to first token (submit to first sampled token), also as ttft_seconds_sum/_count."""
        b = self.blocks
        with self._lock:
            ttft = list(self.ttft_recent), self.ttft_sum, self.ttft_count
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self._inbox),
            "kv_blocks_total": b.num_blocks, "kv_blocks_used": b.num_used, "kv_blocks_free": b.num_free,
            "kv_block_size": b.block_size, "kv_bytes": self.kv_bytes,
            "prefix_cache_hits": b.hits, "prefix_cache_queries": b.queries,
            "prompt_tokens_total": self.prompt_tokens_total, "generated_tokens_total": self.generated_tokens_total,
            "requests_finished_total": self.requests_finished_total,
            "preemptions_total": self.scheduler.preemptions,
            "ttft_seconds": ttft[0], "ttft_seconds_sum": ttft[1], "ttft_seconds_count": ttft[2],
            "torch_threads": torch.get_num_threads(), "compile_seconds": self.compile_seconds,
            "weights_dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "packed_linears": self.packed_linears,
        }

    def start(self) -> None:
        """Run the loop (run()) on a thread of its own."""
        assert self._thread is None, "the engine is started already"
        self._stopping = False
        self._thread = threading.Thread(target=self.run, name="astrai-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop (requests in flight stay where they are); wait for its thread when start() made one."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # --- the engine thread --------------------------------------------------------------------------------------

    def run(self) -> None:
        """The loop, on the calling thread, until stop(): step while there is work, else wait for submit().
        EngineProcess's child runs it on the thread that loaded the model: torch's intra-op threads then serve one
        thread only (an OpenMP team of a second thread, kept by libgomp once it has run a parallel region, makes
        every team wait passively, and a 2-thread step of SmolLM2 took 83 against 31 ms: docs/serving.md)."""
        try:
            while not self._stopping:
                worked = self.step()
                self._after_step()
                if not worked:
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - whatever it was, no request may hang
            log.exception("the engine loop died")
            self._die(e)
            self._after_step()

    def _after_step(self) -> None:
        run_listeners(self.after_step)

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self.alive, self.error = False, error
            self._live.update((s.id, s) for s in self._inbox)
            self._inbox.clear()
        for seq in list(self._live.values()):
            if not seq.closed:  # a request may have had its last event in the step that failed
                self._finish(seq, "error")

    def step(self) -> bool:
        """One scheduler iteration: take in new requests and cancellations, run one forward for the batch,
        emit the new tokens. False when there was nothing to do."""
        with self._lock:
            inbox, self._inbox = self._inbox, deque()
            cancelled, self._cancelled = self._cancelled, set()
        for seq in inbox:
            self._live[seq.id] = seq
            self.scheduler.add(seq)
            self.prompt_tokens_total += len(seq.prompt_ids)
        for req_id in cancelled:
            if req_id in self._live:
                self._finish(self._live[req_id], "cancelled")
        if not self.scheduler.has_work():
            return bool(inbox or cancelled)
        batch = self.scheduler.schedule()
        if not batch:
            return True
        # Decoding rows (1 token) and prefilling rows (up to prefill_chunk) run as separate forwards, so that a
        # decode is not padded to the chunk length.
        done = []
        for part in ([b for b in batch if b[1] == 1], [b for b in batch if b[1] > 1]):
            if part:
                every = None
                if any(s.params.prompt_logprobs is not None and n > 1 for s, n in part):  # else the fast path
                    every = self.runner.run(part, every_position=True)
                    logits = every[torch.arange(len(part)), torch.tensor([n - 1 for _, n in part])]
                else:
                    logits = self.runner.run(part)
                lengths = {s.id: len(s.output_ids) for s, _ in part}
                done += self.scheduler.postprocess(part, logits, every)
                now = time.perf_counter()
                for seq, _ in part:
                    if len(seq.output_ids) > lengths[seq.id] or seq.status is Status.FINISHED:
                        self._emit(seq, now)
        for seq in done:
            self._retire(seq)
        return True

    def _emit(self, seq: Sequence, now: float) -> None:
        """Send the token sampled for seq this step (held back if it is a stop token), or, for a request that
        generates nothing (max_tokens 0), its end with the prompt's logprobs."""
        reason = seq.finish_reason
        if seq.params.max_tokens == 0:
            self._send(seq, [], reason)
            return
        self.generated_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            with self._lock:  # stats() copies the deque from another thread
                self.ttft_sum += now - seq.arrival
                self.ttft_count += 1
                self.ttft_recent.append(now - seq.arrival)
        token = seq.output_ids[-1]
        self._send(seq, [] if reason == "stop" else [token], reason)

    def _send(self, seq: Sequence, tokens: list[int], reason: str | None) -> None:
        """on_event, shielded: a callback that raises (its client is gone) cancels its own request only. Requests
        that asked for logprobs get those not sent yet as a third argument (sequence.OnEvent)."""
        seq.closed = reason is not None
        args: tuple = (tokens, reason)
        if seq.params.logprobs is not None or seq.params.prompt_logprobs is not None:
            args, seq.pending_logprobs = (tokens, reason, seq.pending_logprobs), []
        try:
            seq.on_event(*args)
        except Exception:  # noqa: BLE001
            log.exception("on_event of request %d raised", seq.id)
            if reason is None:
                self.cancel(seq.id)

    def _retire(self, seq: Sequence) -> None:
        del self._live[seq.id]
        self.requests_finished_total += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End a request the scheduler did not finish itself (cancelled, or the engine died)."""
        if seq.status is not Status.FINISHED:
            try:
                self.scheduler.finish(seq)
            except Exception:  # noqa: BLE001 - after a crash the scheduler's state may be inconsistent
                seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._live.pop(seq.id, None)
        self.requests_finished_total += 1
        self._send(seq, [], reason)
