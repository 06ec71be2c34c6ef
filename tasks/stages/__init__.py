"""The pipeline's stages, one module each: corpus, tokenizer, pack, chat_data, training (every training stage: one
training core), dpo_reference, evaluate, register; runner wires each to its MLflow run (what `astrai stage NAME`
runs). Which stages there are, in which order, is the stage table's (tasks/run/table.py); importing a stage's module
does not import the runner."""
