"""grpo: completions sampled from the policy, scored by reward functions, learned from group-relative advantages."""

from __future__ import annotations

import contextlib
import json
import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from astrai_core.data.batches import Batch, IndexSampler, pad_rows, row_targets
from astrai_core.model.losses import IGNORE_INDEX, group_advantages, grpo_token_loss, token_logps
from astrai_core.model.transformer import Transformer
from astrai_core.runtime.device import DataGroup
from astrai_core.runtime.errors import AstraiError
from astrai_core.training.strategies.base import BaseStrategy, frozen_copy

if TYPE_CHECKING:
    from astrai_core.training.config import TrainConfig


class Group(NamedTuple):
    """One prompt's rollouts: its tokens, group_size completions and their rewards."""

    prompt: list[int]
    completions: list[list[int]]
    rewards: torch.Tensor  # (group_size,); a failed reward reads 0
    failed: bool  # some reward raised or was not finite (on_reward_error: skip): the group gets zero advantage
    spread: float  # the rewards' sample std: 0 when they are all equal (no signal)


def keep_groups(signal: np.ndarray, n: int) -> np.ndarray:
    """Indices (ascending) of the n groups to train on out of those sampled: the first n that carry a signal
    (rewards that differ), in sampling order, and as many of the first others as it takes to make n."""
    order = np.concatenate([np.flatnonzero(signal), np.flatnonzero(~signal)])
    assert len(order) >= n
    return np.sort(order[:n])


