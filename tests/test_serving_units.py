"""The parts of serving/ that need no app and no model: TextStream, the error shapes, the key check and who must
have a key, the alias watch's start, the engine events' way to the event loop (EventRelay) and into text pieces
(run_generation). The HTTP behaviour of the whole is tested in test_serve_api.py, against a real `astrai serve`."""

from __future__ import annotations

import asyncio
import random
import re
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram
from tokenizers import pre_tokenizers

from serving.auth import Hosts, check_exposure, check_host, check_json, check_key, check_origin
from serving.errors import ApiError, error_body
from serving.model import AliasWatch
from serving.protocol.validate import lone_surrogate
from serving.streaming import EventRelay, Finish, run_generation
from serving.text_stream import TextStream


# --- TextStream: what may be given out while streaming -----------------------------------------------------------

def test_text_stream_holds_back_a_possible_stop_string(data_tokenizer):
    tok = data_tokenizer
    ids = tok.encode("the king loves café 中文 and the night", add_special_tokens=False).ids
    stream = TextStream(tok, ["the ni", "zzz"])
    pieces = [stream.add([i]) for i in ids]
    assert "".join(pieces) == "the king loves café 中文 and " and stream.stop_sequence == "the ni"
    # A suffix that could still become a stop string is held back, then released when it does not.
    stream = TextStream(tok, ["king!"])
    assert stream.add(tok.encode("the king", add_special_tokens=False).ids) == "the "
    assert stream.add(tok.encode(" loves", add_special_tokens=False).ids) == "king loves"
    assert stream.add([], final=True) == "" and stream.stop_sequence is None
    # At the end, held-back text that never became a stop string goes out.
    stream = TextStream(tok, ["king!"])
    assert stream.add(tok.encode("the king", add_special_tokens=False).ids, final=True) == "the king"


def test_text_stream_never_emits_a_broken_character(data_tokenizer):
    tok = data_tokenizer
    # The byte-level alphabet has a token per byte: feed 中 (3 UTF-8 bytes) one byte at a time.
    (mapped, _), = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str("中")
    byte_ids = [tok.token_to_id(ch) for ch in mapped]
    assert len(byte_ids) == 3 and tok.decode(byte_ids) == "中"
    stream = TextStream(tok, [])
    assert [stream.add([t]) for t in byte_ids + byte_ids[:1]] == ["", "", "中", ""]
    assert stream.add([], final=True) == "\ufffd"  # an incomplete character at the very end is flushed as such


def test_text_stream_pieces_add_up_to_the_whole_decode(data_tokenizer):
    """Random token ids (byte tokens that split characters, special tokens, merges), fed in pieces of 1-3: what
    goes out is always a prefix of the whole reply's decode, and at the end it is all of it."""
    tok = data_tokenizer
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randint(1, 60))]
        whole = tok.decode(ids)
        stream, out, i = TextStream(tok, []), "", 0
        while i < len(ids):
            n = rng.randint(1, 3)
            out += stream.add(ids[i:i + n], final=i + n >= len(ids))
            i += n
            assert whole.startswith(out), (ids, out, whole)
        assert out == whole, ids


# --- errors and the key ---------------------------------------------------------------------------------------------

