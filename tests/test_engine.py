"""The serving engine (astrai_core/inference/engine): the block allocator and prefix cache on their own, then the engine
driven step by step (no thread, no HTTP) against astrai_core.inference.generate.generate on each request alone."""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.nn.functional as F

from astrai_core.inference.engine import Engine, EngineClient, EngineConfig, QueueFull, SamplingParams
from astrai_core.inference.engine.block_manager import BlockManager
from astrai_core.inference.engine.scheduler import Scheduler
from astrai_core.inference.engine.sequence import Sequence
from astrai_core.inference.generate import generate
from astrai_core.model.transformer import KVCache, Transformer
from conftest import Collector, sharp_random_model

VARIANTS = {
    "default": {},
    "mqa_qk_norm": {"n_kv_heads": 1, "qk_norm": True},
    "gated_bias_mha": {"attn_gate": True, "qkv_bias": True, "n_kv_heads": 4},
    "mla": {"attention": "mla", "mla_kv_rank": 16, "mla_rope_dim": 8},
    "moe": {"n_experts": 4, "n_shared_experts": 1, "moe_top_k": 2},
    "relu2_softcap": {"mlp": "relu2", "logit_softcap": 3.0},
    "value_embeds": {"value_embeds": True},
    "x0_scalars": {"x0_scalars": True},
    "deep": {"n_layers": 12},  # runner.REGIONAL_FROM_LAYERS: compiled one layer for all (tests/test_engine_compile.py)
}
SHAPE = {"vocab_size": 97, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread: on a busy 2-core machine, OpenMP threads spin-waiting for each other
    make a step of this size 20x slower. (platform_is_batch_invariant checks the kernels at 2 threads as well.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_for(name: str = "default") -> Transformer:
    model = sharp_random_model(**{**SHAPE, **VARIANTS[name]})
    with torch.no_grad():  # value_embeds' and x0_scalars' gates start at 0, where they would change nothing
        for p in model.parameters():
            if p.dim() == 0:
                p.fill_(0.7)
    return model


def prompts_for(n: int, seed: int = 0, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[Collector]:
    """Submit every prompt, then step until the engine is idle."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    out = [Collector() for _ in prompts]
    for p, sp, c in zip(prompts, params, out):
        engine.submit(p, sp, c)
    while engine.step():
        pass
    assert all(c.reasons for c in out)
    return out


def solo(model: Transformer, prompt: list[int], max_tokens: int) -> list[int]:
    return generate(model, prompt, max_tokens)


def capped(prompt: list[int], n: int, context: int = SHAPE["max_seq_len"]) -> int:
    return min(n, context - len(prompt))


def seq(tokens: list[int], max_tokens: int = 1) -> Sequence:
    return Sequence(0, tokens, greedy(max_tokens), lambda t, r: None)


# --- block manager ---------------------------------------------------------------------------------------------


def test_allocator_hands_out_distinct_blocks_and_takes_them_back():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_cache=False)
    a, b = seq(list(range(10))), seq(list(range(5)))
    assert bm.allocate(a) and a.block_table and len(a.block_table) == 3  # 10 tokens: 3 blocks of 4
    assert bm.allocate(b) and len(b.block_table) == 2
    assert len(set(a.block_table + b.block_table)) == 5 and bm.num_free == 3
    assert bm.grow(a, 16) and len(a.block_table) == 4 and bm.num_free == 2
    c = seq(list(range(13)))  # needs 4 blocks, 2 are free: refused, nothing taken
    assert not bm.allocate(c) and not c.block_table and bm.num_free == 2
    assert not bm.grow(b, 17) and len(b.block_table) == 2 and bm.num_free == 2
    bm.release(a)
    assert bm.num_free == 6 and not a.block_table
    assert [bm.ref_count[x] for x in range(8)].count(1) == 2  # only b's blocks are still referenced
    assert bm.allocate(c) and bm.num_free == 2


def test_each_running_sequence_slot_holds_its_block_table_next_token_and_position():
    """What a decode step copies (runner.DecodeBuffers): the slot's row of the block table (0 past its end), the
    token to compute next and its position, current as blocks are allocated, grown and released."""
    bm = BlockManager(num_blocks=8, block_size=4, prefix_cache=False, max_seqs=2, width=4)
    a, b = seq(list(range(10, 20))), seq([5, 6, 7])
    assert bm.allocate(a) and bm.allocate(b) and {a.slot, b.slot} == {0, 1}
    slots = bm.slots
    assert slots.tables[a.slot].tolist() == a.block_table + [0] and slots.tables[b.slot].tolist() == [3, 0, 0, 0]
    assert (slots.next_token[a.slot], slots.start[a.slot]) == (10, 0)  # nothing cached: its first token
    a.num_cached = 9  # a prefill computed all but its last token
    bm.track(a)
    assert (slots.next_token[a.slot], slots.start[a.slot]) == (19, 9)
    a.num_cached, a.output_ids = 10, [42]  # it computed that token and sampled 42
    bm.track(a)
    assert bm.grow(a, 13) and len(a.block_table) == 4 and slots.tables[a.slot].tolist() == a.block_table
    assert (slots.next_token[a.slot], slots.start[a.slot]) == (42, 10)
    assert slots.count.tolist() == [1, 1, 0]  # the last slot pads a batch: 0 new tokens
    slot = a.slot
    bm.release(a)
    assert a.slot is None and not slots.tables[slot].any()
    c = seq([1, 2])
    assert bm.allocate(c) and c.slot == slot


def test_equal_prefixes_share_full_blocks_through_the_hash_chain():
    bm = BlockManager(num_blocks=16, block_size=4)
    shared = list(range(100, 108))  # two full blocks
    a = seq(shared + [1, 2, 3])
    assert bm.allocate(a) and bm.hits == 0 and bm.queries == 2  # looked up, nothing cached yet
    a.num_cached = len(a)  # as if a prefill computed it
    bm.commit(a)
    assert len(a.block_hashes) == 2  # the partial third block is not hashed
    b = seq(shared + [9, 9, 9, 9, 9])
    assert bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached == 8 and bm.hits == 2 and bm.queries == 5  # its third full block [9, 9, 9, 9] missed
    assert [bm.ref_count[x] for x in a.block_table[:2]] == [2, 2]
    # The same second block after a different first block is another prefix: the chain does not match it.
    c = seq([7, 7, 7, 7] + shared[4:] + [1])
    assert bm.allocate(c) and c.num_cached == 0 and set(c.block_table).isdisjoint(a.block_table)
    # A prompt that is exactly cached full blocks still leaves its last token to compute (its logits are needed).
    d = seq(shared)
    assert bm.allocate(d) and d.num_cached == 4 and d.block_table[0] == a.block_table[0]
    bm.release(a)
    assert [bm.ref_count[x] for x in b.block_table[:2]] == [2, 1]  # b and d still hold them


def test_released_cached_blocks_are_evicted_least_recently_used_and_only_when_needed():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = seq([1, 2, 3, 4]), seq([5, 6, 7, 8])
    for s in (a, b):
        assert bm.allocate(s)
        s.num_cached = 4
        bm.commit(s)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.release(a)  # a first: its blocks are the least recently used
    bm.release(b)
    assert bm.num_free == 4 and bm.num_used == 0 and len(bm.lru) == 4 and not bm.free
    c = seq([1, 2, 9])  # hits a's first block (reviving it from the LRU list), needs one new block
    assert bm.allocate(c) and c.block_table[0] == a_blocks[0] and bm.hits == 1
    evicted = a_blocks[1]  # the oldest unreferenced cached block: a's tail (released tail first)
    assert c.block_table[1] == evicted and bm.block_hash[evicted] is None
    assert len(bm.hash_to_block) == 3  # b's two blocks and a's head are still cached
    d = seq([5, 6, 7, 8, 0])  # b's blocks are still there: both hit
    assert bm.allocate(d) is False  # 3 blocks needed, 2 cached and revivable but no third block left
    assert bm.hits == 1 and len(bm.lru) == 2  # a refused allocation changes nothing
    bm.release(c)
    assert bm.allocate(d) and d.block_table[:2] == b_blocks and d.num_cached == 4


def test_without_prefix_cache_nothing_is_shared_or_counted():
    bm = BlockManager(num_blocks=8, block_size=2, prefix_cache=False)
    a = seq([1, 2, 3, 4, 5])
    assert bm.allocate(a)
    a.num_cached = 5
    bm.commit(a)
    b = seq([1, 2, 3, 4, 6])
    assert bm.allocate(b) and b.num_cached == 0 and set(a.block_table).isdisjoint(b.block_table)
    assert bm.hits == bm.queries == 0 and not bm.hash_to_block


# --- the engine against generate() -----------------------------------------------------------------------------


def test_the_pool_holds_each_sequence_kv_at_the_slots_of_its_block_table():
    model = model_for()
    engine = Engine(model, EngineConfig(kv_blocks=32, block_size=4, prefill_chunk=8, prefix_cache=False))
    prompts = [[5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 14], [50, 8, 95]]
    for p in prompts:
        engine.submit(p, greedy(20), Collector())
    for _ in range(3):  # 11 tokens in chunks of 8 then a decode; 3 tokens then two decodes
        engine.step()
    running = engine.scheduler.running
    assert [s.num_cached for s in running] == [12, 5]
    assert set(running[0].block_table).isdisjoint(running[1].block_table)
    for s in running:
        cache = KVCache()
        with torch.no_grad():
            model(torch.tensor([s.tokens[:s.num_cached]]), cache)
        slots = torch.tensor([s.block_table[i // 4] * 4 + i % 4 for i in range(s.num_cached)])
        for layer, stored in enumerate(engine.runner.pool.layers):
            for pool, expected in zip(stored, cache.layers[layer]):
                got = pool[slots].movedim(0, -2)  # (*head dims, S, d) as the cache holds it
                torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_concurrent_requests_equal_solo_generate(name):
    """Requests of different lengths sharing the batch (more than fit at once, so some wait, and a shared prefix
    so the prefix cache hits) each get what generate() gives it alone."""
    model = model_for(name)
    prompts = prompts_for(10, seed=1)
    prompts += [prompts[0][:9] + [1, 2, 3], prompts[1] + [4]]  # prefix-cache hits
    params = [greedy(capped(p, 12)) for p in prompts]
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4, prefill_chunk=16, max_batch_size=6))
    out = run(engine, prompts, params)
    for p, sp, c in zip(prompts, params, out):
        assert c.tokens == solo(model, p, sp.max_tokens), p
        assert c.reasons == ["length"]
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["requests_finished_total"] == len(prompts)
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["generated_tokens_total"] == sum(sp.max_tokens for sp in params)
    assert stats["prompt_tokens_total"] == sum(map(len, prompts)) and stats["ttft_seconds_count"] == len(prompts)


def test_chunked_prefill_equals_unchunked_and_solo():
    model = model_for()
    prompts = prompts_for(6, seed=2, longest=50)
    params = [greedy(capped(p, 10)) for p in prompts]
    outs = {}
    for chunk in (3, 8, 64):
        engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4, prefill_chunk=chunk, prefix_cache=False))
        outs[chunk] = [c.tokens for c in run(engine, prompts, params)]
    assert outs[3] == outs[8] == outs[64] == [solo(model, p, sp.max_tokens) for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_recomputes_and_outputs_are_unchanged(prefix_cache):
    """A pool of 20 blocks of 4 tokens (80 positions; the context is 64) for 8 requests that grow to 50-64
    tokens: decodes run out of blocks, the newest requests are preempted and recomputed later."""
    model = model_for()
    prompts = [p + [1] * (30 - len(p)) for p in prompts_for(8, seed=3, longest=30)]
    params = [greedy(20 + i) for i in range(8)]
    engine = Engine(model, EngineConfig(kv_blocks=20, block_size=4, prefill_chunk=8, max_batch_size=8,
                                        prefix_cache=prefix_cache))
    out = run(engine, prompts, params)
    assert engine.stats()["preemptions_total"] > 0
    for p, sp, c in zip(prompts, params, out):
        assert c.tokens == solo(model, p, sp.max_tokens)
        assert c.reasons == ["length"]
    assert engine.stats()["kv_blocks_used"] == 0


def platform_is_batch_invariant() -> bool:
    """The facts the engine's batch invariance rests on, measured on this machine's CPU kernels with 1 and 2
    threads: a gemm gives a row the same bits for any count of 16 rows or more (at inner dimensions from 24 to
    2,048: the rows that differ grow with it on some CPUs), and SDPA's math kernel computes each batch row on its
    own and a query the same bits among 16 or more, with 16 keys or more (its flash kernel does not with 2
    threads). 16 is the facts' number, not read from the engine (runner.MIN_QUERIES), so an engine that pads less
    fails the tests rather than skipping them."""
    threads = torch.get_num_threads()
    try:
        return all(torch.set_num_threads(n) or kernels_are_row_invariant() for n in (1, 2))
    finally:
        torch.set_num_threads(threads)


def kernels_are_row_invariant() -> bool:
    torch.manual_seed(0)
    for inner in (24, 128, 512, 2048):
        w, x = torch.randn(40, inner), torch.randn(80, inner)
        full = F.linear(x, w)
        if not all(torch.equal(F.linear(x[a:a + m], w), full[a:a + m]) for m in range(16, 60)
                   for a in (0, 3, 17)):
            return False
    for head_dim in (8, 128):
        q, k, v = (torch.randn(3, 4, 64, head_dim) for _ in range(3))

        def attend(rows: slice, first: int, queries: int, keys: int) -> torch.Tensor:
            pos = torch.arange(first, first + queries)
            mask = (torch.arange(keys) <= pos[:, None]).expand(rows.stop - rows.start, 1, queries, keys)
            return F.scaled_dot_product_attention(q[rows, :, first:first + queries], k[rows, :, :keys],
                                                  v[rows, :, :keys], attn_mask=mask)

        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            full = attend(slice(0, 3), 0, 64, 64)
            if not all(torch.equal(attend(slice(r, r + 1), a, n, s)[0], full[r, :, a:a + n])
                       for r in (0, 2) for a, n, s in ((0, 16, 16), (5, 16, 24), (9, 17, 40),
                                                       (20, 16, 48), (30, 34, 64))):
                return False
    return True


def logits_trace(monkeypatch) -> dict[int, list[torch.Tensor]]:
    """Record the logits each request samples from."""
    trace: dict[int, list[torch.Tensor]] = {}
    post = Scheduler.postprocess

    def recording(self, batch, logits, every=None):
        for i, (s, n) in enumerate(batch):
            if s.num_cached + n == len(s):
                trace.setdefault(s.id, []).append(logits[i].clone())
        return post(self, batch, logits, every)

    monkeypatch.setattr(Scheduler, "postprocess", recording)
    return trace


@pytest.mark.parametrize("name", ["default", "mqa_qk_norm", "mla"])
def test_batch_invariant_mode_gives_bit_identical_logits_whatever_shares_the_batch(name, monkeypatch):
    """batch_invariant=True: not only the same tokens: the same logits, to the bit, alone or among others, whatever the chunk size,
    across preemption and recompute, with prefix blocks another request computed. (MoE is left out: its experts
    see as many rows as the batch routes to them; bench/engine.py measures it.)"""
    if not platform_is_batch_invariant():
        pytest.skip("this CPU's gemm/SDPA kernels lack the row invariance measured on torch 2.13 x86")
    model = model_for(name)
    trace = logits_trace(monkeypatch)
    prompts = [p + [1] * (30 - len(p)) for p in prompts_for(8, seed=3, longest=30)]
    prompts += [prompts[0][:12] + [5, 6], prompts[1] + [7, 8, 9]]  # prefix-cache hits
    params = [greedy(14 + 2 * i) for i in range(len(prompts))]
    engine = Engine(model, EngineConfig(kv_blocks=20, block_size=4, prefill_chunk=8, max_batch_size=10,
                                        batch_invariant=True))
    run(engine, prompts, params)
    assert engine.stats()["preemptions_total"] > 0 and engine.stats()["prefix_cache_hits"] > 0
    together = [trace.pop(i) for i in range(len(prompts))]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        run(Engine(model, EngineConfig(kv_blocks=32, block_size=4, prefill_chunk=64, batch_invariant=True)), [p], sp)
        alone = trace.pop(0)
        assert all(torch.equal(a, b) for a, b in zip(alone, together[i], strict=True)), f"request {i}"


def test_batch_invariance_holds_at_a_published_models_widths_with_fp32_weights_only(monkeypatch):
    """At SmolLM2-135M's widths (dim 576, MLP 1,536, 9 / 3 heads) and up to 10 requests decoding together (160
    query rows a step): each request's logits equal its run alone, to the bit, in fp32. bf16 gemms give a row other
    bits past 32 rows (all 8 requests differed when the engine allowed it), so the engine refuses bf16 weights."""
    if not platform_is_batch_invariant():
        pytest.skip("this CPU's gemm/SDPA kernels lack the row invariance measured on torch 2.13 x86")
    model = sharp_random_model(**{**SHAPE, "dim": 576, "n_heads": 9, "n_kv_heads": 3, "ffn_dim": 1536})
    trace = logits_trace(monkeypatch)
    prompts = [p + [1] * (30 - len(p)) for p in prompts_for(8, seed=3, longest=30)]
    params = [greedy(14 + 2 * i) for i in range(len(prompts))]
    engine = Engine(model, EngineConfig(kv_blocks=200, block_size=4, prefill_chunk=8, max_batch_size=10,
                                        batch_invariant=True))
    run(engine, prompts, params)
    together = [trace.pop(i) for i in range(len(prompts))]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        run(Engine(model, EngineConfig(kv_blocks=32, block_size=4, batch_invariant=True)), [p], sp)
        assert all(torch.equal(a, b) for a, b in zip(trace.pop(0), together[i], strict=True)), f"request {i}"
    with pytest.raises(ValueError, match="batch_invariant needs fp32 weights, not bfloat16"):
        Engine(model.to(torch.bfloat16), EngineConfig(kv_blocks=32, block_size=4, batch_invariant=True))


def test_padding_rows_of_a_decode_bucket_change_no_token_or_logprob():
    """A decode step pads its batch to the next bucket (5 rows to 8, 3 to 4) with rows of 0 new tokens that write
    only the pool's scratch slot: each request's tokens and logprobs, greedy and seeded, equal its run alone (1
    row, no padding; the logprobs within rounding: other row counts take other gemm kernels), and greedy tokens
    generate()'s."""
    model = model_for()
    prompts = [[5 + i, *p] for i, p in enumerate(prompts_for(5, seed=12))]  # no token 0 first (padding's token)
    params = [greedy(6 + 2 * i, logprobs=2) if i % 2 else
              SamplingParams(max_tokens=6 + 2 * i, temperature=0.8, seed=300 + i, logprobs=2) for i in range(5)]
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4))
    decodes, forward = [], engine.runner._forward

    def recording(idx, starts, counts, tables, keys):
        if idx.shape[1] == 1:
            decodes.append((len(engine.scheduler.running), idx.shape[0]))
        return forward(idx, starts, counts, tables, keys)

    engine.runner._forward = recording
    together = run(engine, prompts, params)
    assert (5, 8) in decodes and (3, 4) in decodes  # (requests decoding, rows computed)
    for p, sp, c in zip(prompts, params, together):
        alone = run(Engine(model, EngineConfig(kv_blocks=128, block_size=4)), [p], sp)[0]
        assert c.tokens == alone.tokens and len(c.tokens) == sp.max_tokens
        assert [e.token for e in c.logprobs] == [e.token for e in alone.logprobs]
        assert torch.allclose(torch.tensor([e.logprob for e in c.logprobs]),
                              torch.tensor([e.logprob for e in alone.logprobs]), atol=1e-5)
        if sp.temperature == 0:
            assert c.tokens == solo(model, p, sp.max_tokens)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch():
    model = model_for()
    prompts = prompts_for(5, seed=5)
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=100 + i) for i in range(5)]
    together = [c.tokens for c in run(Engine(model, EngineConfig(kv_blocks=128, block_size=4)), prompts, params)]
    alone = [run(Engine(model, EngineConfig(kv_blocks=128, block_size=4)), [p], sp)[0].tokens
             for p, sp in zip(prompts, params)]
    assert together == alone
    assert together[0] == generate(model, prompts[0], 10, temperature=1.0, top_p=0.9,
                                   generator=torch.Generator().manual_seed(100))  # the same sampler and draws
    other_seed = run(Engine(model, EngineConfig(kv_blocks=128, block_size=4)), [prompts[0]],
                     SamplingParams(max_tokens=10, temperature=1.0, seed=7))[0].tokens
    assert other_seed != together[0]


