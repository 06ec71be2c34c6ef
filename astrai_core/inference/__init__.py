"""Decoding: the next token from logits, and the loops that run the model for it.

    sampling.py  the next token of every row (greedy, temperature, top-k, top-p, per-row generators): one function
                 for every decoder here
    generate.py  generate / generate_batch / generate_text: a decode loop over a KV cache for one prompt or a batch
                 (GRPO rollouts, evaluate, dpo_reference, `astrai generate`)
    engine/      the serving engine: continuous batching over a paged KV cache with prefix caching (astrai serve)
"""
