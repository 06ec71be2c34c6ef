"""The champion gate, shared by the register stage and `astrai promote`: what it knows of a model (its held-out
metrics with their intervals and its per-item results: gate_record for a model of the chain, version_record for a
registered version, champion_record for the version an alias points to) and whether a new one takes alias
champion from the old (gate). Also the tag a version carries while its aliases are decided (REGISTRATION)."""

from __future__ import annotations

import mlflow
from mlflow.exceptions import MlflowException

from astrai_core.scoring.statistics import paired_difference
from tasks.evaluation.metrics import CHANCE, MAX_FORGETTING, METRICS, TASK_FAMILY, better

# A version's tag `registration`: "pending" from its creation until its aliases are decided, then "done". A version
# left pending (the stage was killed in between) is finished by the next registration of the same weights.
REGISTRATION, PENDING = "registration", "pending"


# The champion gate. The register metric must beat the champion's beyond the interval, and the other headline
# metrics (evaluate's HEADLINE: language modeling, the task, the preferences) must not regress beyond theirs: with
# the per-item results of both on the same items, the paired 95% interval evaluate's stage checks use
# (astrai_core.scoring.statistics.paired_difference); else, for accuracies, their own 95% intervals must not overlap;
# test bits/char may regress by MAX_FORGETTING at most, evaluate's forgetting rule (it has no interval).
GUARDED = ("test_bits_per_char", "task_accuracy", "preference_accuracy")
# The relative change of test bits/char from the model the chain started from (pretrain: trained here, or the
# published model pretrain.init_from names) to this one: a version carries it as a tag, and one beyond
# MAX_FORGETTING is never champion (no_skill), whatever else it learned.
CHAIN_START, FORGETTING = "pretrain", "forgetting"
GATE_ITEMS = "registration_items.json"  # the version's per-item results, logged with its registration run


def gate_record(metrics: dict, items: dict, stage: str) -> dict:
    """What the gate knows of one model: its held-out metrics with their intervals, its per-item results and which
    items they are (evaluate's items.json)."""
    values = {k.removeprefix(f"{stage}/"): v for k, v in metrics.items() if k.startswith(f"{stage}/")}
    start = metrics.get(f"{CHAIN_START}/test_bits_per_char")
    if stage != CHAIN_START and start and "test_bits_per_char" in values:  # evaluate's forgetting rule, as a value
        values[FORGETTING] = values["test_bits_per_char"] / start - 1
    return {"values": values, "items": {m: r[stage] for m, r in items.items() if isinstance(r, dict) and stage in r
                                         and m in METRICS},
            "item_sets": items.get("item_sets", {})}


