"""The pipeline's parts, each a plain function callable without Prefect or DVC, in five sub-packages:

* stages: one module per stage (corpus, tokenizer, pack, chat_data, training for every training stage,
  dpo_reference, evaluate, register) and runner (what `astrai stage NAME`, and so dvc.yaml, runs: each stage
  wired to its MLflow run);
* registry: the model registry beside the stages: model references (models), the model card, the registered
  MLflow pyfunc model, the champion gate and the registry lock, `astrai promote`;
* run: what a run shares: the stage table (table: the stages in order, what each reads and writes, each training
  stage's strategy and target; dvc.yaml is written from it), params.yaml's schema, reading a run's params (params:
  profiles, overrides), the checks before a run (checks), each training stage's TrainConfig (configs), tracking
  (MLflow runs), the checkout's run lock, the run's log, slurm (a training stage as a Slurm job);
* evaluation: what the evaluate stage scores with: the held-out metrics, its plots, lm-evaluation-harness;
* chat: the chat records' schema, the plays and the demo's chat tasks made from them.

Each sub-package imports only those after it: stages -> registry -> run -> evaluation -> chat (tests/test_layout.py).
"""
