"""The pipeline's stage table: its stages in order, what each reads and writes, and for a training stage its
strategy and the held-out metric it must raise. Everything that depends on which stages there are follows from here:

* the layout: each stage's output under the project (`out`: data/NAME unless it says otherwise);
* dvc.yaml: `astrai dvc-yaml` writes it from this table (dvc_yaml below), and `astrai pipeline` stops on a
  dvc.yaml that differs;
* params.yaml: one section per training stage, of its strategy's schema (tasks/run/schema.py SECTIONS);
* the chain: each training stage starts from the model of the enabled training stage before it, and the last
  trained model is the final one (final_model below);
* the evaluation: every trained model side by side, each post-training model against its starting model on its
  `target` (and its `keep` metrics), and the headline of `dvc metrics show` (tasks/stages/evaluate.py).

A new post-training stage is one TrainingStage entry here and its section in params.yaml (docs/design.md, "Adding a
stage"); nothing else names the stages. Paths are relative to the project directory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from astrai_core.runtime.errors import AstraiError
from tasks.evaluation.metrics import METRICS

DATA = Path("data")
NAME = re.compile(r"[a-z][a-z0-9_]*")  # a stage's name: its `astrai stage NAME`, params.yaml section and data/NAME


# The training core: every training stage runs it (astrai_core/training/train.py on every rank), so a change to any
# file of these reruns them. Folders, so a module added to one is covered; tests/test_stage_table.py fails when the
# ranks import a file outside them (.dvcignore keeps bytecode out of DVC's hash of a folder).
# The decoding GRPO's rollouts, evaluate and dpo_reference run: generate_batch on the serving engine, so all of it.
DECODE_CODE = ("astrai_core/inference",)
TRAINING_CODE = ("tasks/stages/training.py", "tasks/registry/models.py",
                 *(f"astrai_core/{part}" for part in ("runtime", "tokenizer", "model", "data", "checkpoint", "scoring",
                                                      "training")),
                 *DECODE_CODE)


@dataclass(frozen=True)
class Stage:
    """One stage: `astrai stage NAME` runs it (tasks/stages/runner.py), DVC reruns it when what it reads changes."""

    name: str
    reads: tuple[str, ...] = ()  # what it reads of other stages: NAME (its output) or NAME/FILE (one file of it)
    models: str = ""  # the trained models it reads too: "before" (those before it in the table), "all" or none
    code: tuple[str, ...] = ()  # its source files: DVC reruns the stage when one changes
    params: tuple[str, ...] = ()  # the params.yaml keys it reads: DVC reruns the stage when one changes
    out: Path | None = None  # its output folder; None: data/NAME
    files: tuple[str, ...] = ()  # outputs that are files in `out` (dvc.yaml lists them instead of the folder)
    metrics: tuple[str, ...] = ()  # files in `out` that `dvc metrics show` reports
    persist: bool = False  # its outputs persist (DVC does not restore them from its run-cache: see register)

    def __post_init__(self) -> None:
        if self.out is None:
            object.__setattr__(self, "out", DATA / self.name)


@dataclass(frozen=True)
class TrainingStage(Stage):
    """A training stage: the training core (astrai_core/training/train.py) under torchrun with `strategy`, configured by
    its params.yaml section (tasks/run/configs.py train_config). It reads every model before it in the chain (it
    starts from the last enabled one) and writes its model to `out`."""

    strategy: str = "sft"  # astrai_core/training/strategies STRATEGIES
    train_data: str | None = None  # what it trains on (None: the strategy's own, tasks/run/configs.py)
    val_data: str | None = None  # its held-out loss's data (None: none)
    target: str | None = None  # the held-out metric (tasks/evaluation/metrics.py) it must raise over its start
    keep: tuple[str, ...] = ()  # the metrics it must not lower against its start
    models: str = "before"
    code: tuple[str, ...] = TRAINING_CODE
    params: tuple[str, ...] = ()  # its own section is always read; these are more keys

    @property
    def post_training(self) -> bool:
        return self.strategy != "seq"


CHAT = DATA / "chat"

STAGES: tuple[Stage, ...] = (
    Stage("corpus", code=("tasks/stages/corpus.py",), params=("corpus",)),
    Stage("tokenizer", reads=("corpus",),
          code=("tasks/stages/tokenizer.py", "tasks/registry/models.py", "astrai_core/tokenizer"),
          # pretrain.init_from: the tokenizer is then the model's the chain starts from (tasks/registry/models.py)
          params=("tokenizer", "pretrain.init_from")),
    Stage("pack", reads=("corpus", "tokenizer"), out=DATA / "packed",
          code=("tasks/stages/pack.py", "astrai_core/data/packed.py", "astrai_core/tokenizer/bpe.py"),
          params=("pack",)),
    TrainingStage("pretrain", strategy="seq", reads=("pack", "tokenizer"),
                  train_data="data/packed/train.h5", val_data="data/packed/validation.h5", params=("model",)),
    Stage("chat_data", reads=("corpus", "tokenizer", "pack"), out=CHAT,
          code=("tasks/stages/chat_data.py", "tasks/chat/demo_tasks.py", "tasks/chat/plays.py",
                "tasks/chat/records.py", "astrai_core/tokenizer/chat.py", "astrai_core/data/packed.py"),
          params=("chat_data", "pretrain.seq_len", "model.max_seq_len", "grpo.objective.max_new_tokens")),
    TrainingStage("sft", strategy="sft", reads=("chat_data",), train_data="data/chat/sft_train.h5",
                  val_data="data/chat/sft_test.h5", target="task_accuracy"),
    # DPO's reference log-probabilities (and on-policy pairs) from the model dpo starts from: the models before it
    Stage("dpo_reference", reads=("chat_data",), models="before",
          code=("tasks/stages/dpo_reference.py", "tasks/stages/chat_data.py", "astrai_core/training/strategies",
                "astrai_core/scoring", "astrai_core/data", *DECODE_CODE,
                "astrai_core/training/rewards.py"),
          params=("dpo.enabled", "dpo.dtype", "dpo.rejected", "chat_data.seed", "grpo.objective.max_new_tokens",
                  "pretrain.seq_len", "chat_data.on_bad_record")),
    TrainingStage("dpo", strategy="dpo", reads=("dpo_reference", "chat_data"), target="preference_accuracy",
                  keep=("task_accuracy",)),
    TrainingStage("grpo", strategy="grpo", reads=("chat_data",), train_data="data/chat/grpo_train.jsonl",
                  val_data="data/chat/grpo_test.jsonl", target="task_accuracy"),
    # Every model of the chain side by side; the held-out documents of the corpus start the samples (a corpus other
    # than the plays) and make the lm-eval tasks' items.
    Stage("evaluate", reads=("pack", "chat_data", "dpo_reference", "corpus"), models="all",
          # table.py: which models there are (a removed stage's results must not stand: DVC does not see a
          # dependency that left the list)
          code=("tasks/run/table.py", "tasks/stages/evaluate.py", "tasks/evaluation", "evals/lm_eval_tasks",
                "astrai_core/scoring", *DECODE_CODE, "astrai_core/training/rewards.py",
                "astrai_core/data"),
          params=("evaluate", "corpus.source", "pretrain.seq_len", "grpo.objective.max_new_tokens", "dpo.enabled",
                  "dpo.rejected"),
          files=("samples.md", "evaluation.md", "items.json", "checks.json", "chain.png", "curves.png", "chain.json",
                 "curves", "metrics.json"),
          # The headline (tasks/stages/evaluate.py headline): a table `dvc exp show` fits on a screen. Cached (not
          # `cache: false`): git ignores data/, so a commit holds only dvc.lock's hash of it, and `dvc exp show` /
          # `dvc metrics diff` read it back from DVC's cache: commit dvc.lock after a run to compare against it.
          metrics=("headline.json",)),
    # Cached, so that `dvc checkout` and `dvc exp apply` bring back the registration that made this dvc.lock (`dvc
    # status` is clean after them). Persist: no run-cache for register: the registry is state DVC cannot see, so
    # when register's deps or params change it always runs (finding weights already registered is cheap: it reports
    # that version), never "restored" from an earlier run's record.
    Stage("register", reads=("evaluate/metrics.json",), models="all",
          code=("tasks/run/table.py", "tasks/stages/register.py", "tasks/registry/gate.py", "tasks/registry/lock.py",
                "tasks/evaluation/metrics.py", "tasks/evaluation/samples.py", "tasks/registry/pyfunc_model.py",
                "astrai_core/convert"),
          params=("register",), files=("registration.json",), persist=True),
)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
TRAINING: dict[str, TrainingStage] = {s.name: s for s in STAGES if isinstance(s, TrainingStage)}
MODEL_STAGES = tuple(TRAINING)  # in chain order: each one's model starts the next enabled one

# The layout: where the stages that others read write. An edit that removes one of them (or empties the table) is
# one line naming it, at the first import of the table.
LAYOUT = ("corpus", "tokenizer", "pack", "pretrain", "dpo_reference", "evaluate", "register")
if missing := [n for n in LAYOUT if n not in BY_NAME]:
    raise AstraiError(f"tasks/run/table.py: no stage {missing[0]!r}; the stages {', '.join(LAYOUT)} are read by "
                      "name by the others (add stages around them, keep these)")
CORPUS, TOKENIZER, PACKED, DPO_REFERENCE, EVALUATE, REGISTER = (
    BY_NAME[n].out for n in ("corpus", "tokenizer", "pack", "dpo_reference", "evaluate", "register"))


def check_table(strategies: Iterable[str]) -> None:
    """The table as an edit may leave it: each stage named once, reading only stages before it, each training stage
    of a known strategy (`strategies`: those with a params schema, tasks/run/schema.py SECTIONS); AstraiError naming
    the entry."""
    seen: list[str] = []
    outs: dict[Path, str] = {}  # each stage's output folder -> its stage
    for stage in STAGES:
        where = f"tasks/run/table.py: stage {stage.name!r}"
        if not NAME.fullmatch(stage.name):
            raise AstraiError(f"{where}: not a name a stage can have (lower-case letters, digits and _, starting with "
                              "a letter: it names the stage's command, section and folder)")
        if stage.name in seen:
            raise AstraiError(f"{where}: a second stage of that name")
        out = Path(os.path.normpath(stage.out))
        if out.is_absolute() or out.parts[:1] != DATA.parts or len(out.parts) < 2:
            raise AstraiError(f"{where}: out {str(stage.out)!r} is not a folder under {DATA}/")
        for other, owner in outs.items():  # one stage's output inside another's: running one deletes the other's
            if out == other or other in out.parents or out in other.parents:
                raise AstraiError(f"{where}: out {str(stage.out)!r} overlaps the output of stage {owner!r} ({other}); "
                                  "each stage writes a folder of its own")
        outs[out] = stage.name
        for read in stage.reads:
            if read.partition("/")[0] not in seen:
                raise AstraiError(f"{where}: reads {read!r}, which is not a stage before it ({', '.join(seen)})")
        if stage.models not in ("", "before", "all"):
            raise AstraiError(f"{where}: models {stage.models!r}; expected \"before\", \"all\" or \"\"")
        if isinstance(stage, TrainingStage) and stage.strategy not in strategies:
            raise AstraiError(f"{where}: strategy {stage.strategy!r}; one of {', '.join(strategies)}")
        for metric in (stage.target, *stage.keep) if isinstance(stage, TrainingStage) else ():
            if metric is not None and metric not in METRICS:
                raise AstraiError(f"{where}: metric {metric!r} is not one evaluate reports; one of {', '.join(METRICS)}")
        seen.append(stage.name)


def model_dir(root: Path, stage: str) -> Path:
    return root / TRAINING[stage].out


def models_before(stage: str) -> tuple[str, ...]:
    """The training stages before `stage` in the table (whichever kind `stage` is)."""
    names = [s.name for s in STAGES]
    return tuple(m for m in MODEL_STAGES if names.index(m) < names.index(stage))


def previous_model(root: Path, stage: str | None = None) -> Path:
    """The newest trained model before training stage `stage` (None: of the whole chain) in the stage table's order;
    skipped stages pass their input on."""
    chain = MODEL_STAGES[: MODEL_STAGES.index(stage)] if stage else MODEL_STAGES
    for name in reversed(chain):
        d = model_dir(root, name)
        if (d / "model.safetensors").is_file():
            return d
    raise AstraiError(f"no trained model before stage {stage or 'evaluate'!r}; run the pretrain stage first")


def final_model(root: Path) -> Path:
    """The last trained model of the chain: what evaluation reports last and register registers."""
    return previous_model(root)


# ---- dvc.yaml, written from the table ----------------------------------------------------------------------------

DVC_HEADER = """\
# The pipeline's stages for DVC, written by `astrai dvc-yaml` from tasks/run/table.py (the stage table): edit the
# table, then run `astrai dvc-yaml`; `astrai pipeline` stops while this file differs from the table's.
# Each `cmd` is the same stage code the Prefect flow runs (flows/pipeline.py runs `dvc repro --single-item STAGE`,
# which runs these commands). A training stage reads every model before it (it starts from the last enabled one).
"""
DVC_FOOTER = """\

