"""Stage `evaluate`: test-split loss, perplexity and bits per character next to a unigram baseline, plus samples.

Alone: `astrai stage evaluate` (what dvc.yaml runs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from astrai_core.checkpoint import load_model
from astrai_core.data import PackedTokens
from astrai_core.evaluate import sequence_nll, summarize, unigram_nll
from astrai_core.generate import generate_text
from astrai_core.errors import AstraiError
from astrai_core.io import atomic_path, sha256_file, write_json
from tasks.params import EvaluateParams


def evaluate(params: EvaluateParams, checkpoint_dir: Path, packed_dir: Path, out_dir: Path) -> dict:
    """Writes out_dir/metrics.json and out_dir/samples.md; returns the metrics."""
    model, tok, cfg = load_model(checkpoint_dir)
    torch.manual_seed(params.seed)
    with PackedTokens(packed_dir / "test.h5", expected_tokenizer_sha256=sha256_file(checkpoint_dir / "tokenizer.json")) as test:
        tokens = np.asarray(test.tokens[: params.max_tokens] if params.max_tokens else test.tokens[:])
    if len(tokens) < 2:
        raise AstraiError(f"{packed_dir / 'test.h5'}: the test split has fewer than 2 tokens")
    # Characters of the predicted text (every token but the first), special tokens excluded.
    n_chars = len(tok.decode(tokens[1:].tolist(), skip_special_tokens=True))
    nll, n = sequence_nll(model, tokens, cfg.max_seq_len, params.batch_size)
    base_nll, _ = unigram_nll(tokens, cfg.vocab_size)
    model_m, base_m = summarize(nll, n, n_chars), summarize(base_nll, n, n_chars)
    metrics = {f"test_{k}": v for k, v in model_m.items()}
    metrics |= {f"unigram_{k}": v for k, v in base_m.items()}
    metrics |= {"test_tokens": n, "test_chars": n_chars}

    lines = ["# Samples", ""]
    for prompt in params.prompts:
        for mode, temperature in (("greedy", 0.0), ("sampled", params.temperature)):
            gen = torch.Generator().manual_seed(params.seed)
            text = generate_text(model, tok, prompt, max_new_tokens=params.max_new_tokens, temperature=temperature,
                                 top_k=params.top_k, generator=gen)
            lines += [f"## {mode} (temperature {temperature}): {prompt!r}", "", "```", prompt + text, "```", ""]
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        write_json(tmp / "metrics.json", metrics)
        (tmp / "samples.md").write_text("\n".join(lines))
    return metrics