def test_error_body_takes_the_shape_of_the_routes_protocol():
    assert error_body("/v1/chat/completions", 404, "no such model", param="model") == {"error": {
        "message": "no such model", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert error_body("/v1/messages", 404, "no such model", param="model") == {
        "type": "error", "error": {"type": "not_found_error", "message": "no such model"}}
    # Statuses without a type of their own: the protocol's generic server error.
    assert error_body("/v1/completions", 499, "gone")["error"]["type"] == "server_error"
    assert error_body("/v1/messages", 499, "gone")["error"]["type"] == "api_error"


def test_lone_surrogate_names_the_path_of_the_first_bad_string():
    assert lone_surrogate({"model": "m", "messages": [{"role": "user", "content": "ok"}]}) is None
    assert lone_surrogate({"messages": [{"content": "ok"}, {"content": "a\ud800"}]}) == "messages.1.content"
    assert lone_surrogate({"metadata": {"\udfff": 1}}) == "metadata"  # a bad key: the object holding it
    assert lone_surrogate("\ud800") == "body"


def test_check_key_takes_either_header_and_nothing_else():
    check_key({}, None)  # no key set: open
    check_key({"authorization": "bearer k-1"}, "k-1")  # the scheme's case does not matter
    check_key({"x-api-key": "k-1"}, "k-1")
    for headers in ({}, {"authorization": "Bearer k-2"}, {"authorization": "k-1"}, {"x-api-key": ""}):
        with pytest.raises(ApiError) as e:
            check_key(headers, "k-1")
        assert e.value.status == 401, headers


def test_host_origin_and_content_type_checks():
    loopback, proxied, everywhere = Hosts("127.0.0.1"), Hosts("127.0.0.1", ("Proxy.Example",)), Hosts("0.0.0.0")
    for host in ("127.0.0.1:8000", "localhost", "LOCALHOST:1", "a.localhost", "[::1]:8000", "127.9.9.9"):
        check_host({"host": host}, loopback)
    check_host({}, loopback)  # no Host (HTTP/1.0): no browser sent it
    for host in ("evil.example:8000", "10.0.0.5:8000", "localhost.evil.example", "", "[bad"):
        with pytest.raises(ApiError) as e:
            check_host({"host": host}, loopback)
        assert e.value.status == 403 and "--allowed-host" in e.value.message
    check_host({"host": "proxy.example"}, proxied)
    check_host({"host": "10.0.0.5:8000"}, everywhere)  # bound to every address: any of them
    with pytest.raises(ApiError):
        check_host({"host": "evil.example"}, everywhere)
    check_origin({"host": "127.0.0.1:8000"}, loopback)  # not a browser
    check_origin({"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:8000"}, loopback)  # the chat page
    check_origin({"host": "127.0.0.1:8000", "origin": "https://proxy.example"}, proxied)
    for origin in ("http://evil.example", "null", "http://127.0.0.1:9999", "http://localhost:8000"):
        with pytest.raises(ApiError) as e:
            check_origin({"host": "127.0.0.1:8000", "origin": origin}, loopback)
        assert e.value.status == 403
    check_json({"content-type": "application/json; charset=utf-8"})
    for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        with pytest.raises(ApiError) as e:
            check_json(headers)
        assert e.value.status == 415


def test_a_server_other_machines_reach_needs_a_key_or_insecure():
    """check_exposure: what `astrai serve` refuses before anything loads (the one-line errors: test_serve_api.py)."""
    for host in ("127.0.0.1", "127.9.9.9", "localhost", "::1"):  # loopback: no key needed
        assert check_exposure(host, None, False, ()) is None
    assert check_exposure("127.0.0.1", "", False, ()) is None  # an empty ASTRAI_API_KEY is no key
    for host in ("0.0.0.0", "::", "10.0.0.5", "my-host"):
        with pytest.raises(ValueError, match=f"^--host {re.escape(host)} is reachable from other machines"):
            check_exposure(host, "", False, ())
        assert check_exposure(host, "k-1", False, ()) == "k-1" and check_exposure(host, None, True, ()) is None
    with pytest.raises(ValueError, match="^--api-key .*printable ASCII"):
        check_exposure("0.0.0.0", "clé", False, ())
    with pytest.raises(ValueError, match="^--api-key"):
        check_exposure("127.0.0.1", "a key", False, ())
    assert check_exposure("127.0.0.1", None, False, ("proxy.example", "*", "[::1]", "10.0.0.5")) is None
    for bad in ("http://proxy.example", "proxy.example:8080", "a/b", ""):
        with pytest.raises(ValueError, match=f"^--allowed-host {re.escape(repr(bad))}: expected a host name"):
            check_exposure("127.0.0.1", None, False, ("ok.example", bad))


def test_an_alias_watch_only_for_a_model_named_by_alias():
    watch = AliasWatch.started_by("models:/astrai@champion", "astrai/3")
    assert (watch.name, watch.alias, watch.version, watch.points_to) == ("astrai", "champion", "3", "3")
    for reference in ("models:/astrai/3", "data/sft", "runs:/abc/model", ""):
        assert AliasWatch.started_by(reference, "astrai/3") is None, reference


def test_launch_polls_the_alias_only_when_named_by_one_and_asked_to(monkeypatch):
    """launch.serve builds the watch from the --model reference; --alias-poll 0 means no watch and no polling."""
    from types import SimpleNamespace

    from astrai_core.inference.engine import EngineConfig
    from serving import launch

    apps, polled = [], []
    monkeypatch.setattr(launch, "create_app", lambda *args, watch, **kwargs: apps.append(watch))
    monkeypatch.setattr(launch, "follow_alias", lambda watch, look_up, every: polled.append((watch, every)))
    monkeypatch.setattr(launch, "run", lambda *args: 0)
    monkeypatch.setattr(launch, "threading", SimpleNamespace(Thread=lambda target, args, **kwargs: SimpleNamespace(
        start=lambda: target(*args))))  # the poller's thread, run at once
    engine = SimpleNamespace(config=EngineConfig(), stats=lambda: {"compile_seconds": None, "kv_blocks_total": 8,
                                                                    "weights_dtype": "float32", "packed_linears": 0},
                             start=lambda: None, stop=lambda: None)
    for reference, poll in (("models:/astrai@champion", 0.5), ("models:/astrai@champion", 0), ("models:/astrai/3", 1)):
        apps.clear(), polled.clear()
        assert launch.serve(engine, None, "astrai/3", (), host="127.0.0.1", port=1, api_key=None, allowed_hosts=(),
                            device="cpu", threads=(1, "test"), dtype_why="test", reference=reference, look_up=None, alias_poll=poll) == 0
        if poll and "@" in reference:
            assert apps[0].alias == "champion" and polled == [(apps[0], poll)]
        else:
            assert apps == [None] and polled == [], (reference, poll)


# --- engine events to the event loop, and to text -----------------------------------------------------------------

def test_event_relay_wakes_the_loop_once_per_flush_however_many_events():
    async def run() -> tuple[int, int, list, list]:
        loop = asyncio.get_running_loop()
        wakeups, schedule = [], loop.call_soon_threadsafe
        relay, a, b = EventRelay(), asyncio.Queue(), asyncio.Queue()
        loop.call_soon_threadsafe = lambda fn, *args: (fn == relay._deliver and wakeups.append(args)) or schedule(fn, *args)

        def engine_step() -> None:  # one step's events, put while the loop runs freely, then the step's flush
            for i in range(50):
                for q in (a, b):
                    relay.put(loop, q, i)
                time.sleep(0.0005)  # let the loop run between events, as it does on another core

        await asyncio.to_thread(engine_step)
        before_flush = a.qsize() + b.qsize()
        relay.flush()
        for _ in range(100):
            if a.qsize() == b.qsize() == 50:
                break
            await asyncio.sleep(0)
        return len(wakeups), before_flush, [a.get_nowait() for _ in range(50)], [b.get_nowait() for _ in range(50)]

    wakeups, before_flush, got_a, got_b = asyncio.run(run())
    assert before_flush == 0 and wakeups == 1 and got_a == got_b == list(range(50))


class ScriptedSubmission:
    """Stands in for streaming.Submission: replays (token ids, finish) events as the engine would send them."""

    def __init__(self, events: list[tuple[list[int], str | None]]) -> None:
        self.events, self.done, self.cancelled = list(events), False, False

    async def next_event(self) -> tuple[list[int], str | None]:
        return self.events.pop(0)

    def cancel(self) -> None:
        if not self.done:
            self.done, self.cancelled = True, True


def _generate(tok, events, stops=()) -> tuple[list, ScriptedSubmission, float]:
    sub = ScriptedSubmission(events)
    registry = CollectorRegistry()
    ttft = Histogram("ttft_seconds", "", registry=registry)

    async def run() -> list:
        return [item async for item in run_generation(sub, TextStream(tok, stops), ttft, 0.0)]

    try:
        return asyncio.run(run()), sub, registry.get_sample_value("ttft_seconds_count")
    except ApiError as e:
        return [e], sub, registry.get_sample_value("ttft_seconds_count")


def test_run_generation_counts_the_stop_token_and_cancels_on_a_stop_string(data_tokenizer):
    tok = data_tokenizer
    ids = tok.encode("the king loves the night", add_special_tokens=False).ids
    # The engine ends the turn: its stop token is not passed on, but counts as generated.
    items, sub, firsts = _generate(tok, [([i], None) for i in ids] + [([], "stop")])
    assert "".join(items[:-1]) == "the king loves the night" and items[-1] == Finish("stop", None, len(ids) + 1)
    assert not sub.cancelled and firsts == 1
    # A stop string ends the reply while the engine still runs it: the request is cancelled.
    items, sub, _ = _generate(tok, [([i], None) for i in ids] + [([], "length")], stops=["loves"])
    assert "".join(items[:-1]) == "the king " and items[-1].stop_sequence == "loves" and sub.cancelled
    # An engine failure is a 500 for the route to render, and it counts no first token.
    (error,), _, firsts = _generate(tok, [([], "error")])
    assert isinstance(error, ApiError) and error.status == 500 and firsts == 0


def test_auto_threads_give_a_large_model_every_core_and_a_small_one_all_but_the_event_loops(monkeypatch):
    from serving.launch import ALL_CORES_FROM_PARAMS, torch_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    large, small = ALL_CORES_FROM_PARAMS, ALL_CORES_FROM_PARAMS - 1
    assert torch_threads("auto", large, engine_process=True) == (2, "2 core(s), all of them for a model of 60M "
                                                                     "parameters")
    assert torch_threads("auto", small, engine_process=True) == (1, "2 core(s), one left for the event loop")
    assert torch_threads("auto", large, engine_process=False)[0] == 1  # the engine thread shares the GIL
    assert torch_threads("3", small, engine_process=True) == (3, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert torch_threads("auto", small, engine_process=True) == (4, "OMP_NUM_THREADS")
    with pytest.raises(ValueError, match="--threads two: expected auto or a number"):
        torch_threads("two", large, engine_process=True)