# `dvc plots show` / `dvc plots diff`: the evaluate stage's two pictures (each metric with its 95% interval across the
# chain, every stage's training curves). PNGs: `dvc plots show` then writes a page that needs nothing from the
# network (vega plots load vega from a CDN, which offline machines and many clusters cannot reach). The data behind
# them: chain.json, curves/<stage>.json.
plots:
  - data/evaluate/chain.png
  - data/evaluate/curves.png
"""


def stage_deps(stage: Stage) -> list[str]:
    """What DVC reruns `stage` on: the models and outputs it reads, then its code."""
    models = {"before": models_before(stage.name), "all": MODEL_STAGES, "": ()}[stage.models]
    paths = []
    for read in (*models, *stage.reads):
        name, _, file = read.partition("/")
        path = str(BY_NAME[name].out / file) if file else str(BY_NAME[name].out)
        if path not in paths:
            paths.append(path)
    return paths + list(stage.code)


def dvc_yaml() -> str:
    """dvc.yaml's text for the table."""
    lines = [DVC_HEADER.rstrip("\n"), "stages:"]
    for stage in STAGES:
        params = (stage.name, *stage.params) if isinstance(stage, TrainingStage) else stage.params
        lines += [f"  {stage.name}:", f"    cmd: astrai stage {stage.name}", "    deps:"]
        lines += [f"      - {path}" for path in stage_deps(stage)]
        if params:
            lines += ["    params:"] + [f"      - {key}" for key in params]
        outs = [str(stage.out / name) for name in stage.files] or [str(stage.out)]
        persist = ":\n          persist: true" if stage.persist else ""
        lines += ["    outs:"] + [f"      - {out}{persist}" for out in outs]
        if stage.metrics:
            lines += ["    metrics:"] + [f"      - {stage.out / name}" for name in stage.metrics]
    return "\n".join(lines) + "\n" + DVC_FOOTER


