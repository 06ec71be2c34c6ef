"""The free-text check of the evaluate stage (issue 50, 19): a continuation loops when a unit of 1-4 tokens repeats
4 or more times in a row."""

import numpy as np
import pytest

from tasks.evaluation.free_text import free_prompts, loops


@pytest.mark.parametrize("ids, looped", [
    ([5, 7, 9, 9, 9, 9], True),                      # "no no no no"
    ([5, 9, 9, 9, 7, 9], False),                     # three in a row is text ("O, O, O")
    ([1, 2, 1, 2, 1, 2, 1, 2], True),                # "yes no" four times
    ([1, 2, 1, 2, 1, 2, 3, 1, 2], False),
    ([4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], True),  # a unit of 4 tokens, 4 times
    ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5], False),  # a unit of 5 is longer than MAX_UNIT
    ([], False),
])
def test_a_loop_is_a_short_unit_repeated_four_times_in_a_row(ids, looped):
    assert loops(ids) is looped


def test_prompts_are_evenly_spaced_windows_of_the_test_split():
    tokens = np.arange(1000)
    prompts = free_prompts(tokens, 5, length=16)
    assert [p[0] for p in prompts] == [0, 246, 492, 738, 984] and all(len(p) == 16 for p in prompts)
    assert free_prompts(np.arange(10), 5, length=16) == [] and free_prompts(tokens, 0) == []
