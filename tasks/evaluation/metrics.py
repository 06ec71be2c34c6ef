"""The held-out metrics every model of the chain is scored on (tasks/stages/evaluate.py): name -> (label, which way is
better). The register stage picks the model it registers by one of them (`register.metric` in params.yaml), so
they live here, apart from the evaluation code: reading params must not import torch."""

from tasks.chat.demo_tasks import TASKS as FAMILIES

METRICS: dict[str, tuple[str, str]] = {
    "test_bits_per_char": ("test bits/char", "lower"),
    "sft_test_loss": ("SFT test loss", "lower"),
    "task_accuracy": ("task accuracy", "higher"),
    "pass_at_1": ("pass@1", "higher"),
    "pass_at_k": ("pass@k", "higher"),
    "valid_answer_rate": ("valid answer", "higher"),
    "preference_accuracy": ("preference accuracy", "higher"),
    "train_task_accuracy": ("task accuracy on training prompts", "higher"),
    "loop_free_rate": ("free text without a loop", "higher"),  # tasks/evaluation/free_text.py
    # lm-evaluation-harness tasks of evals/lm_eval_tasks/ (evaluate.lm_eval_tasks): <task>_<lm-eval metric>
    "astrai_next_speaker_acc": ("lm-eval who speaks next acc", "higher"),
    "astrai_next_speaker_acc_norm": ("lm-eval who speaks next acc_norm", "higher"),
    "astrai_speech_ppl_bits_per_byte": ("lm-eval speech bits/byte", "lower"),
    **{f"astrai_{family}_exact_match": (f"lm-eval {family} exact match", "higher") for family in FAMILIES},
}


# The task metrics (held out) and what guessing scores on each: a model no better than this on every one it has
# learned no task (tasks/stages/register.py no_skill). An exact answer is never guessed; a preference pair is a
# coin flip.
CHANCE: dict[str, float] = {"task_accuracy": 0.0, "pass_at_1": 0.0, "pass_at_k": 0.0, "preference_accuracy": 0.5}
# Which task metrics measure the same skill: giving exact answers (greedy or sampled), or preferring the right one.
# A champion chosen by one must beat chance on its own family (a model that prefers right answers it never gives
# has not learned to answer).
TASK_FAMILY: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("task_accuracy", "pass_at_1", "pass_at_k"), ("task_accuracy", "pass_at_1", "pass_at_k")),
    "preference_accuracy": ("preference_accuracy",)}


def better(metric: str, a: float, b: float) -> bool:
    """Whether value `a` of `metric` is strictly better than `b`."""
    return a < b if METRICS[metric][1] == "lower" else a > b


MAX_FORGETTING = 0.05  # the final model's test bits/char may exceed the pretrained model's by at most this share
