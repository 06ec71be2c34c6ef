"""EngineConfig(compile=True): decode steps and prefill chunks run as torch.compile'd graphs, compiled when the
engine is built. The requests' greedy tokens equal generate()'s alone, their logprobs a plain forward's within 1e-4,
nothing compiles again once the engine serves, and only a step over a single key runs the eager forward. One engine per variant for the
module: compiling takes a minute or so on a busy 2-core CPU."""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.utils import counters

from astrai_core.inference.engine import Engine, EngineConfig, runner
from test_engine import capped, greedy, model_for, one_thread, prompts_for, reference_logprobs, run, solo  # noqa: F401

# moe: its routing has data-dependent shapes (one graph all the same: aot_compile needs fullgraph); deep: enough layers to compile one for all
VARIANTS = ["default", "moe", "deep"]
CAPTURED: dict[int, int] = {}  # per engine (id): the calls torch's tracer put in its graphs


@pytest.fixture(scope="module", autouse=True)
def graph_dir(tmp_path_factory):
    """Graphs saved for this module only: each variant is traced here (not loaded from an earlier run's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "GRAPH_DIR", tmp_path_factory.mktemp("graphs"))
        yield runner.GRAPH_DIR


@pytest.fixture(scope="module", params=VARIANTS)
def compiled(request):
    torch.set_num_threads(1)
    model = model_for(request.param)
    before = counters["stats"]["calls_captured"]
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4, prefill_chunk=16, max_batch_size=6,
                                        compile=True))
    CAPTURED[id(engine)] = counters["stats"]["calls_captured"] - before
    return model, engine


@pytest.mark.parametrize("guards", ["evaluated", "skipped"])
def test_compiled_steps_equal_generate_and_meet_their_graphs_guards(compiled, guards, monkeypatch):
    """Batches of 1 to 6 rows (more requests than fit, so the batch grows and shrinks), prefill chunks of 2 to 16
    tokens, one-token prompts among them, tables of one to several blocks: tokens equal generate() alone, every
    step's inputs meeting the guards of its kind's graph (checked: runner.CHECK_GUARDS on; a step that does not
    raises), and equal them again as served (guards not checked)."""
    model, engine = compiled
    monkeypatch.setattr(runner, "CHECK_GUARDS", guards == "evaluated")
    eager_calls = []
    eager = engine.runner._forward
    monkeypatch.setattr(engine.runner, "_forward", lambda *a: eager_calls.append((a[0].shape[1], len(a[4]))) or eager(*a))
    prompts = [[7], *prompts_for(9, seed=3)]
    params = [greedy(capped(p, 20)) for p in prompts]
    alone = run(engine, prompts[1:2], params[1])  # a batch of one row
    first = run(engine, prompts[:1], greedy(3))  # a 1-token prompt alone: its first step has 1 key
    out = run(engine, prompts, params)
    assert alone[0].tokens == solo(model, prompts[1], params[1].max_tokens)
    assert first[0].tokens == solo(model, prompts[0], 3)
    for p, sp, c in zip(prompts, params, out):
        assert c.tokens == solo(model, p, sp.max_tokens), p
    # the eager forward ran only steps over a single key (a 1-token prompt's first, alone): never a decode over
    # more keys, never a prefill chunk of 2 or more tokens
    assert eager_calls and all(keys == 1 for T, keys in eager_calls), eager_calls


def test_decode_steps_run_their_graph_while_the_prefill_graph_is_still_building(compiled, monkeypatch):
    """warm_up builds the decode graph first and steps use it at once: with only that graph built, decode steps
    (of more than one key) run it and prefill chunks the eager forward; tokens equal generate() alone."""
    model, engine = compiled
    if engine.runner.regional or engine.model.cfg.n_experts:
        pytest.skip("one variant is enough")
    monkeypatch.setattr(engine.runner, "graphs", {"decode": engine.runner.graphs["decode"]})
    calls: dict[str, list[tuple[int, int]]] = {"eager": [], "compiled": []}
    for name, attr in (("eager", "_forward"), ("compiled", "compiled")):
        fn = getattr(engine.runner, attr)
        monkeypatch.setattr(engine.runner, attr, lambda *a, fn=fn, name=name: calls[name].append(
            (a[0].shape[1], len(a[4]))) or fn(*a))
    prompts = prompts_for(5, seed=8)
    params = [greedy(capped(p, 12)) for p in prompts]
    for p, sp, c in zip(prompts, params, run(engine, prompts, params)):
        assert c.tokens == solo(model, p, sp.max_tokens), p
    assert calls["compiled"] and all(T == 1 for T, _ in calls["compiled"]), calls["compiled"]
    assert any(T > 1 for T, _ in calls["eager"]) and all(T > 1 or keys == 1 for T, keys in calls["eager"])


def test_compiled_logprobs_equal_a_plain_forward_within_1e_4(compiled):
    model, engine = compiled
    prompt = prompts_for(1, seed=11, longest=30)[0] + [3] * 10
    out = run(engine, [prompt], greedy(8, logprobs=2, prompt_logprobs=2))[0]
    assert out.tokens == solo(model, prompt, 8)
    expected = reference_logprobs(model, prompt + out.tokens)
    got = torch.tensor([e.logprob for e in out.logprobs[1:]])
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_a_deep_model_compiles_one_layer_for_all_its_layers(compiled):
    """From runner.REGIONAL_FROM_LAYERS layers, every Block is one nested compile region, traced once: each of the
    two graphs calls the region per layer (about 6 captured calls per layer) instead of holding every layer's
    operations (about 78 per layer); below it, one graph of every operation (inductor's C++ wrapper)."""
    model, engine = compiled
    per_layer = CAPTURED[id(engine)] / (2 * model.cfg.n_layers)
    assert per_layer > 1, per_layer  # traced (not run eager after a limit of torch's)
    if model.cfg.n_layers >= runner.REGIONAL_FROM_LAYERS:
        assert per_layer < 10, per_layer
    else:
        assert per_layer > 30, per_layer


def test_a_second_engine_loads_the_saved_graphs_unless_their_source_changed(tmp_path, monkeypatch, capfd):
    """warm_up saves the two graphs it compiles; a second engine of the same model and pool loads them (traces
    nothing) and its greedy tokens equal generate()'s. A graph traced through source code that has changed since
    (one of its modules edited: here the model's, as inspect reads it), or a file torch cannot read, is compiled
    again."""
    torch.set_num_threads(1)
    monkeypatch.setattr(runner, "GRAPH_DIR", tmp_path)
    model = model_for("default")
    config = EngineConfig(kv_blocks=64, block_size=4, prefill_chunk=16, max_batch_size=4, compile=True)

    def traced_by_a_new_engine():
        before = counters["stats"]["calls_captured"]
        engine = Engine(model, config)
        return counters["stats"]["calls_captured"] - before, engine

    traced, _ = traced_by_a_new_engine()
    saved = sorted(tmp_path.glob("step-*.pt2"))
    assert traced > 0 and len(saved) == 2, (traced, saved)
    traced, engine = traced_by_a_new_engine()
    assert traced == 0
    prompts = prompts_for(5, seed=8)
    params = [greedy(capped(p, 12)) for p in prompts]
    for p, sp, c in zip(prompts, params, run(engine, prompts, params)):
        assert c.tokens == solo(model, p, sp.max_tokens), p

    getsource = runner.inspect.getsource
    edited = "astrai_core.model.transformer"
    monkeypatch.setattr(runner.inspect, "getsource",
                        lambda m: getsource(m) + ("# edited\n" if m.__name__ == edited else ""))
    assert traced_by_a_new_engine()[0] > 0
    monkeypatch.setattr(runner.inspect, "getsource", getsource)
    saved[0].write_bytes(b"not a graph")
    assert traced_by_a_new_engine()[0] > 0
    assert f"not loading the compiled graph {saved[0]}" in capfd.readouterr().err


def test_compile_and_batch_invariant_cannot_be_combined():
    with pytest.raises(ValueError, match="compile and batch_invariant"):
        EngineConfig(compile=True, batch_invariant=True)


def test_steps_run_eager_while_the_graphs_compile_in_the_background_then_compiled(monkeypatch):
    """compile_in_background (what `astrai serve` does by default): the engine answers at once with eager steps
    while another thread builds the graphs, then runs them; greedy tokens equal generate() alone throughout."""
    torch.set_num_threads(1)
    model = model_for("default")
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4, prefill_chunk=16, max_batch_size=6,
                                        compile=True, compile_in_background=True))
    assert engine.stats()["compile_seconds"] is None and not engine.runner.graphs  # building
    prompts = prompts_for(6, seed=4)
    params = [greedy(capped(p, 20)) for p in prompts]
    while_compiling = run(engine, prompts, params)
    deadline = time.monotonic() + 600
    while engine.stats()["compile_seconds"] is None:
        assert time.monotonic() < deadline, "the graphs were not built in 600 s"
        time.sleep(0.5)
    assert engine.runner.graph_seconds["decode"] <= engine.runner.graph_seconds["prefill"]  # decode's first
    compiled_calls = []
    graphs = engine.runner.compiled
    monkeypatch.setattr(engine.runner, "compiled", lambda *a: compiled_calls.append(1) or graphs(*a))
    after = run(engine, prompts, params)
    assert compiled_calls, "the steps did not switch to the compiled graphs"
    for p, sp, a, b in zip(prompts, params, while_compiling, after):
        assert a.tokens == b.tokens == solo(model, p, sp.max_tokens), p


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU's oneDNN has no bf16 kernels: "
                    "nothing is packed")
@pytest.mark.parametrize("name", ["default", "deep"])
def test_compiled_graphs_call_the_prepacked_projections(name):
    """With pack_weights, the compiled graphs (one graph with a C++ wrapper; one layer's region for all of a deep
    model's) call the packed projections (astrai::packed_linear, a custom op inductor leaves as it is): a bf16
    model's greedy tokens equal the compiled engine's without packing (not the eager engine's: compiled bf16 keeps
    fused intermediates in fp32, and the deep model's tokens part from eager's at a near-tie)."""
    import copy

    torch.set_num_threads(1)
    model = model_for(name).to(torch.bfloat16)
    config = EngineConfig(kv_blocks=128, block_size=4, prefill_chunk=16, max_batch_size=6, compile=True)
    prompts = prompts_for(6, seed=4)
    params = [greedy(capped(p, 12)) for p in prompts]
    plain = run(Engine(copy.deepcopy(model), config), prompts, params)
    engine = Engine(model, EngineConfig(**{**config.__dict__, "pack_weights": True}))
    assert engine.stats()["packed_linears"] > 0 and set(engine.runner.graphs) == {"decode", "prefill"}
    assert [c.tokens for c in run(engine, prompts, params)] == [c.tokens for c in plain]
