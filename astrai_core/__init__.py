"""AstrAI training core: model, tokenizer, HDF5 data, training loop, checkpoints, generation, evaluation.

Imports neither Prefect nor DVC; talks to MLflow only through `astrai_core.tracking` (rank 0).
"""
