"""The pipeline's stages, one module each: corpus, tokenizer, pack, chat_data, training (pretrain, sft, dpo, grpo:
one training core), dpo_reference, evaluate, register. table lists them in order with their paths (what
`astrai stage NAME` and dvc.yaml run); importing a stage's module does not import the table."""
