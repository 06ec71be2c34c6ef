"""Pipeline stages, each a plain function callable without Prefect or DVC, and what they share.

A module per stage: corpus, tokenizer, pack, chat_data, training (pretrain, sft, dpo, grpo: one training core),
dpo_reference, evaluate, register. tasks/stages.py lists them in order with their paths (what `astrai stage NAME`
and dvc.yaml run).

Shared by the stages: params (params.yaml as pydantic models), layout (every stage's directory), tracking (MLflow
runs), metrics (the held-out metrics), chat_records (the chat records' schema), plays and demo_tasks (the demo's
chat data from the plays), evaluation_plots (evaluate's pictures), pyfunc_model (the registered MLflow model),
slurm (a training stage as a Slurm job), runlog (where a run's whole output goes and what the console shows).
"""
