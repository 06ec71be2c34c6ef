"""serving/streaming.py's Submission on a real Engine stepped by hand: the events that have arrived when the event
loop looks go out together, in order, and an error event still ends the request after the tokens before it."""

from __future__ import annotations

import asyncio

import torch

from astrai_core.engine import Engine, EngineConfig, SamplingParams
from astrai_core.generate import generate
from serving.streaming import EventRelay, Submission
from test_engine import model_for


def test_events_queued_behind_the_next_one_come_out_together():
    torch.set_num_threads(1)
    model = model_for()
    engine = Engine(model, EngineConfig(kv_blocks=32, block_size=4))
    prompt = [5, 17, 3, 88]

    async def run() -> list[tuple[list[int], str | None]]:
        relay = EventRelay()  # flushed by hand after the steps, as the engine loop does after each
        sub = Submission(engine, prompt, SamplingParams(max_tokens=6, temperature=0), relay)
        got = []
        for steps in (1, 3, 2):  # the engine runs ahead: 1 token, then 3, then the last 2 with the finish
            for _ in range(steps):
                engine.step()
                relay.flush()
            await asyncio.sleep(0)  # the loop runs the relay's deliveries
            got.append(await sub.next_event())
        return got

    got = asyncio.run(run())
    expected = generate(model, prompt, 6)
    assert got == [(expected[:1], None), (expected[1:4], None), (expected[4:], "length")]


def test_an_error_after_queued_tokens_comes_after_them():
    torch.set_num_threads(1)
    engine = Engine(model_for(), EngineConfig(kv_blocks=32, block_size=4))

    async def run() -> list[tuple[list[int], str | None]]:
        relay = EventRelay()  # flushed by hand after the steps, as the engine loop does after each
        sub = Submission(engine, [5, 17, 3], SamplingParams(max_tokens=6, temperature=0), relay)
        for _ in range(2):
            engine.step()
        engine._die(RuntimeError("boom"))  # what the loop does when a step raises
        relay.flush()
        await asyncio.sleep(0)
        return [await sub.next_event(), await sub.next_event()]

    tokens, error = asyncio.run(run())
    assert len(tokens[0]) == 2 and tokens[1] is None and error == ([], "error")
