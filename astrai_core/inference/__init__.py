"""Decoding: the next token from logits, and the loops that run the model for it.

    sampling.py  the next token of every row (greedy, temperature, top-k, top-p, per-row generators): one function
                 for every decoder here
    generate.py  generate / generate_text: one prompt on the model's plain KV-cached path (`astrai generate`, the
                 reference the engine is tested against); generate_batch: a batch through the engine (GRPO
                 rollouts, evaluate, lm-eval)
    engine/      the serving engine: continuous batching over a paged KV cache with prefix caching (astrai serve,
                 and generate_batch in the caller's thread): the one batched decoder
"""
