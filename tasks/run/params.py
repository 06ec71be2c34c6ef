"""Reading a run's params: `params.yaml` (or another file) validated against the schema (tasks/run/schema.py), a
profile (profiles/NAME.yaml) and overrides (dotted keys) applied, and params.yaml swapped for the run's while the run
lasts (DVC reads params.yaml alone). A bad file, key or value stops here with one line naming it."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path
from typing import Any, Callable, NamedTuple

import yaml
from pydantic import ValidationError

from astrai_core.runtime.errors import AstraiError
from tasks.run.checks import check_inputs
from tasks.run.configs import check_train_configs
from tasks.run.schema import Params


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise AstraiError(f"override {dotted!r}: {key!r} is not a section")
    tree[leaf] = value


def validation_message(e: ValidationError) -> str:
    """A pydantic error as one line that names the key: `pretrain.optim.lr: Input should be greater than 0`. An
    unknown key comes first: a misspelt key also makes the key it was meant to be look missing."""
    err = min(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
    key = ".".join(str(p) for p in err["loc"])
    msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"{key + ': ' if key else ''}{msg}{more}"


def parse_params(raw: dict, source: str = "params.yaml") -> Params:
    """Validate a params mapping read from `source`, whose folder is the project root its paths are under."""
    try:
        params = Params.model_validate(raw)
    except ValidationError as e:
        raise AstraiError(f"{source}: {validation_message(e)}") from None
    try:
        check_train_configs(params, Path(source).resolve().parent)
    except ValueError as e:
        raise AstraiError(f"{source}: {e}") from None
    return params


def load_raw(path: str | Path) -> dict:
    """A YAML file's top-level mapping; a syntax error names its line."""
    path = Path(path)
    if not path.is_file():
        raise AstraiError(f"{path}: file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise AstraiError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise AstraiError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise AstraiError(f"{path}: expected a mapping of sections at the top level")
    return raw


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Read and validate `path`; `overrides` maps dotted keys (e.g. "pretrain.max_steps") to values."""
    raw = load_raw(path)
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, value)
    return parse_params(raw, str(path))


# ---- a run's params: params.yaml with a profile and overrides (flows/pipeline.py puts them in place) ----------

PROFILES_DIR = Path("profiles")


def load_profile(root: Path, name: str) -> dict[str, Any]:
    """profiles/NAME.yaml: the params a profile changes, as a nested mapping like params.yaml's."""
    known = sorted(p.stem for p in (root / PROFILES_DIR).glob("*.yaml") if p.is_file())
    if name not in known:  # a name, never a path: "../params" would merge params.yaml itself as a profile
        raise AstraiError(f"--profile {name}: no such profile; profiles: {', '.join(known) or 'none'} "
                          f"(the names of {PROFILES_DIR}/*.yaml)")
    return load_raw(root / PROFILES_DIR / f"{name}.yaml")


def profile_overrides(root: Path, name: str, overrides: dict[str, Any] | None = None) -> list[str]:
    """profiles/NAME.yaml as DVC's -S overrides (`dvc exp run $(astrai profile-args NAME)`): KEY=VALUE for each leaf
    where params.yaml has a section, the whole value where it has none (a null lora), as _merge applies it;
    +KEY=VALUE where params.yaml leaves the key out. The profile's name travels too (register.profile: the model
    registers as `<model_name>-NAME`, tagged with it, as `astrai pipeline --profile NAME` does), and `overrides`
    (dotted keys) after it, as --set wins over a profile."""
    out: list[str] = []

    def walk(changes: dict, tree: dict, prefix: str) -> None:
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(tree.get(key), dict):
                walk(value, tree[key], f"{prefix}{key}.")
            else:  # "+": a key params.yaml leaves out (to its default) is added, as Hydra's grammar wants
                add = "" if key in tree else "+"
                _override_value(str(key), f"profiles/{name}.yaml: {prefix}{key}")  # a key the shell would split
                out.append(f"{add}{prefix}{key}={_override_value(value, f'profiles/{name}.yaml: {prefix}{key}')}")

    profile = load_profile(root, name)
    _merge(profile, {"register": {"profile": name}})
    changes: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        set_dotted(changes, key, value)
    _merge(profile, changes)
    # what `astrai pipeline --profile NAME` would refuse (an unknown key, a bad value), refused here too
    parse_params(yaml.safe_load(run_params_text(root / "params.yaml", {}, profile)) or {}, f"profiles/{name}.yaml")
    walk(profile, load_raw(root / "params.yaml"), "")
    return out


def _override_value(value: Any, where: str, nested: bool = False) -> str:
    """`value` in Hydra's override grammar (what DVC's -S reads), without spaces: the shell splits $(...) there. A
    `:` is a plain character at the top (models:/NAME@ALIAS), a key's end inside {...}."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_value(v, where, True)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v, where, True) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = str(value)
    if not text or any(ch.isspace() or ch in "'\"=,[]{}*?" + ":" * nested for ch in text):  # split or expanded
        raise AstraiError(f"{where}: {text!r} cannot be passed as one -S word; set it with -S by hand")
    return text


def _merge(tree: dict, changes: dict) -> None:
    """Set every leaf of `changes` in `tree`, keeping the keys (and comments) of `tree` that it does not name."""
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _merge(tree[key], value)
        else:
            tree[key] = value


def run_params_text(source: Path, overrides: dict[str, Any], profile: dict[str, Any] | None = None) -> str:
    """The text of a run's params: `source` with a profile merged in, then `overrides` (dotted keys) set, its
    comments and order kept."""
    from ruamel.yaml import YAML  # round-trip YAML: comments survive an edit (PyYAML drops them)

    rt = YAML()
    rt.preserve_quotes = True
    rt.width = 4096  # never re-wrap the user's long lines
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    tree = rt.load(source.read_text())
    _merge(tree, profile or {})
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    out = io.StringIO()
    rt.dump(tree, out)
    return out.getvalue()


class RunParams(NamedTuple):
    """A run's params, parsed once: the validated Params, and the text params.yaml must hold while the run lasts
    (None: params.yaml as it is)."""

    params: Params
    text: str | None


def params_of_run(root: Path, params_path: str, overrides: dict[str, Any] | None, profile: str | None) -> RunParams:
    """A run's params: `params_path` with a profile and overrides applied, parsed once, and the inputs the run will
    read checked (check_inputs). A bad file, profile, override or input stops here with one line naming it, before
    any stage (or a Prefect server) starts."""
    target = root / "params.yaml"
    source = (root / params_path).resolve()
    changes = None
    if profile:  # the profile's keys, and its name: what the register stage names and tags the model by
        changes = load_profile(root, profile)
        _merge(changes, {"register": {"profile": profile}})
    if source == target.resolve() and not overrides and not changes:
        resolved = RunParams(load_params(target), None)
    else:
        load_raw(root / params_path)  # a missing file or bad YAML: one line naming it
        text = run_params_text(source, overrides or {}, changes)
        resolved = RunParams(parse_params(yaml.safe_load(text) or {}, str(root / params_path)), text)  # what stages read
    check_inputs(resolved.params, root, str(root / params_path))
    return resolved


PARAMS_BACKUP = Path(".astrai") / "params.yaml.user"
PARAMS_OF_RUN = Path(".astrai") / "params.yaml.run"


def restore_user_params(root: Path) -> str | None:
    """Put the user's params.yaml back if a run left its own there (it ended, or was killed before it could).
    Returns a line saying what happened, or None when there was nothing to restore."""
    target, backup, ours = root / "params.yaml", root / PARAMS_BACKUP, root / PARAMS_OF_RUN
    if not backup.exists():
        return None
    if target.exists() and ours.exists() and target.read_bytes() != ours.read_bytes():
        # Someone edited params.yaml while the run used it: their edit wins.
        backup.unlink()
        ours.unlink()
        return "params.yaml was edited during the run: kept as it is"
    os.replace(backup, target)
    ours.unlink(missing_ok=True)
    return "params.yaml restored to the user's file"


@contextlib.contextmanager
def run_params(root: Path, params_path: str, overrides: dict[str, Any] | None, log: Callable[[str], None] = print,
               profile: str | None = None, resolved: RunParams | None = None):
    """params.yaml holds this run's params (another params file, a profile, overrides) only while the run lasts.

    DVC reads params from params.yaml alone, so the run's params must be there while its stages run, or
    dvc.lock would record params the outputs were not made with. Afterwards (success, failure, cancel) the
    user's file is back byte for byte; a run killed before it could restore it is undone at the next start.
    dvc.lock keeps what the outputs were made with, so `dvc status` then names the overridden params as changed,
    and the next run without overrides reruns those stages.
    """
    note = restore_user_params(root)
    if note:
        log(f"{note} (left by an interrupted run)")
    resolved = resolved or params_of_run(root, params_path, overrides, profile)
    text = resolved.text
    if text is None:
        yield resolved.params
        return
    target = root / "params.yaml"
    (root / PARAMS_BACKUP).parent.mkdir(exist_ok=True)
    shutil.copy2(target, root / PARAMS_BACKUP)
    (root / PARAMS_OF_RUN).write_text(text)
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
    try:
        yield resolved.params
    finally:
        log(restore_user_params(root) or "params.yaml: nothing to restore")
