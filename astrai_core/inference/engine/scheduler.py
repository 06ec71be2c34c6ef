"""Continuous batching: which sequences run in the next forward, and what happens to them afterwards.

Each step: admit waiting sequences (first come, first served) while the batch has room and the pool has blocks
for their whole prompt; give every running sequence its next piece of work (a chunk of at most prefill_chunk
prompt tokens while it fills, one token while it decodes), growing its block table as it goes; after the forward,
sample for the sequences whose prompt is complete and retire the finished ones at once. When a decode needs a
block and none is free, the newest running sequence is preempted: its blocks are released and it goes back to
the front of the queue, to be recomputed (cheaply, from the prefix cache when its blocks survive) later.
"""

from __future__ import annotations

from collections import deque

import torch

from astrai_core.inference.engine.block_manager import BlockManager
from astrai_core.inference.engine.sequence import Sequence, Status, TokenLogprob
from astrai_core.inference.sampling import sample_rows


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, prefill_chunk: int, context_length: int) -> None:
        self.blocks = blocks
        self.max_batch_size, self.prefill_chunk, self.context_length = max_batch_size, prefill_chunk, context_length
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Admit what fits, then (seq, tokens to compute) for every running sequence."""
        while self.waiting and len(self.running) < self.max_batch_size and self.blocks.allocate(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
        batch = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted in this loop, to make room for an older sequence
                continue
            n = min(seq.num_to_compute, self.prefill_chunk)
            while not self.blocks.grow(seq, seq.num_cached + n):
                self.preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    break
            else:
                batch.append((seq, n))
        return [(s, n) for s, n in batch if s.status is Status.RUNNING]

    def preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def postprocess(self, batch: list[tuple[Sequence, int]], logits: torch.Tensor,
                    every: torch.Tensor | None = None) -> list[Sequence]:
        """Account for the computed tokens, sample where a prompt is complete, and return the finished sequences
        (already out of the batch, blocks released); seq.output_ids grows by the sampled tokens,
        seq.pending_logprobs by the logprobs asked for, and the slot of each that goes on by what it computes next
        (BlockManager.track). every: the logits at every computed position (Runner.run's
        every_position), needed for the rows that compute more than one prompt token with prompt_logprobs."""
        for i, (seq, n) in enumerate(batch):
            if seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt_ids):
                assert n == 1 or every is not None, "prompt logprobs need the logits of every position"
                add_prompt_logprobs(seq, n, logits[i:i + 1] if n == 1 else every[i, :n])
            seq.num_cached += n
            self.blocks.commit(seq)
        # The rows whose prompt is complete sample, all in one call and one host read (a seeded row draws only
        # here, so chunked prefill or a recompute after preemption never shifts its draws).
        rows = [i for i, (seq, _) in enumerate(batch) if not seq.num_to_compute and seq.params.max_tokens > 0]
        picked = logits if len(rows) == len(batch) else logits[rows]
        params = [batch[i][0].params for i in rows]
        tokens = sample_rows(picked, [p.temperature for p in params], [p.top_k for p in params],
                             [p.top_p for p in params], [batch[i][0].generator for i in rows]).tolist() if rows else []
        asked = [j for j, p in enumerate(params) if p.logprobs is not None]
        logprobs = dict(zip(asked, token_logprobs(picked[asked], [tokens[j] for j in asked],
                                                  [params[j].logprobs for j in asked]))) if asked else {}
        sampled = dict(zip(rows, range(len(rows))))
        finished = []
        for i, (seq, _) in enumerate(batch):
            if seq.num_to_compute:  # more of the prompt to fill
                self.blocks.track(seq)
                continue
            p = seq.params
            if i not in sampled:  # max_tokens 0: the prompt's logprobs were all it asked for
                seq.finish_reason = "length"
            else:
                j = sampled[i]
                seq.output_ids.append(tokens[j])
                if j in logprobs:
                    seq.pending_logprobs.append(logprobs[j])
                if tokens[j] in p.stop_token_ids:
                    seq.finish_reason = "stop"
                elif len(seq.output_ids) >= p.max_tokens or len(seq) >= self.context_length:
                    seq.finish_reason = "length"
            if seq.finish_reason is not None:
                self.finish(seq)
                finished.append(seq)
            else:
                self.blocks.track(seq)  # its next step computes the token just sampled
        return finished

    def finish(self, seq: Sequence) -> None:
        """Take seq out of the queue or the batch and release its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED


def token_logprobs(logits: torch.Tensor, targets: list[int], k: int | list[int]) -> list[TokenLogprob]:
    """(N, vocab) logits of N positions -> the log-probability of each position's target token, with the k most
    likely tokens there (k: one for all positions, or one each). One host read for all positions. log_softmax
    works on each row alone, so a row's values do not depend on the others."""
    ks = k if isinstance(k, list) else [k] * len(targets)
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(targets)), torch.tensor(targets)].tolist()
    if max(ks) == 0:
        return [TokenLogprob(t, lp, ()) for t, lp in zip(targets, chosen)]
    values, ids = (x.tolist() for x in logp.topk(min(max(ks), logp.shape[-1]), dim=-1))
    return [TokenLogprob(t, lp, tuple(zip(i[:n], v[:n]))) for t, lp, i, v, n in zip(targets, chosen, ids, values, ks)]


def add_prompt_logprobs(seq: Sequence, n: int, logits: torch.Tensor) -> None:
    """Extend seq.prompt_logprobs with what this step's n positions (logits: (n, vocab)) predict of the prompt:
    position j predicts token j + 1. Once the prompt is complete they are queued to be sent (with the first
    sampled token, if any). A sequence recomputed after preemption has its entries already: none are added twice."""
    prompt, start, have = seq.prompt_ids, seq.num_cached, len(seq.prompt_logprobs)
    if have == 0:
        seq.prompt_logprobs.append(None)  # nothing predicts the first token
        have = 1
    last = min(start + n, len(prompt) - 1)  # the last prompt token this step predicts
    assert have >= start + 1, "prompt positions were skipped (a cached prefix?)"
    if last >= have:
        rows = logits[have - 1 - start:last - start]
        seq.prompt_logprobs += token_logprobs(rows, prompt[have:last + 1], seq.params.prompt_logprobs)
    if len(seq.prompt_logprobs) == len(prompt):
        seq.pending_logprobs = list(seq.prompt_logprobs) + seq.pending_logprobs
