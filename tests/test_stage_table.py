"""The stage table (tasks/run/table.py) is the one list of stages: dvc.yaml is written from it, and a new
post-training stage added to it (and its params.yaml section) runs through DVC, the flow, evaluation and the
registry with nothing else edited."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astrai_core.runtime.errors import AstraiError
from astrai_core.training.strategies import STRATEGIES
from tasks.evaluation.metrics import METRICS
from tasks.run.schema import SECTIONS, Params
from tasks.run import table
from tasks.run.table import STAGES, TRAINING, Stage, TrainingStage, check_dvc_yaml, check_table, dvc_yaml

ROOT = Path(__file__).resolve().parents[1]


def astrai(*args) -> list[str]:
    return [sys.executable, "-m", "astrai.cli", *args]


def test_the_committed_dvc_yaml_is_the_tables():
    assert (ROOT / "dvc.yaml").read_text() == dvc_yaml(), "run `astrai dvc-yaml` and commit dvc.yaml"


def test_the_training_code_covers_every_file_the_ranks_import():
    """TRAINING_CODE is what DVC reruns the training stages on: every project file the training ranks import
    (astrai_core/training/train.py, each import followed wherever it stands, a package's __init__ included) lies
    in one of its entries, so an edit to any of them reruns the training stages."""
    from test_layout import imports_of, module_name

    files = {module_name(p): p for p in (ROOT / "astrai_core").rglob("*.py")}
    seen, todo = set(), ["astrai_core.training.train"]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for n in {name, *(".".join(parts[:i]) for i in range(2, len(parts)))} - seen:  # and its packages
            seen.add(n)
            todo.extend(m for m in imports_of(files[n]) if m in files)
    covered = [ROOT / entry for entry in table.TRAINING_CODE]
    outside = sorted(str(files[n].relative_to(ROOT)) for n in seen
                     if not any(files[n] == c or c in files[n].parents for c in covered))
    assert len(seen) > 30 and not outside, f"the training ranks import files TRAINING_CODE misses: {outside}"


def test_every_entry_names_what_exists():
    """Each stage reads only stages before it and source files that exist; each training stage has a strategy of the
    training core, a params section of its strategy, and targets that are metrics."""
    seen: set[str] = set()
    for stage in STAGES:
        for read in stage.reads:
            assert read.split("/")[0] in seen, f"{stage.name} reads {read}, which is not a stage before it"
        for path in stage.code:
            assert (ROOT / path).exists(), f"{stage.name}: {path} does not exist"
        seen.add(stage.name)
    for name, stage in TRAINING.items():
        assert stage.strategy in STRATEGIES and stage.strategy in SECTIONS, name
        assert isinstance(getattr(Params(), name), SECTIONS[stage.strategy])
        assert all(m in METRICS for m in (*([stage.target] if stage.target else []), *stage.keep)), name


@pytest.mark.parametrize("entry,says", [
    (TrainingStage("polish", strategy="sfft", reads=("chat_data",)), "stage 'polish': strategy 'sfft'; one of seq, "),
    (TrainingStage("polish", reads=("chat_dat",)), "stage 'polish': reads 'chat_dat', which is not a stage before it"),
    (Stage("polish", reads=("register",)), "stage 'polish': reads 'register', which is not a stage before it"),
    (Stage("sft"), "stage 'sft': a second stage of that name"),
    (Stage("polish", models="after"), "stage 'polish': models 'after'"),
])
def test_a_table_entry_an_edit_left_wrong_is_one_line_naming_it(monkeypatch, entry, says):
    """What `astrai dvc-yaml` and every command that reads params say (schema.py checks the table on import)."""
    monkeypatch.setattr(table, "STAGES", (*STAGES[:-2], entry, *STAGES[-2:]))
    with pytest.raises(AstraiError, match="^tasks/run/table.py: " + re.escape(says)):
        check_table(SECTIONS)


def test_a_dvc_yaml_that_is_not_the_tables_is_refused_and_rewritten(tmp_path):
    shutil.copytree(ROOT / "tasks", tmp_path / "tasks", ignore=shutil.ignore_patterns("__pycache__"))  # a checkout
    env_cwd = dict(cwd=tmp_path, capture_output=True, text=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(tmp_path)})
    with pytest.raises(AstraiError, match="dvc.yaml: missing; it is written from the stage table"):
        check_dvc_yaml(tmp_path)
    (tmp_path / "dvc.yaml").write_text(dvc_yaml().replace("      - astrai_core/training\n", "", 1))
    with pytest.raises(AstraiError, match=r"dvc.yaml: differs from the stage table .* run `astrai dvc-yaml`"):
        check_dvc_yaml(tmp_path)
    out = subprocess.run(astrai("dvc-yaml", "--check"), **env_cwd)
    assert out.returncode == 2 and "differs from the stage table" in out.stderr.splitlines()[-1], out.stderr
    out = subprocess.run(astrai("dvc-yaml"), **env_cwd)
    assert out.returncode == 0 and "written from the stage table" in out.stdout, out.stderr
    check_dvc_yaml(tmp_path)
    assert list(yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"]) == [s.name for s in STAGES]


# A stage no one wrote code for: a second SFT pass after grpo, trained from the last enabled model before it.
NEW_STAGE = '''    TrainingStage("polish", strategy="sft", reads=("chat_data",), train_data="data/chat/sft_train.h5",
                  val_data="data/chat/sft_test.h5", target="task_accuracy"),
'''


@pytest.mark.integration
def test_a_new_post_training_stage_is_its_table_entry_and_params_section(tmp_path):
    """The new stage in a temporary checkout, through the table and params.yaml (dvc.yaml written by `astrai
    dvc-yaml`): the quick pipeline trains it from the model before it, evaluates it against that model on its
    target, reports it in the headline, and takes it as the chain's final model."""
    from conftest import make_quick_project, run_ok

    repo, env = make_quick_project(tmp_path)
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "commit", "-qm", "the quick profile"], repo, env)
    table = repo / "tasks/run/table.py"
    text = table.read_text()
    anchor = '    # Every model of the chain side by side'
    assert text.count(anchor) == 1
    table.write_text(text.replace(anchor, NEW_STAGE + anchor))
    with (repo / "params.yaml").open("a") as f:
        f.write("polish:\n  batch_size: 4\n  max_steps: 4\n  log_every: 2\n  eval_every: 2\n"
                "  optim: {warmup_steps: 1}\n")
    run_ok(astrai("dvc-yaml"), repo, env)
    changed = run_ok(["git", "status", "--porcelain"], repo, env).split()
    assert sorted(changed[1::2]) == ["dvc.yaml", "params.yaml", "tasks/run/table.py"], changed
    run_ok(["git", "commit", "-qam", "a polish stage"], repo, env)

    # dpo and grpo off: polish starts from sft's model (the last enabled stage before it)
    out = subprocess.run(astrai("pipeline", "--profile", "quick", "--set", "dpo.enabled=false",
                                "--set", "grpo.enabled=false"), cwd=repo, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    trained = json.loads((repo / "data/polish/train_config.json").read_text())
    assert (trained["strategy"], Path(trained["init_from"]).name) == ("sft", "sft")
    metrics = json.loads((repo / "data/evaluate/metrics.json").read_text())
    assert metrics["final_model"] == "polish" and "polish/task_accuracy" in metrics
    assert "polish/task_accuracy" in json.loads((repo / "data/evaluate/headline.json").read_text())
    checks = json.loads((repo / "data/evaluate/checks.json").read_text())
    assert any(c["stage"] == "polish" and c["start"] == "sft" and c["metric"] == "task_accuracy" for c in checks)
    assert "polish" in (repo / "data/evaluate/evaluation.md").read_text()
    status = run_ok([Path(sys.executable).parent / "dvc", "status", "polish"], repo, env)
    assert "changed" not in status, status


def test_evaluate_and_register_rerun_when_the_table_changes():
    """Issue 50 (6): after a stage was removed, evaluate was not rerun (DVC does not see a dependency that left its
    list) and its results still named the removed stage as the final model: the table is their dependency."""
    from tasks.run.table import BY_NAME, stage_deps

    for name in ("evaluate", "register"):
        assert "tasks/run/table.py" in stage_deps(BY_NAME[name])