class GRPOStrategy(BaseStrategy):
    """Group relative policy optimization. Each step takes batch_size prompts per micro-step and rank, samples
    group_size completions of each from the current policy, scores them with the weighted reward functions, and
    normalizes rewards within each group into advantages. The loss is the clipped ratio objective against the
    policy that sampled (new rollouts every `iterations` steps) plus kl_coef * k3 KL to the frozen starting
    model, summed over completion tokens and divided by all completion tokens of the step (token-level).

    Options from DAPO (Yu et al. 2025) and Dr. GRPO (Liu et al. 2025), each off by default: clip_eps_high (the
    ratio's upper bound raised), scale_rewards false (advantages not divided by the group's std), oversample > 1
    (dynamic sampling: more prompts sampled than trained on, the groups with a signal kept). DAPO refills a batch
    by sampling again until it holds enough groups with a signal; here the number of prompts per step is fixed
    instead (oversample x), so the data order stays a function of the step and every rank trains on the same
    number of groups, falling back to equal-reward groups when too few differ."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, device: torch.device, tokenizer_sha256: str,
                 autocast: contextlib.AbstractContextManager):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256, autocast)
        from astrai_core.tokenizer.chat import load_chat
        from astrai_core.training.rewards import resolve_reward

        self.chat = load_chat(cfg.tokenizer)
        self.rewards = {name: (resolve_reward(name), w) for name, w in cfg.grpo.rewards.items()}
        self.records = self._read_prompts(cfg.train_data)
        # Held-out prompts (val_data): the greedy policy's task accuracy on eval_batches x batch_size of them is
        # logged beside the reward, so a reward that rises while the held-out accuracy does not shows.
        self.val_records = (self._read_prompts(cfg.val_data)[: cfg.eval_batches * cfg.batch_size]
                            if cfg.val_data else [])
        self.sampler = IndexSampler(len(self.records), cfg.seed)
        self.buffer: list[dict[str, torch.Tensor]] = []  # this rank's rollouts, reused for `iterations` steps

    def _read_prompts(self, path: str) -> list[tuple[dict, list[int]]]:
        """(record, prompt tokens) of each line of a GRPO JSONL file."""
        out = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                        prompt = self.chat.encode_prompt([{"role": "user", "content": record["prompt"]}])
                    except (json.JSONDecodeError, KeyError, TypeError, AstraiError) as e:
                        raise AstraiError(f"{path}:{lineno}: not a GRPO prompt record ({e})") from None
                    if len(prompt) + self.cfg.grpo.max_new_tokens > self.cfg.model.max_seq_len:
                        raise AstraiError(f"{path}:{lineno}: prompt of {len(prompt)} tokens + max_new_tokens "
                                          f"exceeds the context ({self.cfg.model.max_seq_len})")
                    out.append((record, prompt))
        if not out:
            raise AstraiError(f"{path}: no prompts")
        return out

    def setup(self, model):
        self.reference = frozen_copy(model)

    @torch.no_grad()
    def validate(self, model, raw_model, dp):
        """Greedy replies to this rank's share of the held-out prompts: the share exactly right and the mean
        reward, over all ranks."""
        from astrai_core.inference.generate import generate_batch
        from astrai_core.training.rewards import exact_answer

        mine = self.val_records[self.rank :: self.world_size]
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # right, reward, count
        if mine:
            with self.autocast:
                outs = generate_batch(raw_model, [p for _, p in mine], self.cfg.grpo.max_new_tokens,
                                      stop_ids=self.chat.stop_ids)
            for (record, _), out in zip(mine, outs):
                reply = self.chat.decode_reply(out)
                sums += torch.tensor([exact_answer(reply, record), self._reward(reply, record), 1.0],
                                     dtype=torch.float64, device=self.device)
        right, reward, n = dp.all_reduce_sum(sums).tolist()
        return {"val/task_accuracy": right / n, "val/reward": reward / n}

    def prepare(self, step, model, dp):
        """New rollouts every `iterations` steps (their statistics are logged on the step that sampled them)."""
        if step % self.cfg.grpo.iterations and self.buffer:
            return {}
        # oversample x the step's prompts, a fixed number whatever the rewards: the sampler stays a function of
        # the number of rollout steps, so a resumed run draws the same prompts.
        items = self.sampler.next_indices(self.per_step * self.cfg.grpo.oversample)
        self.buffer, stats = self.rollouts(step, model, items, dp)
        return stats

    def micro_batches(self, step):
        return [Batch(d["x"], d, int(d["mask"].sum()), d["x"].numel()) for d in self.buffer]

    @torch.no_grad()
    def rollouts(self, step: int, model: Transformer, items: np.ndarray,
                 dp: DataGroup) -> tuple[list[dict[str, torch.Tensor]], dict[str, tuple[float, float]]]:
        """This rank's rollout batches of `items` (oversample x per_step prompts: group_size completions of each,
        scored; the groups kept turned into advantages) and their statistics as (sum, count) pairs. Every rank
        returns grad_accum batches of batch_size groups, whatever the rewards."""
        from astrai_core.inference.generate import generate_batch

        g, b = self.cfg.grpo, self.cfg.batch_size
        # Sampling randomness is a function of (seed, step, rank): a resumed run samples the same completions.
        gen = torch.Generator(device=self.device).manual_seed(hash((self.cfg.seed, step, self.rank)) % 2**63)
        stats = {k: [0.0, 0.0] for k in ("grpo/reward_mean", "grpo/reward_std", "grpo/zero_spread_fraction",
                                          "grpo/completion_length", "grpo/reward_errors")}
        # This rank's prompts, generated batch_size at a time (as many rows per generate call as without oversample).
        mine = np.concatenate(self.my_slices(items, b * g.oversample))
        sampled: list[Group] = []  # every group this rank sampled, in sampling order
        for first in range(0, len(mine), b):
            sel = mine[first : first + b]
            prompts = [self.records[int(i)][1] for i in sel for _ in range(g.group_size)]
            records = [self.records[int(i)][0] for i in sel for _ in range(g.group_size)]
            with self.autocast:  # group_size samples of each prompt, its full KV blocks computed once
                completions = generate_batch(model, prompts[::g.group_size], g.max_new_tokens,
                                             temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                                             stop_ids=self.chat.stop_ids, generator=gen,
                                             samples_per_prompt=g.group_size)
            rewards = torch.tensor([self._reward(self.chat.decode_reply(c), r) for c, r in zip(completions, records)])
            bad = ~torch.isfinite(rewards).view(-1, g.group_size).all(1)  # groups with a failed reward: skipped
            rewards = torch.where(torch.isfinite(rewards), rewards, torch.zeros(()))
            spread = rewards.view(-1, g.group_size).std(1)
            for key, value, n in (("grpo/reward_mean", rewards.sum(), len(rewards)),
                                  ("grpo/reward_std", spread.sum(), len(spread)),
                                  ("grpo/zero_spread_fraction", (spread == 0).float().sum(), len(spread)),
                                  ("grpo/completion_length", float(sum(map(len, completions))), len(completions)),
                                  ("grpo/reward_errors", bad.float().sum(), len(spread))):
                stats[key][0] += float(value)
                stats[key][1] += n
            rows = [slice(j * g.group_size, (j + 1) * g.group_size) for j in range(len(sel))]
            sampled += [Group(prompts[r.start], completions[r], rewards[r], bool(bad[j]), float(spread[j]))
                        for j, r in enumerate(rows)]
        # With on_reward_error: skip, a reward that always fails would "train" on zero advantages and exit 0.
        errors = torch.tensor(stats["grpo/reward_errors"], dtype=torch.float64, device=self.device)
        failed, groups = dp.all_reduce_sum(errors).tolist()
        if failed == groups:
            raise AstraiError(f"step {step + 1}: every reward failed on every rank (grpo.on_reward_error: skip), "
                              "nothing to learn from; fix the reward functions (grpo.objective.rewards)")
        # Dynamic sampling: grad_accum x batch_size of the groups, those with a signal first (oversample 1: all).
        signal = np.array([grp.spread > 0 and not grp.failed for grp in sampled], dtype=bool)
        kept = keep_groups(signal, b * self.cfg.grad_accum)
        if g.oversample > 1:  # the share of the groups trained on that give no gradient
            stats["grpo/kept_zero_spread_fraction"] = [float((~signal[kept]).sum()), float(len(kept))]
        out = [self._rollout_batch(model, [sampled[int(i)] for i in kept[first : first + b]])
               for first in range(0, len(kept), b)]
        return out, {k: tuple(v) for k, v in stats.items()}

    def _rollout_batch(self, model: Transformer, groups: list[Group]) -> dict[str, torch.Tensor]:
        """One micro-batch of groups: the rows, their advantages (zero for a group whose reward failed), the
        reference's and, with iterations > 1, the sampling policy's log-probabilities."""
        g = self.cfg.grpo
        prompts = [grp.prompt for grp in groups for _ in range(g.group_size)]
        completions = [c for grp in groups for c in grp.completions]
        rewards = torch.cat([grp.rewards for grp in groups])
        failed = torch.tensor([grp.failed for grp in groups]).repeat_interleave(g.group_size)
        adv = group_advantages(rewards, g.group_size, scale=g.scale_rewards) * ~failed
        xs, ys = zip(*(row_targets(np.array(p + c, dtype=np.int64), np.array([0] * len(p) + [1] * len(c)))
                       for p, c in zip(prompts, completions)))
        length = max(len(x) for x in xs)
        x, y = pad_rows(xs, length, 0).to(self.device), pad_rows(ys, length, IGNORE_INDEX).to(self.device)
        with self.autocast:
            ref_logits = self.reference(x)
            old_logits = model(x) if g.iterations > 1 else None
        batch = {"x": x, "y": y, "mask": y != IGNORE_INDEX, "adv": adv.to(self.device),
                 "ref_logp": token_logps(ref_logits, y)}
        if old_logits is not None:
            batch["old_logp"] = token_logps(old_logits, y)
        return batch

    def _reward(self, completion: str, record: dict) -> float:
        total = 0.0
        for name, (fn, weight) in self.rewards.items():
            try:
                r = float(fn(completion, record))
                if not math.isfinite(r):
                    raise ValueError(f"returned {r}")
            except Exception as e:
                if self.cfg.grpo.on_reward_error == "stop":
                    raise AstraiError(f"reward {name!r} failed on prompt {record.get('prompt', '')[:60]!r}: {e}") from None
                return math.nan
            total += weight * r
        return total

    def loss(self, logits, batch):
        d, g = batch.data, self.cfg.grpo
        logp = token_logps(logits, d["y"])
        old = d.get("old_logp", logp.detach())  # one step per rollout batch: the sampler is the current policy
        loss, metrics = grpo_token_loss(logp, old, d["ref_logp"], d["adv"], d["mask"], g.clip_eps, g.kl_coef,
                                        g.clip_eps_high)
        return loss, {f"grpo/{k}": v for k, v in metrics.items()}

    def state_dict(self):
        return {**super().state_dict(), "buffer": [{k: v.cpu() for k, v in b.items()} for b in self.buffer]}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.buffer = [{k: v.to(self.device) for k, v in b.items()} for b in state.get("buffer", [])]

