"""The one progress helper (astrai_core/runtime/progress.py): counts, time so far and an eta, from whichever loop is
running under a stage's Progress; the interval is a parameter (0: a line at every step), so nothing here is timed."""

from __future__ import annotations

from astrai_core.runtime.progress import Progress, advance, expect


def test_a_line_per_step_at_interval_zero_with_counts_and_eta():
    lines: list[str] = []
    advance(5)  # no Progress open: nothing counts, nothing breaks
    with Progress("dpo_reference", every=0, out=lines.append) as p:
        expect(4, "prompts")
        for _ in range(4):
            advance()
        assert p.done == 4
        inner: list[str] = []
        with Progress("evaluate: sft", every=0, out=inner.append):
            expect(None, "questions")  # a loop that does not know its total says how many so far
            advance(3)
        advance(0)
    assert [line.split(", ")[0] for line in lines] == [f"dpo_reference: {i}/4 prompts ({i * 25}%)" for i in
                                                        (1, 2, 3, 4)] + ["dpo_reference: 4/4 prompts (100%)"]
    assert all(", eta " in line and "s so far" in line for line in lines)
    assert inner == ["evaluate: sft: 3 questions, 0s so far"]
