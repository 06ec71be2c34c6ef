"""A model's card: what it is, the data it was trained on, its params hash, its held-out metrics with their 95%
intervals, and how to serve it. One text (model_card) for the registered version's description in MLflow
(tasks/stages/register.py) and for the README.md `astrai export-hf` writes beside the weights (card_of)."""

from __future__ import annotations

from pathlib import Path

from astrai_core.model.config import ModelConfig
from tasks.evaluation.metrics import METRICS
from tasks.run.table import MODEL_STAGES

# The chain a model comes from, as the stage table has it: corpus -> tokenizer -> pretrain -> sft -> dpo -> grpo
CHAIN = " -> ".join(("corpus", "tokenizer", *MODEL_STAGES))

def shape_line(cfg: ModelConfig) -> str:
    """The model's shape in one line (a version's tag `model`)."""
    return (f"dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} key/value), vocabulary "
            f"{cfg.vocab_size}, context {cfg.max_seq_len} tokens, mlp {cfg.mlp}, attention {cfg.attention}")


def model_card(title: str, reference: str, tags: dict[str, str]) -> str:
    """The card (markdown) of model `reference` (models:/NAME/VERSION, or a checkpoint directory) from its registry
    tags (tasks/stages/register.py writes them; a checkpoint has only `model`)."""
    lines = [f"# {title}", "",
             f"A small GPT-style language model trained by the AstrAI pipeline ({CHAIN})"
             + (f": the {tags['stage']} stage's model, the chain's best on "
                                       f"{tags.get('register_metric', '?')}." if "stage" in tags else ".")]
    if "model" in tags:
        lines += ["", f"Shape: {tags['model']}."]
    if "promoted_from" in tags:  # a copy (`astrai promote`): where it came from, who copied it, past which gate
        lines += ["", f"Promoted from `{tags['promoted_from']}` ({tags.get('promoted_from_uri', '?')}) by "
                      f"{tags.get('promoted_by', '?')} at {tags.get('promoted_at', '?')}: "
                      f"{tags.get('promotion', '?')}."]
        if tags.get("promotion", "").startswith("forced past the gate"):
            lines += ["", "**Forced**: this version did not pass the register gate; it was promoted with --force."]
    lines += ["", "## Data and lineage", ""]
    facts = {"corpus": "corpus (corpus.source)", "params_hash": "params hash (sha256 of the resolved params.yaml)",
             "git_commit": "git commit", "git_dirty": "uncommitted changes", "profile": "params profile",
             "prefect_flow_run_id": "Prefect flow run", "mlflow_run_id": "MLflow run",
             "weights_sha256": "weights sha256"}
    facts |= {k: f"DVC md5 of {k.removeprefix('dvc_md5.')}" for k in sorted(tags) if k.startswith("dvc_md5.")}
    known = [f"* {label}: `{tags[k]}`" for k, label in facts.items() if k in tags]
    lines += known or ["Not a registered version: no lineage recorded (register it with `astrai stage register`)."]
    lines += ["", "## Held-out metrics (95% intervals)", ""]
    rows = [f"| {label} | {float(tags[k]):.4f} | " + (f"{float(tags[k + '_low']):.4f} to {float(tags[k + '_high']):.4f}"
                                                      if k + "_low" in tags and k + "_high" in tags else "-") + " |"
            for k, (label, _) in METRICS.items() if k in tags]
    lines += ["| metric | value | 95% interval |", "| --- | --- | --- |", *rows] if rows else \
        ["None recorded (the evaluate stage scores a registered version)."]
    # Each line short enough for MLflow's description box without scrolling: the comments on lines of their own.
    lines += ["", "## Use it", "", "```bash", "# OpenAI- and Anthropic-compatible HTTP on 127.0.0.1:8000",
              f"astrai serve --model {reference}", "# a reply in the chat format the post-training stages learned",
              f"astrai generate --model {reference} --chat --prompt 'Hello'", "```", ""]
    return "\n".join(lines)


REGISTERED_MODEL = (f"Small GPT-style language models trained by the AstrAI pipeline ({CHAIN} -> evaluate -> "
                    "register), one version per registration. Alias `candidate`: "
                    "the newest version; `champion`: the version that passed the register gate (better than chance "
                    "on a task, and beyond the interval against the champion before it). Each version's description "
                    "is its card: data, lineage, held-out metrics with 95% intervals, and how to serve it.")


def card_of(reference: str, checkpoint: Path) -> str:
    """The card of a model reference as tasks/registry/models.py resolved it to `checkpoint`: a registered version's
    from its tags (the text of its description), a checkpoint directory's from its config alone."""
    from astrai_core.checkpoint.model_dir import read_model_config

    tags = {"model": shape_line(read_model_config(checkpoint / "config.json"))}
    if reference.startswith("models:/"):
        import mlflow

        from tasks.registry.models import registry_version

        # resolve_model pointed MLflow at the pipeline's store
        mv = registry_version(mlflow.MlflowClient(), reference)
        return model_card(f"{mv.name} version {mv.version}", f"models:/{mv.name}/{mv.version}", tags | mv.tags)
    return model_card(Path(reference).resolve().name, reference, tags)
