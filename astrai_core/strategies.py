"""What the training loop trains on and which loss it takes: per strategy, a batch builder and a loss function.

    seq   next-token prediction on packed text windows (optionally two-stage KL-regularized)
    sft   packed conversations: loss on assistant tokens only, attention blocked across conversations
    dpo   preference pairs against cached reference log-probabilities
    grpo  completions sampled from the policy, scored by reward functions

Each step the loop (astrai_core/train.py) calls, in this order:

    prepare(step, model, dp)   what the step needs from the current policy: GRPO's rollouts (sampled here, with
                               their statistics returned for the loop to log), two-stage's frozen reference
    micro_batches(step)        this rank's micro-batches of the step: batch building only
    loss(logits, batch)        one micro-batch's summed loss and metric sums: a pure function of tensors

and divides the losses by the step's unit count (target tokens, pairs or completion tokens) summed over all
micro-batches and ranks. A strategy never sees or writes the loop's state, and its collective operations run on
the data group `dp` the loop passes. Its data order is a pure function of the step (astrai_core/data.py samplers),
and anything else it carries across steps is in state_dict(), so every strategy resumes exactly.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from astrai_core.data import (Batch, Documents, IndexSampler, PackedRows, WindowSampler, open_tokens, pad_rows,
                              pair_batch, read_windows, row_targets)
from astrai_core.dpo_reference import load_reference_logps
from astrai_core.errors import AstraiError
from astrai_core.scoring import token_loss_total
from astrai_core.losses import (IGNORE_INDEX, dpo_loss, full_kl_sum, group_advantages, grpo_token_loss,
                                sequence_logps, token_logps, token_loss_sum)
from astrai_core.model import Transformer

if TYPE_CHECKING:
    from astrai_core.config import TrainConfig

VAL_SEED_OFFSET = 10**9  # the validation sampler's seed: never equal to the training sampler's


def frozen_copy(model: Transformer) -> Transformer:
    """An eval-mode copy of the bare model whose weights never train (a reference)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def window_batch(x: torch.Tensor, y: torch.Tensor, **data: torch.Tensor) -> Batch:
    return Batch(x, {"y": y, **data}, int((y != IGNORE_INDEX).sum()), x.numel())


