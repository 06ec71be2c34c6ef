"""The environment of astrai_core/runtime/env.py (telemetry off, MLflow's HTTP retries, Prefect's temporary-server
start-up timeout) is set by every process entry point before Prefect, MLflow or DVC is imported, and the Makefile
exports the same values (it includes astrai_core/runtime/env.defaults), so neither can drift from the one place they are
written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from astrai_core.runtime import env
from conftest import PROJECT_ROOT

# Each process entry point: how a process starts it (the module run as __main__ with these arguments, or imported,
# as a Prefect worker imports a deployment's entry module).
ENTRIES = {
    "astrai.cli": ("run", ["--help"]),  # `astrai` ([project.scripts]), and so every stage dvc.yaml runs
    "flows.pipeline": ("import", []),  # the deployment's entrypoint (prefect.yaml), imported by a Prefect worker
    # what torchrun starts on every rank (astrai_core/training/distributed.py)
    "astrai_core.training.train": ("run", ["--help"]),
}

# Runs one entry in a fresh interpreter and prints, last, the defaults' keys as the environment had them when Prefect,
# MLflow and DVC were first imported (each that the entry imports) and at the end.
PROBE = """
import importlib, json, os, runpy, sys
keys, (entry, (how, args)) = json.loads(sys.argv[1]), json.loads(sys.argv[2]).popitem()
seen = {}

class Probe:  # sees every import before it happens
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in ("prefect", "mlflow", "dvc") and top not in seen:
            seen[top] = {k: os.environ.get(k) for k in keys}

sys.meta_path.insert(0, Probe())
sys.argv = [entry, *args]
try:
    runpy.run_module(entry, run_name="__main__", alter_sys=True) if how == "run" else importlib.import_module(entry)
except SystemExit:
    pass
seen["end"] = {k: os.environ.get(k) for k in keys}
print("\\nPROBE " + json.dumps(seen))
"""


def without_defaults() -> dict[str, str]:
    """This environment less every key env.defaults sets (conftest applied them to this process)."""
    return {k: v for k, v in os.environ.items() if k not in env.DEFAULTS} | {"PYTHONPATH": str(PROJECT_ROOT)}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_an_entry_point_sets_the_environment_before_prefect_mlflow_or_dvc(entry):
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(sorted(env.DEFAULTS)),
                          json.dumps({entry: ENTRIES[entry]})], cwd=PROJECT_ROOT, env=without_defaults(),
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-2000:]
    seen = json.loads(lines[-1].removeprefix("PROBE "))
    wrong = {point: {k: v for k, v in values.items() if v != env.DEFAULTS[k]} for point, values in seen.items()}
    assert not any(wrong.values()), f"{entry}: unset or otherwise at the first import of each, at the end: {wrong}"


def test_the_entry_points_are_those_checked():
    """A new process entry point (a module with a __main__ block, a [project.scripts] command, a Prefect deployment's
    entrypoint) fails here until it is in ENTRIES, and so checked above."""
    sources = [p for pkg in ("astrai", "astrai_core", "tasks", "flows", "serving")
               for p in (PROJECT_ROOT / pkg).rglob("*.py")]
    mains = {".".join(p.relative_to(PROJECT_ROOT).with_suffix("").parts) for p in sources
             if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M)}
    pyproject = (PROJECT_ROOT / "pyproject.toml").read_text()
    scripts_section = re.search(r"^\[project\.scripts\]\n(.*?)(?:^\[|\Z)", pyproject, re.M | re.S)[1]
    scripts = set(re.findall(r'^[\w-]+ = "([\w.]+):\w+"', scripts_section, re.M))
    deployments = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())["deployments"]
    flows = {d["entrypoint"].split(":")[0].removesuffix(".py").replace("/", ".") for d in deployments}
    assert scripts and flows
    assert mains | scripts | flows == set(ENTRIES)


def make_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment the Makefile's recipes run with (what `make demo` and `make server` pass on)."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "print-env-for-test: ; @env",
                          "print-env-for-test"], cwd=PROJECT_ROOT, env=environ, capture_output=True, text=True,
                         timeout=60, check=True)
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def test_the_makefile_exports_the_same_values():
    """Every default reaches the Makefile's recipes with env.defaults' value, and, as with env.apply, a value the
    caller's environment has wins."""
    recipes = make_env(without_defaults())
    assert {k: recipes.get(k) for k in env.DEFAULTS} == env.DEFAULTS
    mine = {k: f"{v}-callers" for k, v in env.DEFAULTS.items()}
    recipes = make_env(without_defaults() | mine)
    assert {k: recipes.get(k) for k in env.DEFAULTS} == mine


def test_a_line_that_is_not_an_assignment_is_refused(tmp_path):
    (tmp_path / "env.defaults").write_text("# telemetry\nexport DO_NOT_TRACK ?= 1\nDVC_NO_ANALYTICS=1\n")
    with pytest.raises(ValueError, match=r"env\.defaults:3: not `export KEY \?= VALUE`"):
        env.read_defaults(tmp_path / "env.defaults")
