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


# --- a cancelled or failed flow run on a tiny project ------------------------------------------------------------

def lock_outs(repo: Path, stage: str) -> dict:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for o in lock["stages"][stage]["outs"]}


@pytest.mark.integration
def test_a_cancelled_or_failed_run_leaves_the_last_good_outputs(tmp_path):
    """SIGTERM to a flow run in pretrain (what a Prefect cancel sends): the pretrain task ends CANCELLED, no
    later stage runs, params.yaml is the user's file again and data/pretrain is the last good one (DVC had
    deleted it). A run whose pretrain fails leaves it too."""
    import os
    import signal
    import subprocess
    import sys

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from conftest import VENV_BIN, make_project, run_ok

    repo = tmp_path / "project"
    env = make_project(repo, tmp_path / "remote", "astrai-cancel-test")
    env.update({"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONPATH": str(repo)})
    run_ok([VENV_BIN / "dvc", "repro", "pretrain"], repo, env)  # the last good outputs
    good = lock_outs(repo, "pretrain")
    user_params = (repo / "params.yaml").read_bytes()

    with prefect_test_harness(server_startup_timeout=120):
        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
        code = (f"from flows.pipeline import pipeline; pipeline(project_dir={str(repo)!r}, "
                "overrides={'pretrain.max_steps': 100000, 'pretrain.log_every': 1})")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=repo, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        seen = []
        try:
            for line in proc.stdout:  # wait until pretrain is training
                seen.append(line)
                if "step" in line and "loss" in line:
                    break
            assert proc.poll() is None, "".join(seen[-30:])
            os.kill(proc.pid, signal.SIGTERM)
            rest = proc.communicate(timeout=120)[0]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        with get_client(sync_client=True) as client:
            states = {tr.name: tr.state.type.value for tr in client.read_task_runs()}
        assert states["pretrain"] == "CANCELLED", (states, rest[-3000:])
        assert "sft" not in states and "chat_data" not in states
        assert (repo / "params.yaml").read_bytes() == user_params
        assert (repo / "data/pretrain/model.safetensors").is_file()
        assert "up to date" in run_ok([VENV_BIN / "dvc", "status", "pretrain"], repo, env)
        assert lock_outs(repo, "pretrain") == good

        # A stage that fails: the same outputs stay (flow run in this process this time).
        from flows.pipeline import pipeline

        os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]
        try:
            state = pipeline(project_dir=str(repo), overrides={"pretrain.init_from": str(tmp_path / "no-such-ckpt")},
                             return_state=True)
        finally:
            os.environ.pop("MLFLOW_TRACKING_URI")
        assert state.is_failed()
    assert (repo / "params.yaml").read_bytes() == user_params
    assert "up to date" in run_ok([VENV_BIN / "dvc", "status", "pretrain"], repo, env)
    assert (repo / "data/pretrain/model.safetensors").is_file()