def test_greedy_and_sampled_requests_in_one_batch_equal_their_solo_runs():
    """The scheduler samples every row in one call, each with its own temperature, top-k, top-p and seed: each
    row keeps its tokens, as when it runs alone."""
    model = model_for()
    prompts = prompts_for(6, seed=9)
    params = [greedy(10) if i % 2 else SamplingParams(max_tokens=10, temperature=0.5 + i / 4, top_k=(None, 20, 3)[i // 2],
                                                    top_p=(1.0, 0.9, 0.5)[i // 2], seed=200 + i) for i in range(6)]
    together = [c.tokens for c in run(Engine(model, EngineConfig(kv_blocks=128, block_size=4)), prompts, params)]
    alone = [run(Engine(model, EngineConfig(kv_blocks=128, block_size=4)), [p], sp)[0].tokens
             for p, sp in zip(prompts, params)]
    assert together == alone
    assert together[1] == generate(model, prompts[1], 10)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU's oneDNN has no bf16 kernels: "
                    "the engine does not pack (can_pack is False), tested by the next test")
@pytest.mark.parametrize("name", ["default", "gated_bias_mha"])
def test_prepacked_bf16_projections_give_the_same_tokens_and_logprobs_bit_for_bit(name):
    """EngineConfig.pack_weights: every nn.Linear of a bf16 model (the tied head too, with its bias where it has one)
    runs oneDNN's linear on a prepacked weight; the tokens and logprobs, greedy and seeded, equal the plain engine's
    exactly."""
    import copy

    from astrai_core.inference.engine.packed import PackedLinear

    model = model_for(name).to(torch.bfloat16)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    packed_model = copy.deepcopy(model)
    prompts = prompts_for(4, seed=21)
    params = [greedy(8, logprobs=2, prompt_logprobs=2) if i % 2 else
              SamplingParams(max_tokens=8, temperature=0.9, seed=50 + i, logprobs=2) for i in range(4)]
    plain = run(Engine(model, EngineConfig(kv_blocks=128, block_size=4)), prompts, params)
    engine = Engine(packed_model, EngineConfig(kv_blocks=128, block_size=4, pack_weights=True))
    assert engine.stats()["packed_linears"] == linears > 0
    assert sum(isinstance(m, PackedLinear) for m in packed_model.modules()) == linears
    assert packed_model.lm_head.weight is packed_model.embed_tokens.weight  # still one tensor
    packed = run(engine, prompts, params)
    for a, b in zip(plain, packed):
        assert a.tokens == b.tokens
        assert [e and (e.token, e.logprob, e.top) for e in a.logprobs] == \
               [e and (e.token, e.logprob, e.top) for e in b.logprobs]


def test_weights_are_packed_only_when_asked_and_only_bf16():
    """Off by default (a training policy's weights change under the engine); an fp32 model is never packed."""
    assert Engine(model_for(), EngineConfig(kv_blocks=128, pack_weights=True)).stats()["packed_linears"] == 0
    bf16 = model_for().to(torch.bfloat16)
    assert Engine(bf16, EngineConfig(kv_blocks=128)).stats()["packed_linears"] == 0
    assert not any(type(m).__name__ == "PackedLinear" for m in bf16.modules())


# --- logprobs ---------------------------------------------------------------------------------------------------


def reference_logprobs(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """(len(tokens) - 1,) log p(tokens[t] | tokens[:t]) for t >= 1, from one plain forward over the whole sequence."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tokens])).float()[0], dim=-1)
    return logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]


def with_logprobs(max_tokens: int, k: int = 3) -> SamplingParams:
    return greedy(max_tokens, logprobs=k, prompt_logprobs=k)


@pytest.mark.parametrize("chunk", [5, 64])
def test_prompt_and_sampled_logprobs_equal_a_plain_forward(chunk):
    """Prompt logprobs across prefill chunks (the prompt's first token has none), then each greedy token's, equal
    log_softmax of one forward over prompt + reply; the top-1 at a sampled position is the sampled token. The same
    prompt cached by an earlier request is not reused (its positions would have no logits)."""
    model = model_for()
    prompt = prompts_for(1, seed=11, longest=40)[0] + [3] * 20
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4, prefill_chunk=chunk))
    run(engine, [prompt], greedy(1))  # fills the prefix cache with this prompt's blocks
    hits = engine.stats()["prefix_cache_hits"]
    out = run(engine, [prompt], with_logprobs(6))[0]
    assert engine.stats()["prefix_cache_hits"] == hits
    assert out.tokens == solo(model, prompt, 6) and out.reasons == ["length"]
    entries = out.logprobs
    assert len(entries) == len(prompt) + 6 and entries[0] is None
    assert [e.token for e in entries[1:]] == prompt[1:] + out.tokens
    expected = reference_logprobs(model, prompt + out.tokens)
    assert torch.allclose(torch.tensor([e.logprob for e in entries[1:]]), expected, atol=1e-5)
    for e in entries[1:]:
        assert len(e.top) == 3 and [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
    for e in entries[len(prompt):]:
        assert e.top[0][0] == e.token and e.top[0][1] == e.logprob  # greedy: the chosen token is the most likely


def test_max_tokens_0_gives_the_prompt_logprobs_only():
    model = model_for()
    prompt = [5, 17, 3, 88, 9]
    out = run(Engine(model, EngineConfig(kv_blocks=32, block_size=4)), [prompt], greedy(0, prompt_logprobs=0))[0]
    assert out.tokens == [] and out.reasons == ["length"]
    assert out.logprobs[0] is None and [e.token for e in out.logprobs[1:]] == prompt[1:]
    assert all(e.top == () for e in out.logprobs[1:])
    assert torch.allclose(torch.tensor([e.logprob for e in out.logprobs[1:]]), reference_logprobs(model, prompt),
                          atol=1e-5)
    one = run(Engine(model, EngineConfig(kv_blocks=32, block_size=4)), [[7]], greedy(0, prompt_logprobs=2))[0]
    assert one.logprobs == [None] and one.tokens == []


def test_the_stop_token_has_its_logprob_though_it_is_not_sent():
    model = model_for()
    prompt = [5, 17, 3, 88]
    stop = solo(model, prompt, 12)[5]
    out = run(Engine(model, EngineConfig(kv_blocks=32, block_size=4)), [prompt],
              greedy(12, stop_token_ids=(stop,), logprobs=1))[0]
    assert out.reasons == ["stop"] and stop not in out.tokens
    assert [e.token for e in out.logprobs] == out.tokens + [stop]


def test_logprobs_survive_preemption_and_equal_the_request_alone_bit_for_bit():
    """batch_invariant: a request's prompt and token logprobs are the same bits among others (preempted and
    recomputed, in other chunks) as alone; without it they agree within rounding."""
    model = model_for()
    prompts = [p + [1] * (30 - len(p)) for p in prompts_for(8, seed=3, longest=30)]
    params = [with_logprobs(20 + i, k=2) for i in range(8)]
    for invariant in (True, False):
        engine = Engine(model, EngineConfig(kv_blocks=20, block_size=4, prefill_chunk=8, max_batch_size=8,
                                            batch_invariant=invariant))
        together = run(engine, prompts, params)
        assert engine.stats()["preemptions_total"] > 0
        for p, sp, c in zip(prompts, params, together):
            alone = run(Engine(model, EngineConfig(kv_blocks=32, block_size=4, batch_invariant=invariant)), [p], sp)[0]
            assert len(c.logprobs) == len(alone.logprobs) == len(p) + sp.max_tokens
            if invariant and platform_is_batch_invariant():
                assert c.logprobs == alone.logprobs
            else:
                assert c.tokens == alone.tokens
                assert torch.allclose(torch.tensor([e.logprob for e in c.logprobs[1:]]),
                                      torch.tensor([e.logprob for e in alone.logprobs[1:]]), atol=1e-5)


def test_bad_logprobs_params_raise():
    with pytest.raises(ValueError, match="logprobs"):
        greedy(1, logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        greedy(1, prompt_logprobs=-2)
    with pytest.raises(ValueError, match="max_tokens"):
        greedy(0, logprobs=1)  # 0 tokens needs prompt_logprobs


# --- finishing ---------------------------------------------------------------------------------------------------


def test_stop_token_ends_the_request_and_is_not_sent():
    model = model_for()
    prompt = [5, 17, 3, 88]
    free = solo(model, prompt, 12)
    stop = free[5]
    first = free.index(stop)
    c = run(Engine(model, EngineConfig(kv_blocks=64, block_size=4)), [prompt], greedy(12, stop_token_ids=(stop,)))[0]
    assert c.tokens == free[:first] and c.reasons == ["stop"]
    assert generate(model, prompt, 12, stop_ids=[stop]) == free[:first + 1]  # generate includes it


def test_a_request_ends_with_length_at_the_context():
    model = model_for()
    prompt = list(range(1, 61))  # 60 of the 64 positions
    engine = Engine(model, EngineConfig(kv_blocks=64, block_size=4))
    c = run(engine, [prompt], greedy(100))[0]
    assert c.tokens == solo(model, prompt, 4) and c.reasons == ["length"]
    assert engine.stats()["generated_tokens_total"] == 4


def test_cancel_finishes_the_request_and_frees_its_blocks():
    model = model_for()
    engine = Engine(model, EngineConfig(kv_blocks=64, block_size=4, prefix_cache=False))
    keep, drop = Collector(), Collector()
    engine.submit([1, 2, 3, 4, 5], greedy(30), keep)
    req = engine.submit(list(range(10, 40)), greedy(30), drop)
    for _ in range(4):
        engine.step()
    used = engine.stats()["kv_blocks_used"]
    assert engine.stats()["running"] == 2 and drop.tokens
    engine.cancel(req)
    engine.step()
    assert drop.reasons == ["cancelled"] and engine.stats()["running"] == 1
    assert engine.stats()["kv_blocks_used"] < used - 6  # its 8+ blocks are back
    engine.cancel(req)  # cancelling a finished request does nothing
    waiting = engine.submit([7, 7], greedy(5), Collector())
    engine.cancel(waiting)  # cancelled before it ever ran
    while engine.step():
        pass
    assert keep.reasons == ["length"] and len(keep.tokens) == 30
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["requests_finished_total"] == 3


def test_bad_requests_raise():
    model = model_for()
    engine = Engine(model, EngineConfig(kv_blocks=64, block_size=4, max_waiting=2))
    assert isinstance(engine, EngineClient)  # the interface serving is typed with
    with pytest.raises(ValueError, match="prompt has 64 tokens; the context is 64"):
        engine.submit(list(range(64)), greedy(1), Collector())
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\): got 3..97"):
        engine.submit([3, 97], greedy(1), Collector())
    with pytest.raises(ValueError, match="no tokens"):
        engine.submit([], greedy(1), Collector())
    with pytest.raises(ValueError, match="max_tokens"):
        greedy(0)
    engine.submit([1], greedy(1), Collector())
    engine.submit([2], greedy(1), Collector())
    with pytest.raises(QueueFull):
        engine.submit([3], greedy(1), Collector())
    with pytest.raises(ValueError, match="must hold at least one full context"):
        Engine(model, EngineConfig(kv_blocks=15, block_size=4))


# --- the loop thread ---------------------------------------------------------------------------------------------


def test_the_thread_serves_requests_submitted_from_other_threads():
    model = model_for()
    prompts = prompts_for(6, seed=6)
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4))
    engine.start()
    out = [Collector() for _ in prompts]
    threads = [threading.Thread(target=engine.submit, args=(p, greedy(capped(p, 8)), c)) for p, c in zip(prompts, out)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(c.done.wait(60) for c in out)
    engine.stop()
    assert engine.alive
    assert [c.tokens for c in out] == [solo(model, p, capped(p, 8)) for p in prompts]


def test_the_loop_calls_after_step_once_per_step_after_its_events():
    """Serving's relay wakes the event loop from after_step: every event must be followed by a call, and one call
    must cover a whole step's events (one per running request), not one event each."""
    model = model_for()
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4))
    log: list[str] = []
    out = [Collector() for _ in range(4)]
    for p, c in zip(prompts_for(4, seed=9), out):
        engine.submit(p, greedy(6), lambda ids, finish, c=c: (log.append("event"), c(ids, finish)))
    engine.after_step.append(lambda: log.append("flush"))
    engine.start()
    assert all(c.done.wait(60) for c in out)
    engine.stop()
    assert log[-1] == "flush"
    runs = [len(run) for run in "".join("e" if x == "event" else "|" for x in log).split("|") if run]
    assert max(runs) == 4 and all(c.reasons == ["length"] for c in out)


def test_a_dying_loop_finishes_every_request_with_error_and_alive_turns_false(monkeypatch):
    model = model_for()
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4))
    real_run, calls = engine.runner.run, []

    def failing_run(batch):
        calls.append(len(batch))
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", failing_run)
    out = [Collector() for _ in range(3)]
    for p, c in zip([[1, 2, 3], [4, 5], [6]], out):
        engine.submit(p, greedy(20), c)
    flushes = []
    engine.after_step.append(lambda: flushes.append(sum(len(c.reasons) for c in out)))
    engine.start()
    assert all(c.done.wait(60) for c in out)
    engine.stop()
    assert flushes[-1] == 3  # the crash's last events were flushed too (serving would wait on them forever)
    assert [c.reasons for c in out] == [["error"]] * 3 and not engine.alive
    assert engine.stats()["kv_blocks_used"] == 0
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.submit([1], greedy(1), Collector())


