"""The pipeline's parts, each a plain function callable without Prefect or DVC, in five sub-packages:

* stages: one module per stage (corpus, tokenizer, pack, chat_data, training for pretrain/sft/dpo/grpo,
  dpo_reference, evaluate, register) and the stage table (tasks/stages/table.py: the stages in order with their
  paths, what `astrai stage NAME` and dvc.yaml run);
* registry: the model registry beside the stages: model references (models), the model card, the registered
  MLflow pyfunc model, the champion gate and the registry lock, `astrai promote`;
* evaluation: what the evaluate stage scores with: the held-out metrics, its plots, lm-evaluation-harness;
* chat: the chat records' schema, the plays and the demo's chat tasks made from them;
* run: what a run shares: params (params.yaml as pydantic models), layout (every stage's directory), tracking
  (MLflow runs), the checkout's run lock, the run's log, slurm (a training stage as a Slurm job).

Each sub-package imports only those after it: stages -> registry -> run -> evaluation -> chat (tests/test_layout.py).
"""