class Strategy:
    """Base: prepare and micro_batches once per step, loss once per micro-batch, eval_batch to validate. `rank` and
    `world_size` are the data-parallel ones: under tensor parallelism a TP group's ranks are one data rank and
    build the same batches."""

    unit = "tokens"  # what Batch.count measures

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, device: torch.device, tokenizer_sha256: str,
                 autocast: Any):
        self.cfg, self.rank, self.world_size, self.device, self.autocast = cfg, rank, world_size, device, autocast
        self.per_step = world_size * cfg.grad_accum * cfg.batch_size  # samples per optimizer step, all ranks
        self.sampler: IndexSampler

    def setup(self, model: Transformer) -> None:
        """Called once the starting weights are loaded (before LoRA or DDP wrap the model)."""

    def my_slices(self, items: np.ndarray, b: int | None = None) -> list[np.ndarray]:
        """This rank's micro-batches out of a step's items: micro-step m of rank r takes slice m * ranks + r, of
        b items (batch_size when None)."""
        b = b or self.cfg.batch_size
        return [items[(m * self.world_size + self.rank) * b:][:b] for m in range(self.cfg.grad_accum)]

    def prepare(self, step: int, model: Transformer, dp: Any) -> dict[str, tuple[float, float]]:
        """Before step `step` (0-based) builds its batches: whatever it needs from `model`, the bare policy as it is
        now. Returns this rank's statistics of it as (sum, count) pairs, which the loop averages over `dp`."""
        return {}

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of optimizer step `step` (0-based)."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(summed loss, metric sums) of one micro-batch: both divided by the step's total count by the loop."""
        return token_loss_sum(logits, batch.data["y"], self.cfg.label_smoothing), {}

    def eval_batch(self, i: int) -> Batch:
        """This rank's i-th validation batch (fixed across the run); only strategies with val_data have one."""
        raise NotImplementedError

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, raw_model: Transformer, dp: Any) -> dict[str, float]:
        """Held-out metrics (the same on every rank): the loss of eval_batches validation batches. `model` is
        the wrapped model the loop trains, `raw_model` the bare one, `dp` the data-parallel group."""
        batches = (self.eval_batch(i) for i in range(self.cfg.eval_batches))
        total = dp.all_reduce_sum(token_loss_total(model, batches, self.autocast))
        return {"val/loss": (total[0] / total[1]).item()}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SeqStrategy(Strategy):
    """Next-token prediction on (seq_len + 1)-token windows of the packed stream. With two_stage: after
    stage1_tokens a frozen snapshot becomes the reference and the loss gains beta * KL(policy || reference)
    over the full next-token distributions, on stage 2's own data mixture."""

    def __init__(self, cfg, rank, world_size, device, tokenizer_sha256, autocast):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256, autocast)
        open_ = lambda p: open_tokens(p, tokenizer_sha256, cfg.model.vocab_size, cfg.seq_len)
        self.tokens = open_(cfg.train_data)
        self.sampler = WindowSampler(len(self.tokens), cfg.seq_len, cfg.seed)
        self.val_tokens = open_(cfg.val_data) if cfg.val_data else None
        self.val_sampler = (WindowSampler(len(self.val_tokens), cfg.seq_len, cfg.seed + VAL_SEED_OFFSET)
                            if cfg.val_data else None)
        self.reference: Transformer | None = None
        self.switch_step: int | None = None
        if cfg.two_stage is not None:
            self.switch_step = math.ceil(cfg.two_stage.stage1_tokens / (self.per_step * cfg.seq_len))
            mix = cfg.two_stage.stage2_data or {cfg.train_data: 1.0}
            if any(w <= 0 for w in mix.values()):
                raise AstraiError(f"two_stage.stage2_data: weights must be > 0, got {mix}")
            # Source j: its tokens and its own sampler (the main one when it is train_data itself).
            self.mix_paths = list(mix)
            self.mix_weights = np.array([mix[p] for p in self.mix_paths], dtype=np.float64)
            self.mix_weights /= self.mix_weights.sum()
            self.mix_tokens = [self.tokens if p == cfg.train_data else open_(p) for p in self.mix_paths]
            self.mix_samplers = [self.sampler if p == cfg.train_data else
                                 WindowSampler(len(t), cfg.seq_len, cfg.seed + 1 + j)
                                 for j, (p, t) in enumerate(zip(self.mix_paths, self.mix_tokens))]

    def in_stage2(self, step: int) -> bool:
        return self.switch_step is not None and step >= self.switch_step

    def _stage2_starts(self, step: int) -> tuple[list[Any], np.ndarray]:
        """Stage 2: which source each of the step's samples comes from (seeded by the step), and its start."""
        choice = np.random.default_rng([self.cfg.seed, step]).choice(len(self.mix_paths), self.per_step,
                                                                     p=self.mix_weights)
        starts = np.empty(self.per_step, dtype=np.int64)
        for j, sampler in enumerate(self.mix_samplers):
            sel = choice == j
            starts[sel] = sampler.next_starts(int(sel.sum()))
        return [self.mix_tokens[j] for j in choice], starts

    def prepare(self, step, model, dp):
        if self.in_stage2(step) and self.reference is None:  # the switch: freeze a snapshot of the model as it is now
            self.reference = frozen_copy(model)
            if self.rank == 0:
                print(f"two-stage: step {step}, the reference is frozen; KL beta {self.cfg.two_stage.beta}", flush=True)
        return {}

    def micro_batches(self, step):
        cfg = self.cfg
        if self.in_stage2(step):
            sources, starts = self._stage2_starts(step)
        else:
            sources, starts = None, self.sampler.next_starts(self.per_step)
        batches = []
        for sel in self.my_slices(np.arange(self.per_step)):
            if sources is None:
                x, y = read_windows(self.tokens, starts[sel], cfg.seq_len, self.device)
                batches.append(window_batch(x, y))
                continue
            # A mixture: each window from its own source; the frozen reference's logits for the KL term.
            xs, ys = zip(*(read_windows(sources[i], starts[i : i + 1], cfg.seq_len, self.device) for i in sel))
            x, y = torch.cat(xs), torch.cat(ys)
            with torch.no_grad(), self.autocast:
                batches.append(window_batch(x, y, ref_logits=self.reference(x)))
        return batches

    def loss(self, logits, batch):
        y = batch.data["y"]
        ce = token_loss_sum(logits, y, self.cfg.label_smoothing)
        if "ref_logits" not in batch.data:
            return ce, {}
        kl = full_kl_sum(logits, batch.data["ref_logits"], y)
        return ce + self.cfg.two_stage.beta * kl, {"train/ce": ce.detach(), "train/kl": kl.detach()}

    def eval_batch(self, i):
        b = self.cfg.batch_size
        starts = self.val_sampler.starts(i * self.world_size * b, self.world_size * b)
        return window_batch(*read_windows(self.val_tokens, starts[self.rank * b : (self.rank + 1) * b],
                                          self.cfg.seq_len, self.device))

    def state_dict(self):
        state: dict[str, Any] = {}
        if self.switch_step is not None:
            state["mix_consumed"] = [s.consumed for s in self.mix_samplers]
            if self.reference is not None:  # resuming after the switch needs the same reference
                state["reference"] = {k: v.detach().cpu().clone() for k, v in self.reference.state_dict().items()}
        return state

    def load_state_dict(self, state):
        if self.switch_step is None:
            return
        for s, n in zip(self.mix_samplers, state.get("mix_consumed", [])):
            s.consumed = int(n)
        if "reference" in state:
            self.reference = Transformer(self.cfg.model).to(self.device)
            self.reference.load_state_dict(state["reference"])
            self.reference = frozen_copy(self.reference)