def check_own_dvc_yaml(root: Path) -> None:
    """`astrai dvc-yaml` may write root/dvc.yaml: root is the checkout whose stage table this is (not another DVC
    project's folder, not an empty one), and a dvc.yaml there is one it wrote; AstraiError saying which is not."""
    table = root / "tasks/run/table.py"
    if not (table.is_file() and table.samefile(__file__)):
        raise AstraiError(f"{root.resolve()}: not the astrai checkout whose stage table this command reads "
                          f"({Path(__file__).resolve()}); run `astrai dvc-yaml` in that checkout")
    path = root / "dvc.yaml"
    if path.is_file() and not path.read_text(errors="replace").startswith(DVC_HEADER.splitlines()[0]):
        raise AstraiError(f"{path.resolve()}: not written by `astrai dvc-yaml` (its first line is not the table's "
                          "header); move it away to write the stage table's")


def check_dvc_yaml(root: Path) -> None:
    """dvc.yaml in `root` is the table's (DVC runs what dvc.yaml says, the flow what the table says); AstraiError
    saying how to make it so."""
    path = root / "dvc.yaml"
    if not path.is_file() or path.read_text() != dvc_yaml():
        raise AstraiError(f"{path}: {'differs from' if path.is_file() else 'missing; it is written from'} the stage "
                          "table (tasks/run/table.py); run `astrai dvc-yaml` to write it")
