"""The flow's stage status from what DVC printed, read off a real DVC repo: a stage DVC runs, one it finds up to
date, and one whose outputs it checks out of its cache because the same deps and params ran before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from flows.pipeline import dvc_command, stage_status

STAGE = {"stages": {"twice": {"cmd": f"{sys.executable} -c \"import yaml; n = yaml.safe_load(open('params.yaml'))"
                                     f"['n']; open('out.txt', 'w').write(str(2 * n))\"",
                              "params": ["n"], "outs": ["out.txt"]}}}


def repro(repo: Path) -> list[str]:
    out = subprocess.run(dvc_command() + ["repro", "--single-item", "twice"], cwd=repo, capture_output=True,
                         text=True, check=True)
    return (out.stdout + out.stderr).splitlines()


def test_ran_unchanged_and_restored_are_told_apart(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(dvc_command() + ["init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(STAGE))
    for n, expected in ((1, "ran"), (1, "unchanged"), (2, "ran"), (1, "restored")):
        (tmp_path / "params.yaml").write_text(f"n: {n}\n")
        assert stage_status(repro(tmp_path)) == expected, n
        assert (tmp_path / "out.txt").read_text() == str(2 * n)