def test_a_request_finished_in_the_failing_step_keeps_its_finish_reason(monkeypatch):
    model = model_for()
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4))
    first = Collector()
    engine.submit([1, 2, 3], greedy(2), first)
    engine.step()  # prefilled, one token out: the next decode finishes it
    real_run = engine.runner.run

    def failing_prefill(batch):
        if any(n > 1 for _, n in batch):
            raise RuntimeError("injected failure")
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", failing_prefill)
    second = Collector()
    engine.submit(list(range(10, 30)), greedy(5), second)
    engine.start()  # one step: the decode finishes `first`, then the prefill of `second` fails
    assert second.done.wait(60)
    engine.stop()
    assert first.reasons == ["length"] and len(first.tokens) == 2 and second.reasons == ["error"]


def test_a_slice_of_a_sequences_tokens_equals_the_slice_of_all_of_them():
    """Sequence.tokens_between (what a step reads: one token of a long context) against tokens[a:b], across the
    prompt / output boundary."""
    seq = Sequence(0, [5, 6, 7, 8], greedy(4), lambda *a: None, output_ids=[1, 2, 3])
    for a in range(8):
        for b in range(a, 8):
            assert seq.tokens_between(a, b) == seq.tokens[a:b], (a, b)


def test_max_model_len_bounds_a_request_and_lets_a_small_pool_serve():
    """EngineConfig.max_model_len: a pool smaller than the model's context is accepted when it holds max_model_len
    tokens; a request ends with "length" there, and a longer prompt is refused."""
    model = model_for()
    with pytest.raises(ValueError, match="must hold at least one full context"):
        Engine(model, EngineConfig(kv_blocks=2, block_size=4))  # 8 tokens < the model's 64
    engine = Engine(model, EngineConfig(kv_blocks=2, block_size=4, max_model_len=8))
    out = run(engine, [[5, 17, 3]], greedy(20))[0]
    assert len(out.tokens) == 5 and out.reasons == ["length"]  # 3 + 5 = max_model_len
    with pytest.raises(ValueError, match="the context is 8"):
        engine.submit(list(range(1, 9)), greedy(1), lambda *a: None)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=1)
