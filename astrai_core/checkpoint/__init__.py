"""Checkpoints: the model folder every stage reads and writes (model_dir), and a training run's resumable
checkpoints with their training state (checkpointer)."""