def version_by_alias(client: mlflow.MlflowClient, name: str, alias: str):
    """The ModelVersion alias `alias` of model `name` points to; None when the model or the alias does not exist.
    Only those two answers mean none (the store's RESOURCE_DOES_NOT_EXIST and INVALID_PARAMETER_VALUE, the same
    through the server): a registry that failed or did not answer (its database down) raises, since "no champion"
    would let the gate pass anything, and a registry back by the next call would take the copy or the alias."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def versions_with_weights(client: mlflow.MlflowClient, name: str, weights_sha256: str) -> list:
    """The versions of registered model `name` tagged with these weights (tag weights_sha256; aliases left empty).
    The filter names only the hash: MLflow's filter strings have no escape for a quote, which a model's name may
    hold (a'b), so the name is compared here."""
    return [v for v in client.search_model_versions(f"tags.weights_sha256 = '{weights_sha256}'") if v.name == name]


def champion_record(client: mlflow.MlflowClient, name: str, alias: str = "champion") -> tuple[str | None, dict | None]:
    """(version, version_record) of the version alias `alias` (the champion) points to; (None, None) without one."""
    champ = version_by_alias(client, name, alias)
    return (None, None) if champ is None else (str(champ.version), version_record(champ))


def version_record(mv) -> dict:
    """gate_record of a registered version, from its tags and its registration run's GATE_ITEMS (none when it was
    registered without them: its own intervals only). A copy (`astrai promote`) keeps the tags, so the same."""
    record = {"values": {k: float(v) for k, v in mv.tags.items() if k in METRICS or k == FORGETTING
                         or k.rsplit("_", 1)[0] in METRICS and k.endswith(("_low", "_high"))},
              "items": {}, "item_sets": {}}
    run_id = mv.tags.get("mlflow_run_id")
    if run_id:
        try:
            record |= mlflow.artifacts.load_dict(f"runs:/{run_id}/{GATE_ITEMS}")
        except (MlflowException, OSError):
            pass  # registered before the gate kept per-item results: intervals of their own only
    return record


def _compare(metric: str, new: dict, old: dict) -> tuple[str, float, float | None, float | None] | None:
    """How `new` compares with `old` on `metric`: (kind, difference new - old, low, high), kind "paired" (same
    items), "intervals" (each one's 95% interval; low/high: the gap between them) or "values" (no interval); None
    when either lacks the metric."""
    a, b = new["values"].get(metric), old["values"].get(metric)
    if a is None or b is None:
        return None
    same_items = (metric in new["items"] and metric in old["items"]
                  and new["item_sets"].get(metric) is not None
                  and new["item_sets"].get(metric) == old["item_sets"].get(metric))
    if same_items:
        return ("paired", *paired_difference(old["items"][metric], new["items"][metric]))
    lows, highs = (new["values"].get(f"{metric}_low"), old["values"].get(f"{metric}_low")), \
        (new["values"].get(f"{metric}_high"), old["values"].get(f"{metric}_high"))
    if None not in lows + highs:  # new's interval against old's: apart, or overlapping
        return "intervals", a - b, lows[0] - highs[1], highs[0] - lows[1]
    return "values", a - b, None, None


def gate(metric: str, new: dict, old: dict) -> tuple[bool, str]:
    """(whether `new` takes alias champion from `old`, why, in words)."""
    higher = METRICS[metric][1] == "higher"
    kind, diff, low, high = _compare(metric, new, old) or ("values", 0.0, None, None)
    if kind == "values":
        beats = better(metric, new["values"][metric], old["values"][metric])
        why = "no interval: compared by value"
    else:
        beats = (low > 0) if higher else (high < 0)
        what = "paired 95% interval" if kind == "paired" else "95% intervals' gap"
        why = f"{diff:+.4f}, {what} {low:+.4f} to {high:+.4f}: {'beyond' if beats else 'inside'} the interval"
    reasons = [f"{metric}: {why}"]
    regressed = []
    for guard in GUARDED:
        if guard == metric or (found := _compare(guard, new, old)) is None:
            continue
        kind, diff, low, high = found
        if guard == "test_bits_per_char":
            change = new["values"][guard] / old["values"][guard] - 1
            if change > MAX_FORGETTING:
                regressed.append(f"{guard} {change:+.1%} (more than {MAX_FORGETTING:.0%} worse)")
        elif kind != "values" and (high < 0 if METRICS[guard][1] == "higher" else low > 0):
            regressed.append(f"{guard} {diff:+.4f} (worse beyond the interval: {low:+.4f} to {high:+.4f})")
    if regressed:
        reasons.append("regresses " + ", ".join(regressed))
    return beats and not regressed, "; ".join(reasons)


def no_skill(metric: str, values: dict) -> str | None:
    """Why a model with these held-out metrics must never be champion, or None. The gate's absolute rule, which
    needs no champion to compare with: the model forgets (test bits/char more than MAX_FORGETTING above the chain's
    start: FORGETTING), or, chosen by a task metric (`metric` in metrics.CHANCE), it beats chance on no metric of
    that metric's own family (its 95% interval reaches chance; without one, its value), e.g. a quick run's 0.000 on
    every task, or a model that prefers the right answer but never gives it. register.metric: test_bits_per_char
    crowns on language modeling alone (the forgetting rule still holds)."""
    if values.get(FORGETTING, 0.0) > MAX_FORGETTING:
        return (f"it forgets: test bits/char {values[FORGETTING]:+.1%} over the model its chain started from (more "
                f"than {MAX_FORGETTING:.0%}; evaluate's forgetting rule)")
    if metric not in CHANCE:
        return None
    tasks = [m for m in TASK_FAMILY[metric] if m in values]
    if any(values.get(f"{m}_low", values[m]) > CHANCE[m] for m in tasks):
        return None
    scores = ", ".join(f"{m} {values[m]:.3f}" + (f" [{values[f'{m}_low']:.3f}, {values[f'{m}_high']:.3f}]"
                                                  if f"{m}_low" in values and f"{m}_high" in values else "")
                       for m in tasks) or f"no {metric}"
    return (f"no task better than chance ({scores}; the family of register metric {metric}): a champion must have "
            "learned the task it is chosen by")
