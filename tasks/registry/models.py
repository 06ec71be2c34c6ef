"""A model reference -> a local astrai checkpoint directory: the one place every command that takes a model (serve,
generate, export-hf, export-gguf) and the pipeline's `pretrain.init_from` resolve it.

A reference is a registry URI (models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/model, from the pipeline's
MLflow store), an astrai checkpoint directory (e.g. data/grpo), a Hugging Face model directory or a GGUF file
(converted as `astrai import-hf` does: astrai_core.convert.gguf_import.import_model).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple

from astrai_core.runtime.errors import AstraiError

if TYPE_CHECKING:
    from tasks.run.schema import Params

REFERENCE_HELP = ("models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/model (from the pipeline's MLflow store), "
                  "a checkpoint directory, a Hugging Face model directory or a .gguf file")


class Resolved(NamedTuple):
    checkpoint: Path  # an astrai checkpoint directory (under `dst` when downloaded or converted)
    model_id: str  # what the model is called: NAME/VERSION for a registered model, else the directory's name
    aliases: list[str]  # other names it answers to: NAME, and NAME@ALIAS when asked for by alias


def use_tracking_store() -> Params:
    """Point MLflow at the store the pipeline uses: MLFLOW_TRACKING_URI, else params.yaml's tracking.uri, else
    mlflow/ in the current directory. Returns the params it read (defaults without a params.yaml)."""
    import mlflow

    from tasks.run.params import load_params

    from tasks.run.schema import Params
    from tasks.run.tracking import tracking_uri

    params = load_params("params.yaml") if Path("params.yaml").is_file() else Params()
    mlflow.set_tracking_uri(tracking_uri(params, Path.cwd()))
    return params


def registry_version(client, uri: str):
    """The ModelVersion that models:/NAME@ALIAS or models:/NAME/VERSION names (MlflowException if there is none)."""
    ref = uri.removeprefix("models:/")
    name, sep, which = ref.partition("@") if "@" in ref else ref.rpartition("/")
    if not (uri.startswith("models:/") and name and sep and which):
        raise AstraiError(f"{uri}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    return client.get_model_version_by_alias(name, which) if sep == "@" else client.get_model_version(name, which)


def resolve_model(ref: str, dst: Path) -> Resolved:
    """The checkpoint directory of model reference `ref` (see the module's docstring); a download or conversion is
    written under `dst` (the caller's temporary directory). AstraiError naming the reference otherwise."""
    if ref.startswith(("models:/", "runs:/")):
        return _download(ref, dst)
    path = Path(ref)
    if (path / "model.safetensors").is_file() and (path / "manifest.json").is_file():
        return Resolved(path, path.resolve().name, [])
    if (path / "model.safetensors").is_file() and (path / "config.json").is_file() and \
            b'"model_type"' not in (path / "config.json").read_bytes():  # astrai's own config.json, no manifest
        raise AstraiError(f"{path}: not a checkpoint (manifest.json missing: an incomplete or hand-made copy); use "
                          "the folder the stage or `astrai import-hf` wrote")
    if (path / "config.json").is_file() or (path.suffix == ".gguf" and path.is_file()):  # a Hugging Face directory
        from astrai_core.convert.gguf_import import import_model  # (its weights may be sharded) or a GGUF file

        return Resolved(import_model(path, dst / "imported"), path.resolve().name.removesuffix(".gguf"), [])
    raise AstraiError(f"{ref}: no such model (expected {REFERENCE_HELP})")


@contextlib.contextmanager
def local_model(ref: str, root: Path) -> Iterator[Path]:
    """Model reference `ref` (a path: relative to `root`) as a checkpoint directory while the block runs: a registry
    version downloaded, a Hugging Face directory converted, into a folder under root/.astrai (the project's, which
    a Slurm job's nodes share) removed afterwards."""
    from astrai_core.checkpoint.model_dir import verify_checkpoint

    if not ref.startswith(("models:/", "runs:/")):
        ref = str(root / Path(ref).expanduser())  # an absolute path stays as it is
    (root / ".astrai").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root / ".astrai", prefix="model-") as tmp:
        checkpoint = resolve_model(ref, Path(tmp)).checkpoint
        # What the pipeline copies over its own outputs (the tokenizer, data/pretrain) is whole first: a truncated or
        # edited file is one line naming it, before anything is replaced.
        verify_checkpoint(checkpoint)
        yield checkpoint


def _download(uri: str, dst: Path) -> Resolved:
    """A registered model (or a run's logged model): its checkpoint artifact downloaded under dst."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per file in a server's log
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    use_tracking_store()
    try:
        if uri.startswith("runs:/"):
            local = mlflow.artifacts.download_artifacts(uri, dst_path=str(dst))
            model_id, aliases = uri.removeprefix("runs:/").strip("/"), []
        else:
            mv = registry_version(mlflow.MlflowClient(), uri)
            local = mlflow.artifacts.download_artifacts(f"models:/{mv.name}/{mv.version}", dst_path=str(dst))
            ref = uri.removeprefix("models:/")
            model_id, aliases = f"{mv.name}/{mv.version}", [mv.name] + ([ref] if "@" in ref else [])
    except MlflowException as e:  # no such model, version, alias or run
        hint = "" if uri.startswith("runs:/") else registered_here(mlflow.MlflowClient())
        raise AstraiError(f"{uri}: {str(e.message).splitlines()[0]} (store: {mlflow.get_tracking_uri()}){hint}") \
            from None
    # The register stage logs the checkpoint directory as the pyfunc artifact "checkpoint"; MLmodel says where.
    try:
        artifacts = Model.load(local).flavors.get("python_function", {}).get("artifacts", {})
    except (MlflowException, OSError):
        artifacts = {}
    if "checkpoint" not in artifacts:
        raise AstraiError(f"{uri}: no checkpoint artifact (not a model registered by `astrai stage register`?)")
    return Resolved(Path(local) / artifacts["checkpoint"]["path"], model_id, aliases)


def registered_here(client) -> str:
    """What a reference could have named instead, for its error line: "; registered here: astrai-quick (@candidate
    v1)" (a quick run registers astrai-quick, whose versions seldom become champion), or that nothing is."""
    from mlflow.exceptions import MlflowException

    try:
        models = client.search_registered_models(max_results=10)
    except MlflowException:  # the store cannot say: the error line stands alone
        return ""
    if not models:
        return "; nothing is registered in this store yet (the pipeline's register stage registers a model)"
    return "; registered here: " + ", ".join(
        f"{m.name} ({', '.join(f'@{a} v{v}' for a, v in sorted(m.aliases.items())) or 'no alias'})" for m in models)


def alias_version(name: str, alias: str) -> str:
    """The version registered model `name`'s `alias` points to now, in the pipeline's store; AstraiError saying why
    when there is none (no such alias, the registry cannot be read)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    use_tracking_store()
    try:
        return str(mlflow.MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        raise AstraiError(str(e.message).splitlines()[0]) from None
