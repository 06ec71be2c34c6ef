"""Free text: does a model still continue text as the pretrained model did, or do post-training's answers take over?

A post-trained model can score well on its tasks and still lose the language its pretraining gave it: the demo's
final model once continued "My lords, hath no follow that day?" with "Iyesnomurynononononononosetnonononono", its
task answers ("yes", "no") looping through free text. Each model continues the same prompts (windows of the
held-out test split) with the same sampling settings and seeds; a continuation *loops* when some unit of 1 to
MAX_UNIT tokens repeats MIN_REPEATS or more times in a row ("no no no no", "yes no yes no yes no yes no"). The metric
is the share of continuations without a loop (`loop_free_rate`, per item 0/1, so the evaluate stage pairs it like an
accuracy), and the final model must keep the pretrained model's (tasks/stages/evaluate.py stage_checks).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from astrai_core.inference.generate import generate_batch
from astrai_core.runtime.device import model_device

MAX_UNIT = 4  # tokens in the repeating unit, at most
MIN_REPEATS = 4  # times in a row it must repeat to count as a loop
PROMPT_TOKENS = 16  # each prompt: this many test tokens


def loops(ids: Sequence[int], max_unit: int = MAX_UNIT, min_repeats: int = MIN_REPEATS) -> bool:
    """Whether `ids` holds a unit of 1..max_unit tokens repeated min_repeats or more times in a row."""
    ids = list(ids)
    for unit in range(1, max_unit + 1):
        run = unit  # tokens so far that repeat the unit before them, counting the first unit
        for i in range(unit, len(ids)):
            run = run + 1 if ids[i] == ids[i - unit] else unit
            if run >= unit * min_repeats:
                return True
    return False


def free_prompts(tokens: np.ndarray, count: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """`count` prompts of `length` tokens each, from evenly spaced places of the test split (fewer if it is short)."""
    starts = np.linspace(0, len(tokens) - length, num=count, dtype=int) if len(tokens) >= length else []
    return [tokens[s:s + length].tolist() for s in sorted(set(int(s) for s in starts))]


@torch.no_grad()
def loop_free(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_k: int | None,
              seed: int, batch_size: int = 64) -> list[int]:
    """Per prompt, 1 if the model's sampled continuation (max_new_tokens, no stop: as samples.md's) does not loop,
    else 0; seeded, in batches of the same prompts for every model."""
    max_new_tokens = min(max_new_tokens, model.cfg.max_seq_len - max(map(len, prompts)))
    generator = torch.Generator(device=model_device(model)).manual_seed(seed)
    out = []
    for i in range(0, len(prompts), batch_size):
        for ids in generate_batch(model, prompts[i:i + batch_size], max_new_tokens, temperature=temperature,
                                  top_k=top_k, generator=generator):
            out.append(int(not loops(ids)))
    return out
