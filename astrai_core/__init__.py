"""AstrAI training core, one sub-package per part, each importing only those below it (docs/design.md, "The
core"): runtime, tokenizer, model, data, checkpoint, scoring, convert, inference (sampling, generate, the serving
engine), training.

Imports neither Prefect nor DVC nor the pipeline (tasks/, flows/); talks to MLflow only through
`astrai_core.training.metric_log` (rank 0).
"""
