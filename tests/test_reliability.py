"""Everyday trust (issue 14): overrides that belong to one run, a cancelled run that loses nothing, experiments
that compare, a quick profile. The slow ones run a real Prefect flow on a tiny DVC project."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from astrai_core.errors import AstraiError
from conftest import PROJECT_ROOT
from flows.pipeline import PARAMS_BACKUP, run_params
from tasks.params import load_params


@pytest.fixture
def params_root(tmp_path):
    shutil.copy(PROJECT_ROOT / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


def comment_lines(text: str) -> list[str]:
    return [line[line.index("#"):] for line in text.splitlines() if "#" in line]


def test_overrides_belong_to_one_run_and_the_file_keeps_its_comments(params_root):
    target = params_root / "params.yaml"
    original = target.read_bytes()
    with run_params(params_root, "params.yaml", {"pretrain.max_steps": 30, "dpo.optim.lr": 0.01}, log=print):
        during = target.read_text()
        assert load_params(target).pretrain.max_steps == 30 and load_params(target).dpo.optim.lr == 0.01
        assert comment_lines(during) == comment_lines(original.decode())  # every comment survives the edit
        assert "max_documents: null" in during and "max_steps: 30 " in during
    assert target.read_bytes() == original
    assert not (params_root / PARAMS_BACKUP).exists()
    # A failed or cancelled run gives the file back too.
    with pytest.raises(KeyboardInterrupt):
        with run_params(params_root, "params.yaml", {"pretrain.max_steps": 2000}, log=print):
            raise KeyboardInterrupt
    assert target.read_bytes() == original


def test_another_params_file_is_used_for_the_run_only(params_root):
    other = params_root / "quick.yaml"
    other.write_text("# mine\npretrain:\n  max_steps: 7  # short\n")
    original = (params_root / "params.yaml").read_bytes()
    with run_params(params_root, "quick.yaml", {"sft.max_steps": 3}, log=print):
        text = (params_root / "params.yaml").read_text()
        assert "# short" in text and "# mine" in text
        assert load_params(params_root / "params.yaml").pretrain.max_steps == 7
        assert load_params(params_root / "params.yaml").sft.max_steps == 3
    assert (params_root / "params.yaml").read_bytes() == original


def test_a_killed_run_is_undone_at_the_next_start(params_root):
    target = params_root / "params.yaml"
    original = target.read_bytes()
    killed = run_params(params_root, "params.yaml", {"pretrain.max_steps": 2000}, log=print)
    killed.__enter__()  # SIGKILL now: no finally runs
    assert load_params(target).pretrain.max_steps == 2000
    lines = []
    with run_params(params_root, "params.yaml", None, log=lines.append):
        assert target.read_bytes() == original
    assert any("restored" in line for line in lines), lines


def test_a_bad_override_changes_nothing(params_root):
    original = (params_root / "params.yaml").read_bytes()
    with pytest.raises(AstraiError, match="pretrain.max_steps"):
        with run_params(params_root, "params.yaml", {"pretrain.max_steps": -1}, log=print):
            pass
    with pytest.raises(AstraiError, match="missing.yaml"):
        with run_params(params_root, "missing.yaml", None, log=print):
            pass
    assert (params_root / "params.yaml").read_bytes() == original
    assert not (params_root / PARAMS_BACKUP).exists()
