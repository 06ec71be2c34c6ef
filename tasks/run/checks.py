"""What a run will read and where it will run, checked before its first stage: every input exists and no
combination that cannot work is asked for (check_inputs), and launcher: slurm finds what it needs (check_cluster).
Each stops with one line naming the key and the fix."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

from astrai_core.runtime.errors import AstraiError
from tasks.run.schema import DEMO, Params
from tasks.run.table import MODEL_STAGES


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
            (_under(root, start) / name).is_file() for name in ("model.safetensors", "config.json")) and not (
            start.endswith(".gguf") and _under(root, start).is_file()):
        fail("pretrain.init_from", f"{start}: no model there (expected models:/NAME@ALIAS, models:/NAME/VERSION, a "
                                   "checkpoint directory, a Hugging Face directory or a .gguf file)")
    cuda = [key for key, device in [(f"{s}.device", getattr(params, s).device) for s in MODEL_STAGES]
            + [("evaluate.device", params.evaluate.device)] if device == "cuda"]
    if cuda:  # before any stage: a CPU-only machine would otherwise run the stages before it first
        import torch

        if not torch.cuda.is_available():
            fail(cuda[0], "cuda, but torch sees no CUDA device on this machine (torch.cuda.is_available() is false); "
                          "set auto or cpu")
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
