"""`astrai promote SOURCE --to TARGET`: promotion between environments, as MLflow's registry intends now that stages
are deprecated: a registered version (e.g. models:/astrai@champion) is copied to another registered model (e.g.
astrai-prod) with MlflowClient.copy_model_version, and the target's alias (champion) moves to the copy.

The copy keeps every tag of the source version (its lineage: stage, params_hash, git_commit, mlflow_run_id, the
DVC hashes, its held-out metrics) and gets five more: promoted_by (user@host), promoted_at (UTC), promoted_from
(models:/NAME/VERSION), promoted_from_uri (SOURCE as given) and promotion (the decision, in words). The decision
is the register stage's gate (tasks/registry/gate.py gate), against the version the target's alias points to, on the source's register_metric: the
copy keeps mlflow_run_id, whose registration run holds the per-item results, so the paired interval applies as it
does at registration. The gate's absolute rule (register's no_skill: a task better than chance) needs no champion,
so it holds for a target without one too. A version that does not pass is refused (AstraiError, nothing copied)
unless `force`. The target's name and the alias are checked by MLflow's rules before anything is written. The
whole step runs under the registry lock of the target's name (registry_lock), so neither a registration nor
another promotion into it can interleave. Weights already in the target (the same weights_sha256) are not copied
again: the alias moves to that version, and a copy a cut-short promotion left without its promoted_* tags gets them.
"""

from __future__ import annotations

import contextlib
import datetime
import getpass
import io
import os
import socket

import mlflow
from mlflow.exceptions import MlflowException

from astrai_core.runtime.errors import AstraiError
from tasks.evaluation.metrics import CHANCE
from tasks.registry.gate import (PENDING, REGISTRATION, champion_record, gate, no_skill, version_record,
                                 versions_with_weights)
from tasks.registry.lock import registry_lock
from tasks.registry.model_card import model_card


def check_names(target: str, alias: str) -> None:
    """AstraiError naming the option unless `target` is a name MLflow registers and `alias` one it sets, by MLflow's
    own rules (its validators, so they stay MLflow's): checked before anything is written, since MLflow checks an
    alias only when it is set, after the copy, which left the target a version without it."""
    from mlflow.utils.validation import (_validate_model_alias_name, _validate_model_alias_name_reserved,
                                         _validate_model_name)

    from tasks.run.schema import unaddressable

    alias_checks = [_validate_model_alias_name, _validate_model_alias_name_reserved]
    for option, value, checks in (("--to", target, [_validate_model_name]), ("--alias", alias, alias_checks)):
        try:
            for check in checks:
                check(value)
        except MlflowException as e:
            raise AstraiError(f"{option} {value!r}: {e.message}") from None
    if why := unaddressable(target):  # MLflow registers 'x@y', which no models:/ URI can name
        raise AstraiError(f"--to {why}")


def absolute_rule(metric: str, values: dict) -> tuple[bool, str]:
    """(passed, why) on the register gate's rule that needs no champion (register's no_skill: no forgetting, and a
    version chosen by a task metric must beat chance on its family): it holds for an empty target too."""
    if unskilled := no_skill(metric, values):
        return False, f"fails the register gate's absolute rule: {unskilled}"
    if metric in CHANCE:
        return True, "passes the register gate's absolute rule (a task better than chance, no forgetting)"
    return True, (f"passes the register gate's absolute rule (no forgetting; its other half, a task better than "
                  f"chance, is for task metrics, not {metric})")


def promote(client: mlflow.MlflowClient, source: str, target: str, alias: str = "champion", force: bool = False,
            lock_uri: str | None = None) -> str:
    """Copy the version `source` names (models:/NAME@ALIAS or models:/NAME/VERSION) to registered model `target`
    and point the target's `alias` at it (see the module's docstring); returns what it did, in one line."""
    from tasks.registry.models import registry_version

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the gate reads the runs' items
    check_names(target, alias)
    try:
        src = registry_version(client, source)
    except MlflowException as e:
        raise AstraiError(f"{source}: {str(e.message).splitlines()[0]}") from None
    where = f"models:/{src.name}/{src.version}"
    if src.name == target:
        raise AstraiError(f"--to {target}: {source} is already a version of {target}; promote to another name")
    if src.tags.get(REGISTRATION) == PENDING:
        raise AstraiError(f"{source}: version {src.version}'s registration was cut short (tag registration=pending); "
                          "register again to finish it")
    metric = src.tags.get("register_metric")
    new = version_record(src)
    with registry_lock(lock_uri, target):
        held, current = champion_record(client, target, alias)
        same = [str(v.version) for v in versions_with_weights(client, target, src.tags["weights_sha256"])] \
            if "weights_sha256" in src.tags else []
        if held in same:
            return f"{where} ({source}) is {target}@{alias} already (version {held}): nothing to do"
        # The gate's absolute rule first, champion or not; then the comparison, when there is something to compare.
        if metric is None or new["values"].get(metric) is None:
            passed, why = False, f"{where} has no register_metric (not registered by the register stage?)"
        elif not (rule := absolute_rule(metric, new["values"]))[0]:
            passed, why = rule
        elif current is None:
            passed, why = True, f"{target} has no {alias}; {rule[1]}"
        elif current["values"].get(metric) is None:
            passed, why = True, f"{target}@{alias} (version {held}) has no {metric} to compare; {rule[1]}"
        else:
            passed, why = gate(metric, new, current)
            verdict = "passes" if passed else "fails"
            why = f"{verdict} the register gate against {target}@{alias} (version {held}): {why}"
        if not passed and not force:
            raise AstraiError(f"{where} not promoted to {target}: {why} (--force to promote anyway)")
        decision = why if passed else f"forced past the gate: {why}"
        if same:
            version, did = min(same, key=int), "already there as"
        else:
            with contextlib.redirect_stderr(io.StringIO()):  # MLflow prints its own three lines about it
                version, did = str(client.copy_model_version(where, target).version), "copied to"
        mv = client.get_model_version(target, version)
        if mv.source == where and "promoted_from" not in mv.tags:  # a copy (this one, or one a cut-short run made)
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            for key, value in {"promoted_by": f"{getpass.getuser()}@{socket.gethostname()}", "promoted_at": now,
                               "promoted_from": where, "promoted_from_uri": source, "promotion": decision}.items():
                client.set_model_version_tag(target, version, key, value)
            # its card names the copy and says where it came from (the source's described the source)
            mv = client.get_model_version(target, version)
            client.update_model_version(target, version, description=model_card(
                f"{target} version {version}", f"models:/{target}/{version}", mv.tags))
        client.set_registered_model_alias(target, alias, version)
    return f"promoted {where} ({source}): {did} {target} version {version}, now {target}@{alias}; {decision}"
