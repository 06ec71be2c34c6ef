"""What a run of the pipeline shares: the stage table (table: the stages in order, what each reads and writes;
dvc.yaml is written from it), params.yaml's schema (schema), reading a run's params with a profile and overrides
(params), what is checked before the first stage (checks), each training stage's TrainConfig (configs), its MLflow
runs (tracking), the checkout's run lock (lock), its log and what the console shows (log), and the Slurm launcher
(slurm)."""
