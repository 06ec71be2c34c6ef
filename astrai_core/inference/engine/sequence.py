"""One request as the engine sees it: its tokens, sampling parameters, status and where its KV entries live.

The tokens are prompt_ids + output_ids. The first `num_cached` of them have their keys/values in the block pool
(block_table[i] holds positions i * block_size ... (i + 1) * block_size - 1); the rest still have to be computed:
the prompt's tail while prefilling, or the one token sampled last while decoding. A preempted sequence drops
its blocks (num_cached = 0) and keeps its tokens, so it recomputes them later and carries on where it stopped.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int  # new tokens at most (finish_reason "length" when reached)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None  # a per-request torch.Generator; None: the global generator (nondeterministic)
    stop_token_ids: tuple[int, ...] = ()  # ends the request with "stop"; the token itself is not sent, but counted
    # Log-probabilities (on_event's third argument, see OnEvent): `logprobs` for each sampled token, with the
    # `logprobs` most likely tokens at its position; `prompt_logprobs` the same for each prompt token (the first has
    # none). Both from the model's raw distribution, before temperature, top-k or top-p. None: not computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1 and not (self.max_tokens == 0 and self.prompt_logprobs is not None):
            raise ValueError(f"max_tokens ({self.max_tokens}) must be at least 1 (0 only with prompt_logprobs: "
                             f"the prompt's logprobs and nothing generated)")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature ({self.temperature}) must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p ({self.top_p}) must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k ({self.top_k}) must be at least 1")


class Status(enum.Enum):
    WAITING = "waiting"  # in the queue: no blocks (new, or preempted)
    RUNNING = "running"  # in the batch: prefilling (several tokens to compute) or decoding (one)
    FINISHED = "finished"


class TokenLogprob(NamedTuple):
    """A token's log-probability at its position, and the `k` most likely tokens there (most likely first)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


# on_event(new_token_ids, finish_reason): finish_reason is None until the last call. A request that asked for
# logprobs or prompt_logprobs gets a third argument, the logprobs of the positions this event covers, in order: the
# prompt's (the first event: None for its first token) when asked, then each token sampled this step, a stop token
# included (which new_token_ids does not carry). Requests that asked for neither get the two arguments only.
OnEvent = Callable[..., None]


@dataclass(eq=False)
class Sequence:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    on_event: OnEvent
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hash of each full block in block_table
    num_cached: int = 0
    slot: int | None = None  # its row in the block manager's Slots while it holds blocks
    finish_reason: str | None = None
    closed: bool = False  # its last event (with the finish reason) has been sent
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    generator: torch.Generator | None = None  # seeded per request, on the logits' device (set by Engine.submit)
    # params.prompt_logprobs: the prompt tokens' entries so far ([None] for the first token, then one per token as
    # prefill computes them); logprobs not yet sent with an event
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list (a decode step needs one token of a long context)."""
        P = len(self.prompt_ids)
        if end <= P:
            return self.prompt_ids[start:end]
        if start >= P:
            return self.output_ids[start - P:end - P]
        return self.prompt_ids[start:] + self.output_ids[:end - P]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_to_compute(self) -> int:
        """Tokens whose KV is not in the pool yet: 1 while decoding, more while (re)filling."""
        return len(self) - self.num_cached