class SFTStrategy(Strategy):
    """Supervised fine-tuning on packed conversations: several per row, each attending only to itself, the
    loss on assistant tokens only (the chat_data stage wrote the loss mask)."""

    def __init__(self, cfg, rank, world_size, device, tokenizer_sha256, autocast):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256, autocast)
        rows = lambda p: PackedRows(Documents(p, tokenizer_sha256, cfg.model.vocab_size), cfg.seq_len)
        self.rows = rows(cfg.train_data)
        self.sampler = IndexSampler(len(self.rows.rows), cfg.seed)
        self.val_rows = rows(cfg.val_data) if cfg.val_data else None

    def micro_batches(self, step):
        items = self.sampler.next_indices(self.per_step)
        return [self.rows.batch(sel, self.device) for sel in self.my_slices(items)]

    def eval_batch(self, i):
        n, b = len(self.val_rows.rows), self.cfg.batch_size
        first = (i * self.world_size + self.rank) * b
        return self.val_rows.batch(np.arange(first, first + b) % n, self.device)


class DPOStrategy(Strategy):
    """Direct preference optimization. The reference's summed log-probabilities of every response were computed
    once (astrai_core/dpo_reference.py) and are read from a file keyed by the data's and the weights' hashes."""

    unit = "pairs"

    def __init__(self, cfg, rank, world_size, device, tokenizer_sha256, autocast):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256, autocast)
        self.docs = Documents(cfg.train_data, tokenizer_sha256, cfg.model.vocab_size)
        if self.docs.n_docs % 2:
            raise AstraiError(f"{cfg.train_data}: {self.docs.n_docs} documents; DPO pairs need an even number")
        self.ref_logps = load_reference_logps(cfg.dpo.reference_logps, cfg.train_data,
                                              Path(cfg.init_from) / "model.safetensors")
        self.sampler = IndexSampler(self.docs.n_docs // 2, cfg.seed)

    def micro_batches(self, step):
        pairs = self.sampler.next_indices(self.per_step)
        out = []
        for sel in self.my_slices(pairs):
            b = pair_batch(self.docs, sel, self.device)
            ref = torch.from_numpy(self.ref_logps[b["docs"].numpy()]).float().to(self.device)
            out.append(Batch(b["x"], {"y": b["y"], "ref": ref}, len(sel), b["x"].numel()))
        return out

    def loss(self, logits, batch):
        d, c = batch.data, self.cfg.dpo
        logps = sequence_logps(logits, d["y"])
        n = len(logps) // 2
        chosen_tokens = (d["y"][:n] != IGNORE_INDEX).sum(-1)
        losses, r_chosen, r_rejected = dpo_loss(logps[:n], logps[n:], d["ref"][:n], d["ref"][n:], c.beta, c.loss,
                                                c.label_smoothing, c.nll_coef, chosen_tokens)
        return losses.sum(), {"dpo/rewards_chosen": r_chosen.sum(), "dpo/rewards_rejected": r_rejected.sum(),
                              "dpo/reward_margin": (r_chosen - r_rejected).sum(),
                              "dpo/reward_accuracy": (r_chosen > r_rejected).float().sum(),
                              "dpo/logps_chosen": logps[:n].detach().sum(), "dpo/logps_rejected": logps[n:].detach().sum()}


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


class GRPOStrategy(Strategy):
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

    def __init__(self, cfg, rank, world_size, device, tokenizer_sha256, autocast):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256, autocast)
        from astrai_core.chat import load_chat
        from astrai_core.rewards import resolve_reward

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
        from astrai_core.generate import generate_batch
        from astrai_core.rewards import exact_answer

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
                 dp: Any) -> tuple[list[dict[str, torch.Tensor]], dict[str, tuple[float, float]]]:
        """This rank's rollout batches of `items` (oversample x per_step prompts: group_size completions of each,
        scored; the groups kept turned into advantages) and their statistics as (sum, count) pairs. Every rank
        returns grad_accum batches of batch_size groups, whatever the rewards."""
        from astrai_core.generate import generate_batch

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
            with self.autocast:
                completions = generate_batch(model, prompts, g.max_new_tokens, temperature=g.temperature,
                                             top_k=g.top_k, top_p=g.top_p, stop_ids=self.chat.stop_ids, generator=gen)
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
        return {"buffer": [{k: v.cpu() for k, v in b.items()} for b in self.buffer]}

    def load_state_dict(self, state):
        self.buffer = [{k: v.to(self.device) for k, v in b.items()} for b in state.get("buffer", [])]


STRATEGIES = {"seq": SeqStrategy, "sft": SFTStrategy, "dpo": DPOStrategy, "grpo": GRPOStrategy}
