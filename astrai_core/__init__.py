"""AstrAI training core: config, model, tokenizer, data (HDF5 files and what training reads from them), the
training loop (train.py) with its strategies, losses and callbacks, checkpoints, generation, evaluation.

Imports neither Prefect nor DVC nor the pipeline (tasks/, flows/); talks to MLflow only through
`astrai_core.training.metric_log` (rank 0).
"""
