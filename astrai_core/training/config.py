"""Typed configuration of the training core: the model shape and one training run.

These pydantic models are validated once at the edge (the `astrai train` CLI, the pipeline's params.yaml, whose
training sections are RunSettings plus their strategy's settings) and saved as JSON next to every checkpoint.
Every cross-field check lives here, so params.yaml is checked by the same code when it is parsed. Unknown keys are
errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from astrai_core.model.config import ModelConfig, Strict, check_tensor_parallel
from astrai_core.runtime.errors import AstraiError


# ---- what a parallel layout needs (checked when a config is read; astrai_core/training/parallel.py applies it) ----

def check_ranks(parallel: str, tp_size: int, world_size: int) -> None:
    """Raise ValueError naming tp_size unless `world_size` ranks can run `parallel` (tp or fsdp+tp) with tp_size:
    tp splits the model across every rank (no data parallelism: DDP cannot wrap the split weights, so data
    parallelism across TP groups is fsdp+tp); fsdp+tp needs whole TP groups."""
    if parallel == "tp" and world_size != tp_size:
        raise ValueError(f"parallel 'tp' runs on exactly tp_size ranks: tp_size is {tp_size}, the ranks {world_size} "
                         "(set nproc to tp_size, or use parallel 'fsdp+tp' for data parallelism across TP groups)")
    if parallel == "fsdp+tp" and world_size % tp_size:
        raise ValueError(f"parallel 'fsdp+tp': tp_size ({tp_size}) must divide the number of ranks ({world_size})")


class OptimConfig(Strict):
    """The optimizer and the learning-rate schedule (astrai_core/training/optim.py). adamw: AdamW on every weight (decay
    on matrices only). muon: Muon (orthogonalized momentum) on the decoder blocks' weight matrices, AdamW on the
    embeddings, the head, norm gains and biases; its learning rate is scaled to match AdamW's update size
    (torch's adjust_lr_fn "match_rms_adamw"), so `lr` carries over. Schedules:
    cosine = linear warmup then cosine decay to min_lr; sgdr = warmup then cosine warm restarts, the first cycle
    `restart_period` steps, each next one `restart_mult` times longer; wsd = warmup, constant lr, then a linear
    decay to min_lr over the last `decay_fraction` of the run."""

    lr: PositiveFloat = 3e-3
    min_lr: float = Field(3e-4, ge=0.0)
    warmup_steps: int = Field(20, ge=0)  # at most max_steps (RunSettings checks it)
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)  # AdamW's (and Muon's embeddings' and head's) betas: [0, 1)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    grad_clip: float = Field(1.0, ge=0.0)  # 0 disables clipping
    schedule: Literal["cosine", "sgdr", "wsd"] = "cosine"
    restart_period: PositiveInt = 100  # sgdr: optimizer steps in the first cycle (after warmup)
    restart_mult: float = Field(2.0, ge=1.0)  # sgdr: each cycle is this many times longer than the one before
    decay_fraction: float = Field(0.2, gt=0.0, le=1.0)  # wsd: the share of steps spent decaying
    fused: Literal["auto", "on", "off"] = "auto"  # fused AdamW kernel; auto: on where the device has one
    name: Literal["adamw", "muon"] = "adamw"
    muon_lr: PositiveFloat | None = None  # muon: the hidden matrices' peak lr (None: lr); the schedule scales it too
    muon_weight_decay: float | None = Field(None, ge=0.0)  # muon: the hidden matrices' decoupled weight decay (None: weight_decay)
    muon_momentum: float = Field(0.95, ge=0.0, lt=1.0)  # muon: Nesterov momentum of the hidden matrices

    @model_validator(mode="after")
    def _check_min_lr(self) -> "OptimConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) exceeds lr ({self.lr})")
        return self


class LoRAConfig(Strict):
    """Low-rank adapters (astrai_core/model/lora.py): only they train; the final checkpoint is the merged plain model
    and the adapters are also saved on their own (adapter/ in the output directory)."""

    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: list[str] | None = None  # module names (q_proj, v_proj, ...); None: every nn.Linear the blocks have


class DPOSettings(Strict):
    """Direct preference optimization: what a user sets (the params.yaml section `dpo`)."""

    beta: PositiveFloat = 0.1
    loss: Literal["sigmoid", "ipo", "conservative"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)  # conservative DPO: the assumed share of flipped labels
    nll_coef: float = Field(0.0, ge=0.0)  # + this x the chosen reply's per-token NLL (RPO): keeps chosen likely


class DPOConfig(DPOSettings):
    """DPO against the frozen reference whose log-probabilities were cached by astrai_core.scoring.dpo_reference (the
    reference model is not loaded during training)."""

    reference_logps: str | None = None  # HDF5 cache of the reference's log-probabilities of train_data


class GRPOConfig(Strict):
    """Group relative policy optimization on prompts with checkable answers (train_data: JSONL of
    {"prompt", "answer", ...}); batch_size counts prompts, each sampled group_size times."""

    group_size: int = Field(4, ge=2)
    max_new_tokens: PositiveInt = 16
    temperature: PositiveFloat = 1.0
    top_k: PositiveInt | None = None
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    clip_eps: PositiveFloat = 0.2  # the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]
    kl_coef: float = Field(0.04, ge=0.0)  # weight of the k3 KL to the reference (the starting model, frozen)
    iterations: PositiveInt = 1  # optimizer steps on each batch of rollouts (> 1 makes the ratio clipping bite)
    rewards: dict[str, float] = {"exact_answer": 1.0}  # reward name (astrai_core/training/rewards.py) -> weight
    on_reward_error: Literal["skip", "stop"] = "stop"  # a reward that raises or is not finite: drop the group, or stop
    # DAPO and Dr. GRPO options, each off by default (not yet measured on the demo): the defaults train as before.
    clip_eps_high: PositiveFloat | None = None  # DAPO clip-higher: the upper clip bound's eps (None: clip_eps)
    scale_rewards: bool = True  # advantages (r - mean) / std per group; false: r - mean (Dr. GRPO)
    # DAPO dynamic sampling: each step samples oversample x the prompts and trains on batch_size groups per
    # micro-step and rank, those whose rewards differ first (in sampling order), equal-reward ones filling up
    oversample: PositiveInt = 1

    @field_validator("rewards")
    @classmethod
    def _known_rewards(cls, rewards: dict[str, float]) -> dict[str, float]:
        from astrai_core.training.rewards import resolve_reward

        for name in rewards:
            try:
                resolve_reward(name)
            except AstraiError as e:
                raise ValueError(str(e)) from None
        return rewards

    @model_validator(mode="after")
    def _check_clip(self) -> "GRPOConfig":
        if self.clip_eps_high is None:
            return self
        if self.clip_eps_high < self.clip_eps:
            raise ValueError(f"clip_eps_high ({self.clip_eps_high}) is below clip_eps ({self.clip_eps}): it raises "
                             "the upper clip bound (DAPO clip-higher); set it >= clip_eps, or null for symmetric")
        if self.iterations == 1:
            raise ValueError(f"clip_eps_high ({self.clip_eps_high}) has no effect with iterations 1 (the rollouts "
                             "come from the current policy: every ratio is 1); set iterations > 1 or clip_eps_high null")
        return self


class TwoStageConfig(Strict):
    """Two-stage KL-regularized language modeling: stage 1 plain next-token loss for `stage1_tokens`; then a
    frozen snapshot of the model becomes the reference and stage 2 adds beta * KL(policy || reference) between
    the full next-token distributions, on its own data mixture, for the rest of the run's budget."""

    stage1_tokens: PositiveInt
    beta: PositiveFloat = 0.1
    stage2_data: dict[str, float] | None = None  # packed file -> sampling weight; None: train_data alone


class RunSettings(Strict):
    """How a run trains, not on what: every field a training section of params.yaml sets (each field's one
    default is here). TrainConfig adds the model, the strategy and the paths."""

    optim: OptimConfig = OptimConfig()
    lora: LoRAConfig | None = None  # train low-rank adapters instead of every weight
    batch_size: PositiveInt = 16  # per rank per micro-step: sequences (seq, sft rows), pairs (dpo), prompts (grpo)
    grad_accum: PositiveInt = 1
    max_steps: PositiveInt = 200  # optimizer steps
    # A token budget instead of a step count: when set, steps = ceil(max_tokens / tokens per step), max_steps unused.
    max_tokens: PositiveInt | None = None
    # bf16 = autocast (weights and optimizer stay fp32); auto = bf16 where the device computes it natively, else
    # fp32 (distributed.bf16_native: emulated bf16 on a CPU without AVX-512 BF16 is ~5x slower than fp32)
    dtype: Literal["auto", "fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Seconds a collective (and the process group's start) waits for the other ranks before this rank fails;
    # None: torch's default (30 min under gloo, 10 under nccl). launcher: slurm sets cluster.peer_timeout.
    peer_timeout: PositiveInt | None = None
    # ddp: replicas; fsdp: FSDP2 fully_shard per decoder block (models too big for one device); tp: tensor
    # parallelism, each layer split across tp_size ranks (layers too wide for one device;
    # astrai_core/training/parallel.py); fsdp+tp: FSDP2 across TP groups of tp_size ranks (the ranks / tp_size groups
    # each see their own batches).
    parallel: Literal["ddp", "fsdp", "tp", "fsdp+tp"] = "ddp"
    tp_size: PositiveInt = 1  # ranks one model is split across (tp: all of them; fsdp+tp: a divisor of the ranks)
    seed: int = 1337
    log_every: PositiveInt = 10
    eval_every: int = Field(0, ge=0)  # 0: validate only at the end
    eval_batches: PositiveInt = 8
    early_stopping_patience: int = Field(0, ge=0)  # stop after this many validations without improvement; 0: off
    early_stopping_min_delta: float = Field(0.0, ge=0.0)  # an improvement must lower val loss by more than this
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
    activation_checkpointing: bool = False  # recompute each decoder block in backward: less memory, ~30% more compute
    compile: bool = False
    # Checkpoints for resuming: every `checkpoint_every` steps (0: only at a SIGTERM stop), keeping the newest
    # `keep_checkpoints`.
    checkpoint_every: int = Field(0, ge=0)
    keep_checkpoints: PositiveInt = 2
    # full: rank 0 gathers the single-rank weights and optimizer state into model.safetensors + train_state.pt;
    # sharded: every rank writes its own shards (torch.distributed.checkpoint), nothing is gathered (for models
    # whose state must not be gathered on one rank). Either resumes under any parallelism and number of ranks;
    # the final model in out_dir is always full.
    checkpoint_format: Literal["full", "sharded"] = "full"
    # auto: continue from the newest valid checkpoint of the same run (a re-run after a crash goes on); never: fresh
    resume: Literal["auto", "never"] = "auto"

    @model_validator(mode="after")
    def _check_optimizer(self) -> "RunSettings":
        # With max_tokens the run's steps depend on the number of ranks, unknown here: not checked.
        if self.max_tokens is None and self.optim.warmup_steps > self.max_steps:
            raise ValueError(f"optim.warmup_steps ({self.optim.warmup_steps}) exceeds max_steps ({self.max_steps}): "
                             "the learning rate would never reach optim.lr")
        if self.optim.name == "muon" and self.parallel != "ddp":
            raise ValueError(f"optim.name 'muon' orthogonalizes whole weight matrices, which parallel "
                             f"{self.parallel!r} splits across ranks: use parallel ddp (or optim.name adamw)")
        return self


class TrainConfig(RunSettings):
    """One run of the training core (what `astrai train --config FILE` reads): RunSettings plus what it trains
    and where its files are."""

    model: ModelConfig = ModelConfig()
    # seq: next-token prediction on packed text; sft: packed conversations, loss on assistant tokens only;
    # dpo: preference pairs; grpo: sampled completions scored by reward functions (astrai_core/training/strategies/).
    strategy: Literal["seq", "sft", "dpo", "grpo"] = "seq"
    seq_len: PositiveInt = 256
    train_data: str  # HDF5 file written by the pack stage (grpo: JSONL prompts)
    val_data: str | None = None
    init_from: str | None = None  # a checkpoint directory whose weights start the run (its config must match)
    dpo: DPOConfig = DPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    two_stage: TwoStageConfig | None = None  # seq only
    tokenizer: str  # tokenizer.json; its sha256 must match the HDF5 files' attribute
    out_dir: str  # the final checkpoint directory (written atomically)
    compile_cache_dir: str | None = None  # TORCHINDUCTOR_CACHE_DIR for compile (None: torch's default under /tmp)
    checkpoint_dir: str | None = None  # the resumable checkpoints (None: `<out_dir>.ckpts` beside out_dir)

    @model_validator(mode="after")
    def _check_lengths(self) -> "TrainConfig":
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len ({self.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        if self.strategy == "dpo" and self.val_data:
            raise ValueError("val_data is not used by strategy 'dpo': set it to null")
        if self.strategy == "grpo" and self.early_stopping_patience:
            raise ValueError("early_stopping_patience watches val/loss, which strategy 'grpo' does not have "
                             "(it validates by held-out task accuracy): set it to 0")
        if self.strategy == "dpo" and not self.dpo.reference_logps:
            raise ValueError("strategy 'dpo' needs dpo.reference_logps (the cached reference log-probabilities)")
        if self.strategy in ("dpo", "grpo") and not self.init_from:
            raise ValueError(f"strategy {self.strategy!r} needs init_from: the model to start from (and the reference)")
        if self.two_stage is not None and self.strategy != "seq":
            raise ValueError("two_stage applies to strategy 'seq' only")
        if self.strategy == "grpo" and self.parallel == "fsdp":
            raise ValueError("strategy 'grpo' samples a different number of tokens per rank, which FSDP cannot: use ddp")
        self._check_tensor_parallel()
        return self

    def _check_tensor_parallel(self) -> None:
        if self.parallel not in ("tp", "fsdp+tp"):
            if self.tp_size != 1:
                raise ValueError(f"tp_size ({self.tp_size}) applies to parallel 'tp' or 'fsdp+tp' only "
                                 f"(parallel is {self.parallel!r}): set tp_size to 1")
            return
        if self.tp_size < 2:
            raise ValueError(f"parallel {self.parallel!r} needs tp_size >= 2 (the ranks each layer is split across)")
        if self.strategy == "grpo":
            raise ValueError(f"strategy 'grpo' is not supported with parallel {self.parallel!r} yet (the ranks of a "
                             "TP group would have to sample the same completions): use ddp")
        if self.two_stage is not None:
            raise ValueError(f"two_stage is not supported with parallel {self.parallel!r} yet (its frozen reference "
                             "is a copy of the split model): use ddp or fsdp")
        check_tensor_parallel(self.model, self.tp_size, lora=self.lora is not None)

    @property
    def checkpoints(self) -> str:
        """Where the resumable checkpoints live."""
        return self.checkpoint_dir or f"{self.out_dir}.ckpts"

    @property
    def logs(self) -> str:
        """Where the run's metrics.jsonl lives (beside out_dir)."""
        return f"{self.out_dir}.logs"

    def used(self) -> dict:
        """The settings this run trains with (what its MLflow run's params show): all but the other methods' own,
        whose defaults would contradict params.yaml (a seq run has no dpo.beta)."""
        return self.model_dump(exclude={m for m in ("dpo", "grpo") if m != self.strategy})
