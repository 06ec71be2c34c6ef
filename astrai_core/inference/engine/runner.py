"""Runs the model on a scheduled batch against the paged KV pool.

The model is used as it is: Transformer.forward(idx, cache, positions=, mask=) calls cache.extend(layer, *new)
once per layer and attends over what it returns. PagedCache is such a cache: extend scatters each row's new
entries into the pool (slot = block_table[pos // block_size] * block_size + pos % block_size) and gathers each
row's entries back in position order, padded to the longest row; the mask hides the padding. So every attention
variant works unchanged: the pool holds whatever the layer caches ((k, v) per kv head, or MLA's latent and RoPE
key), each as a (slots, *per-token shape) tensor. The price of not touching the model: each forward copies every
row's cached entries out of the pool (a fused paged-attention kernel would read the blocks in place).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from astrai_core.inference.engine.block_manager import Slots
from astrai_core.inference.engine.packed import PackedLinear
from astrai_core.inference.engine.sequence import Sequence
from astrai_core.model.transformer import Block, Transformer


def token_shapes(model: Transformer) -> list[tuple[int, ...]]:
    """Per-token shape of each tensor one layer caches (KVCache's layout with the batch and time dims removed)."""
    cfg = model.cfg
    if cfg.attention == "mla":
        return [(cfg.mla_kv_rank,), (1, cfg.mla_rope_dim)]
    attn = model.layers[0].self_attn  # its own head count: a tensor-parallel rank holds n_kv_heads / tp of them
    return [(attn.n_kv_heads, cfg.head_dim), (attn.n_kv_heads, cfg.head_dim)]


def bytes_per_block(model: Transformer, block_size: int) -> int:
    dtype = next(model.parameters()).dtype
    per_token = sum(torch.Size(s).numel() for s in token_shapes(model)) * model.cfg.n_layers
    return per_token * block_size * dtype.itemsize


class KVPool:
    """The preallocated KV memory: per layer, one (num_blocks * block_size + 1, *shape) tensor per cached tensor.
    The last slot, `scratch`, takes the padding tokens' entries, so that a forward writes every (row, column)."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int) -> None:
        p = next(model.parameters())
        self.block_size, self.scratch = block_size, num_blocks * block_size
        self.layers = [[torch.zeros(num_blocks * block_size + 1, *shape, dtype=p.dtype, device=p.device)
                        for shape in token_shapes(model)] for _ in range(model.cfg.n_layers)]


class PagedCache:
    """The cache interface Transformer.forward expects (extend, length) over the pool, for one forward.

    write_slots: (B, T) the pool slot of each new token (padding: the scratch slot).
    read_slots: (B, S) the slot of each row's positions 0..S-1 (padding points at slot 0, masked out)."""

    def __init__(self, pool: KVPool, write_slots: torch.Tensor, read_slots: torch.Tensor) -> None:
        self.pool, self.write_slots, self.read_slots = pool, write_slots.flatten(), read_slots
        self.length = 0  # the model asserts length + T <= max_seq_len and adds T; positions come from the batch

    def extend(self, layer: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        B, S = self.read_slots.shape
        for stored, t in zip(self.pool.layers[layer], new):  # t: (B, *head dims, T, d)
            # .to: under autocast (GRPO's bf16 rollouts) the new entries come in bf16 to a pool of the weights' dtype
            stored.index_copy_(0, self.write_slots, t.movedim(-2, 1).flatten(0, 1).to(stored.dtype))
            # index_select on the flat slots, not stored[read_slots]: the same copy, about 6x faster on CPU
            # (a row memcpy instead of advanced indexing's element loop; measured 0.5 vs 3.3 ms at B=16, S=200).
            # No .contiguous() after the movedim: attention reads the strided view, and that copy took a third of
            # a 16-row decode step (torch.profiler).
            gathered = stored.index_select(0, self.read_slots.flatten()).view(B, S, *stored.shape[1:])
            out.append(gathered.movedim(1, -2))  # (B, *head dims, S, d)
        return tuple(out)


def load_graph(path: Path, example: tuple) -> Callable | None:
    """The graph saved at path, if there is one that torch can load, traced from the source code this process runs
    (each module it was traced through, as a whole), whose guards accept the example; else None."""
    try:
        with open(path, "rb") as f:
            graph = torch.compiler.load_compiled_function(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # another torch or Python, a truncated file: compiled again and saved over it
        print(f"astrai: not loading the compiled graph {path} ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
        return None
    for source in graph.source_info().inlined_sources:
        if inspect.getsource(importlib.import_module(source.module)) != source.content:
            return None
    return graph if graph.guard_check(*example) else None


# A compiled step runs the graph of its kind without evaluating the graph's guards (each graph was checked against
# them once, when built or loaded): every step's inputs meet them (run() keeps a single key eager), which
# tests/test_engine_compile.py checks with CHECK_GUARDS on (a step that does not raises RuntimeError).
CHECK_GUARDS = False

# warm_up saves each graph it compiles (torch.compile's aot_compile, torch.compiler.load_compiled_function) in this
# folder, None: beside inductor's own cache (TORCHINDUCTOR_CACHE_DIR, else /tmp/torchinductor_$USER), whose compiled
# kernels a saved graph loads (without them it compiles their C++ again); a later engine of the same model, dtype
# and pool loads them instead of tracing the model again. A graph saved from other source code is not loaded.
GRAPH_DIR: Path | None = None

# From this many layers, warm_up compiles one layer's code and reuses it for every layer (torch's nested compile
# regions) instead of one graph of every layer: the whole graph's compile time grows with the layers, while a
# region's call costs a step a little Python (inductor's C++ wrapper cannot call regions). Measured with the engine
# alone, 1 thread (bench/decode_step.py's profile, a fresh inductor cache; a fine-tune run beside all but the
# whole SmolLM2 graph): SmolLM2-135M (30 layers, bf16) whole 593 s cold, 28 s cached, a 1 / 4 / 16-row step 25.4 /
# 28.1 / 48.1 ms; regional 144 s, 33 s, 25.0 / 28.3 / 45.9 ms. The demo's model (4 layers, fp32) whole 60 s, 9.5 s, 0.27 / 0.38 /
# 1.06 ms; regional 76 s, 11 s, 0.45 / 0.46 / 0.88 ms: below this the whole graph stays.
REGIONAL_FROM_LAYERS = 12

# Batch invariance's padding (Runner): a CPU gemm gives a row the same bits whatever the number of rows from 16 rows
# up, and SDPA's math kernel a query the same bits from 16 queries and 16 keys up (masked keys add exact zeros);
# fewer rows go through other kernels, with another summation order. Measured on torch 2.13 (MKL/oneDNN, fp32):
# on an AVX-512 BF16 EPYC 4, 8 and >= 12 rows agreed; on a Xeon with AMX the rows that differ grow with the inner
# dimension (1 row at 32, up to 5 at 128, up to 15 from 384 to 2,048; SDPA's q @ k^T at head dim 128: up to 5
# queries). tests/test_engine.py checks these facts first.
MIN_QUERIES, MIN_KEYS = 16, 16


def blocks_as_regions(model: Transformer) -> None:
    """Make each of the model's Blocks a nested compile region for torch.compile: traced and compiled once, its code
    called by every layer, with the layer's weights and pool tensors as its inputs. Outside a trace the region only
    calls Block.forward (eager steps are unchanged). Set on the Blocks for good, not around warm_up: the compiled
    graphs' guards check that a Block's forward is still the region they were built from."""
    region = torch.compiler.nested_compile_region(Block.forward)
    region.__name__ = "forward"  # the traced guards look the method up on its Block by this name
    for layer in model.layers:
        layer.forward = types.MethodType(region, layer)


class DecodeBuffers:
    """A decode step's inputs (one new token per row), allocated once for each batch bucket (1, 2, 4, ... rows, up
    to the slots' count) and filled from the block manager's Slots by one index_select per tensor: no tensor is
    built from the sequences' lists. A batch is padded to its bucket with the padding slot (0 new tokens: it
    writes only the pool's scratch slot), so the compiled decode graph sees a few batch sizes only."""

    def __init__(self, slots: Slots) -> None:
        self.pad = slots.pad
        # Runner._forward's idx (B, 1), starts (B,), counts (B,) and tables (B, W), per slot: views of the arrays
        arrays = slots.next_token[:, None], slots.start, slots.count, slots.tables
        self.per_slot = [torch.from_numpy(a) for a in arrays]
        # per bucket of b rows: the batch's slots (b,), as numpy (written from Python) and as a tensor of the same
        # memory (the index), and the inputs they select
        self.buckets: dict[int, tuple[np.ndarray, torch.Tensor, list[torch.Tensor]]] = {}
        with torch.inference_mode():  # inference tensors, as run() builds and warm_up compiles for (a guard)
            for b in {min(2**i, self.pad) for i in range(self.pad.bit_length() + 1)}:
                rows = np.empty(b, dtype=np.int64)
                inputs = [torch.empty((b, *t.shape[1:]), dtype=t.dtype) for t in self.per_slot]
                self.buckets[b] = rows, torch.from_numpy(rows), inputs

    def fill(self, batch: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """The inputs of batch's rows, then padding rows up to the bucket (the bucket's buffers: valid until the
        next fill). The slots are written into a numpy array: a few us, against 3-20 for torch.tensor(list)."""
        bucket = min(2 ** (len(batch) - 1).bit_length(), self.pad)
        rows, rows_t, inputs = self.buckets[bucket]
        rows[:] = [s.slot for s, _ in batch] + [self.pad] * (bucket - len(batch))
        for per_slot, buffer in zip(self.per_slot, inputs):
            torch.index_select(per_slot, 0, rows_t, out=buffer)
        return inputs


def step_kind(idx: torch.Tensor) -> str:
    """The graph a step's (rows, new tokens) ids run: "decode" for one new token per row, else "prefill"."""
    return "prefill" if idx.shape[1] > 1 else "decode"


class Runner:
    """batch_invariant: every position's arithmetic is the same whatever else the forward computes: other rows,
    a decode or a prefill chunk (so chunk sizes, preemption and recompute, and prefix blocks computed by another
    request change no bit either). What it takes, each measured on this CPU (torch 2.13):
    * SDPA's math kernel: the CPU flash kernel splits a small batch's work across threads in a way that changes
      a row's rounding with the batch size; the math kernel computes each row alone;
    * at least MIN_QUERIES query positions per row (a decode gets 15 padding queries, never stored) and
      MIN_KEYS keys, so every gemm (batch x queries token rows in the linear layers, queries in attention) has
      rows enough to be row-invariant. The padding costs a decode step 16x its rows.
    * fp32 weights (Engine refuses others): bf16 gemms give a row other bits past 32 rows even at 16 queries a row
      (SmolLM2's widths, 1 and 2 threads, the Xeon with AMX).
    Not covered: MoE experts see as many rows as the batch routes to them. And generate() itself runs single
    rows (gemv) and SDPA's flash kernel, so the engine matches its tokens, not its last bits.
    Cost (bench/engine.py's small shape, 300 requests, 1 thread; bench/batch_invariant_padding_report.json): 4,248
    generated tokens/s against 8,593 without, and 5,866 with the earlier padding to 4 queries (bit-identical on the
    EPYC kind only); the math kernel's attention takes about 6x the flash kernel's time. Not cheap, so off by
    default: without it a request's tokens still equal generate()'s except at near-ties (bench/engine.py counts
    them)."""

    def __init__(self, model: Transformer, pool: KVPool, slots: Slots, batch_invariant: bool = False,
                 compile: bool = False) -> None:
        self.model, self.pool, self.batch_invariant = model, pool, batch_invariant
        self.device = next(model.parameters()).device
        self.decode_buffers = DecodeBuffers(slots)
        # EngineConfig.compile: decode steps and prefill chunks run _forward as torch.compile'd graphs (warm_up).
        self.compile = compile
        # the compiled graphs of _forward by kind of step ("decode", "prefill"), each added by warm_up once built,
        # and the seconds from warm_up's start to then
        self.graphs: dict[str, Callable] = {}
        self.graph_seconds: dict[str, float] = {}
        # not tried with experts (their routing's data-dependent shapes)
        self.regional = compile and model.cfg.n_layers >= REGIONAL_FROM_LAYERS and not model.cfg.n_experts

    def __getstate__(self) -> dict:
        """What pickling keeps of a Runner: torch pickles the step's inputs (this Runner among them) with a graph's
        saved guards, and the decode graph, built already when the prefill graph is traced, cannot be pickled."""
        return {**self.__dict__, "graphs": {}}

    def warm_up(self) -> None:
        """Build the graphs now, not in the first requests' steps (Engine calls it at construction, or on a thread
        of its own while the steps run eager): one for decode steps (1 new token per row) and one for prefill
        chunks (2 or more), each for any number of rows (unbacked: the same code for 1 row as for many), keys and
        block-table width (marked dynamic: a size of 1 would be a graph of its own, hence run()'s width of at least
        2 and its eager 1-key steps) and, for prefill, new tokens. Rows of 0 tokens write only the pool's scratch
        slot. Each graph is loaded from GRAPH_DIR when it was saved there for this model and source code, else
        traced, compiled and saved. A model of REGIONAL_FROM_LAYERS layers or more is traced with each Block as one
        nested compile region (not saved: torch 2.13 cannot load such a graph's guards). The decode graph comes
        first and steps use it as soon as it is built (from a background thread, while the prefill graph compiles):
        decode steps are most of a served request's time."""
        if not self.compile:
            return
        start = time.perf_counter()
        if self.regional:
            blocks_as_regions(self.model)
        # the guards torch can save (its own rule), less those that derive from one it cannot: a nested region's
        # pytree registry version
        from torch._dynamo.guards import CheckFunctionManager
        unsaved = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
        def saved_guards(entries):
            return [not (g.is_global or g.guard_type in unsaved or set(g.derived_guard_types or ()) & set(unsaved))
                    for g in entries]
        dev = self.device
        with torch.inference_mode():
            for kind, T in (("decode", 1), ("prefill", 3)):
                idx, starts, counts, tables = (torch.zeros(shape, dtype=torch.long, device=dev)  # distinct tensors:
                                               for shape in ((3, T), 3, 3, (3, 2)))  # one passed twice is a guard
                keys = torch.arange(5, device=dev)
                example = (self, idx, starts, counts, tables, keys)
                path = None if self.regional else self.graph_path(kind)
                graph = load_graph(path, example) if path else None  # its guards checked on unmarked tensors
                if graph is None:
                    for t in (idx, starts, counts, tables):
                        torch._dynamo.decorators.mark_unbacked(t, 0)
                    for t, dim in [(tables, 1), (keys, 0)] + ([(idx, 1)] if T > 1 else []):
                        torch._dynamo.mark_dynamic(t, dim)
                    # the decode graph's kernels called from C++, not from a Python wrapper (a 1-row step on the
                    # demo's shape: 0.41 against 0.50 ms, measured on 2 busy cores); the prefill graph's from Python,
                    # where its host time is a small part: a C++ wrapper compiles as one more file (about 4 s)
                    cpp = kind == "decode" and not self.regional
                    compiler = torch.compile(Runner._forward, fullgraph=True,  # a new dict: torch pops the filter
                                             options={"guard_filter_fn": saved_guards, "cpp_wrapper": cpp})
                    graph = compiler.aot_compile((example, {}))
                    if path:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        graph.save_compiled_function(str(path))
                graph(*example)
                graph.disable_guard_check()  # run() checks them when CHECK_GUARDS
                self.graphs[kind] = graph  # last: a step (maybe on another thread) takes it from its next one
                self.graph_seconds[kind] = round(time.perf_counter() - start, 1)

    def graph_path(self, kind: str) -> Path:
        """Where the graph of a kind of step is saved: named by what shapes it (torch, the model's configuration
        and dtype, the device, the pool's tensors, torch's threads: inductor's CPU kernels are built for a number
        of them; whether its projections are packed); the source code it was traced from is checked on loading."""
        packed = any(isinstance(m, PackedLinear) for m in self.model.modules())
        key = json.dumps([torch.__version__, self.model.cfg.model_dump(mode="json"), str(self.pool.layers[0][0].dtype),
                          self.device.type, [list(t.shape) for t in self.pool.layers[0]], self.pool.block_size, kind,
                          torch.get_num_threads(), packed])
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        folder = GRAPH_DIR or Path(cache_dir()) / "astrai_graphs"
        return folder / f"step-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt2"

    def compiled(self, idx: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, tables: torch.Tensor,
                 keys: torch.Tensor) -> torch.Tensor:
        """_forward through the graph of the step's kind."""
        graph = self.graphs[step_kind(idx)]
        if CHECK_GUARDS and not graph.guard_check(self, idx, starts, counts, tables, keys):
            raise RuntimeError(f"a step's inputs do not meet its graph's guards: rows {idx.shape[0]}, new tokens "
                               f"{idx.shape[1]}, keys {len(keys)}, table width {tables.shape[1]}")
        return graph(self, idx, starts, counts, tables, keys)

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]], every_position: bool = False) -> torch.Tensor:
        """Compute the next n tokens of each (seq, n) (its tokens[num_cached : num_cached + n]) and store their
        KV; -> (B, vocab) fp32 logits at each row's last computed position, or with every_position (for prompt
        logprobs) (B, T, vocab) fp32 logits at every position (row i's first n columns; the rest is padding)."""
        dev = self.device
        rows_out = len(batch)
        T = max(n for _, n in batch)
        if T == 1 and not self.batch_invariant:  # a decode step: the bucket's buffers, padded to its rows
            inputs = self.decode_buffers.fill(batch)
            S = int(inputs[1].max()) + 1  # the longest row's positions (starts + its 1 new token)
            idx, starts, counts, tables = inputs if dev.type == "cpu" else (t.to(dev) for t in inputs)
        else:
            idx, starts, counts, tables, S = self.prefill_inputs(batch, T)
        keys = torch.arange(max(S, MIN_KEYS) if self.batch_invariant else S, device=dev)
        # compiled once its kind's graph is built, but for a 1-token prompt's step (1 key: a graph of its own)
        if step_kind(idx) in self.graphs and S > 1:
            forward, mode = self.compiled, contextlib.nullcontext()
        else:
            forward = self._forward
            mode = sdpa_kernel(SDPBackend.MATH) if self.batch_invariant else contextlib.nullcontext()
        with mode:
            logits = forward(idx, starts, counts, tables, keys)
        if every_position:
            return logits[:rows_out].float()
        if T == 1:
            return logits[:rows_out, 0].float()
        return logits[torch.arange(rows_out, device=dev), counts[:rows_out] - 1].float()

    def prefill_inputs(self, batch: list[tuple[Sequence, int]], T: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """idx, starts, counts, tables and the key count S of a step of up to T new tokens per row (a prefill
        chunk, or any step when batch_invariant), built from the sequences' lists."""
        dev = self.device
        if self.batch_invariant:
            T = max(T, MIN_QUERIES)
        starts = [s.num_cached for s, _ in batch]
        counts = [n for _, n in batch]
        width = max(2, *(len(s.block_table) for s, _ in batch))  # 2: a width of 1 would be a 3rd graph
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s, _ in batch], device=dev)
        idx = torch.tensor([s.tokens_between(s.num_cached, s.num_cached + n) + [0] * (T - n) for s, n in batch],
                           device=dev)
        return (idx, torch.tensor(starts, device=dev), torch.tensor(counts, device=dev), tables,
                max(a + n for a, n in zip(starts, counts)))

    def _forward(self, idx: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, tables: torch.Tensor,
                 keys: torch.Tensor) -> torch.Tensor:
        """idx (B, T) new tokens (row i's first counts[i] real), starts (B,) positions cached, tables (B, W) block
        tables, keys arange(S) -> (B, T, vocab) logits in the model's dtype; stores the real tokens' KV."""
        bs = self.pool.block_size
        T = idx.shape[1]
        ends = starts + counts
        t = torch.arange(T, device=idx.device)
        real = t[None, :] < counts[:, None]  # (B, T) real new tokens
        positions = torch.where(real, starts[:, None] + t[None, :], 0)

        def slot(pos: torch.Tensor) -> torch.Tensor:
            return tables.gather(1, pos // bs) * bs + pos % bs

        write_slots = torch.where(real, slot(positions), self.pool.scratch)  # padding: the never-read scratch slot
        in_row = keys[None, :] < ends[:, None]  # (B, S) positions this row has
        read_slots = torch.where(in_row, slot(torch.where(in_row, keys[None, :], 0)), 0)
        # query (i, t) sees keys up to its own position; a padding query (position 0) sees key 0 only.
        mask = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # (B, 1, T, S)
        return self.model(idx, PagedCache(self.pool, write_slots, read_slots), positions=positions, mask=mask)
