"""What a run of the pipeline shares: its params (params.yaml as pydantic models), where each stage's output lives
(layout), its MLflow runs (tracking), the checkout's run lock (lock), its log and what the console shows (log),
and the Slurm launcher (slurm)."""
