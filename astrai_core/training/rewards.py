"""GRPO reward functions: a plain mapping from name to function(completion, record) -> float.

`record` is the prompt's JSONL record ({"prompt", "answer", "options"?, ...}); `completion` is the generated reply
(decoded, cut at the first stop token). Add your own by putting it in REWARDS before training, or name one as
"package.module:function" in params (grpo.rewards), which is imported at run time.
"""

from __future__ import annotations

import importlib
from typing import Callable

from astrai_core.runtime.errors import AstraiError

RewardFn = Callable[[str, dict], float]


def exact_answer(completion: str, record: dict) -> float:
    """1 when the reply, stripped, is exactly the reference answer."""
    return float(completion.strip() == str(record["answer"]).strip())


def valid_option(completion: str, record: dict) -> float:
    """1 when the reply is one of the listed options (right or wrong): rewards following the format."""
    return float(completion.strip() in [str(o).strip() for o in record.get("options", [])])


def option_prefix(completion: str, record: dict) -> float:
    """Dense shaping for multiple choice: the longest share of an option's name that the reply starts with
    (1 for an exact option). Rewards a partly copied name before the model can copy whole ones."""
    reply = completion.strip()
    best = 0.0
    for option in (str(o).strip() for o in record.get("options", [])):
        n = 0
        while n < min(len(reply), len(option)) and reply[n] == option[n]:
            n += 1
        score = n / max(len(option), len(reply), 1)  # a reply longer than the option is penalized too
        best = max(best, score)
    return best


REWARDS: dict[str, RewardFn] = {"exact_answer": exact_answer, "valid_option": valid_option,
                                 "option_prefix": option_prefix}


def resolve_reward(name: str) -> RewardFn:
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise AstraiError(f"reward {name!r}: cannot import ({e})") from None
    raise AstraiError(f"unknown reward {name!r}; known: {', '.join(REWARDS)} (or 'module:function')")
