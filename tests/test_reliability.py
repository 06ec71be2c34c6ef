"""Everyday trust (issue 14): overrides that belong to one run, a cancelled run that loses nothing, experiments
that compare, a quick profile. The slow ones run a real Prefect flow on a tiny DVC project."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from astrai_core.runtime.errors import AstraiError
from conftest import PROJECT_ROOT
from tasks.run.params import PARAMS_BACKUP, run_params
from tasks.run.params import load_params


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
    other.write_text("# mine\npretrain:\n  max_steps: 70  # short\n")
    original = (params_root / "params.yaml").read_bytes()
    with run_params(params_root, "quick.yaml", {"sft.max_steps": 30}, log=print):
        text = (params_root / "params.yaml").read_text()
        assert "# short" in text and "# mine" in text
        assert load_params(params_root / "params.yaml").pretrain.max_steps == 70
        assert load_params(params_root / "params.yaml").sft.max_steps == 30
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
def test_a_sigkilled_writer_leaves_no_temporary_path_behind_the_next_one(tmp_path):
    """atomic_path cannot clean up after SIGKILL; the next write to the same target removes what the dead process
    left, and never the temporary path of a process that still runs."""
    import signal
    import subprocess
    import sys

    from astrai_core.runtime.io import _OWNER, atomic_path

    target = tmp_path / "chat"
    code = ("import os, signal; from astrai_core.runtime.io import atomic_path\n"
            f"with atomic_path({str(target)!r}, 'test') as tmp:\n"
            "    tmp.mkdir(); (tmp / 'half.jsonl').write_text('{')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT)
    assert killed.returncode == -signal.SIGKILL
    left = list(tmp_path.glob(".chat.*.tmp"))
    assert len(left) == 1 and (left[0] / "half.jsonl").is_file() and not target.exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = tmp_path / f".chat.{_OWNER}{alive.pid}.x1y2.tmp"
        running.mkdir()  # the temporary path of a writer that still runs
        with atomic_path(target, "test") as tmp:
            tmp.mkdir()
            (tmp / "whole.jsonl").write_text("{}")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["chat", running.name])
        assert (target / "whole.jsonl").read_text() == "{}"
    finally:
        alive.kill()
        alive.wait()


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


# --- experiments that compare: metrics and plots through DVC ----------------------------------------------------

def test_metrics_compare_across_commits_and_plots_render(tmp_path):
    """dvc.lock's record of the evaluation is enough for `dvc metrics diff` (and `dvc exp show`) to read an
    earlier commit's metrics, though git ignores data/; dvc.yaml's plots load without error."""
    import json

    from conftest import VENV_BIN, make_project, run_ok
    from tasks.evaluation.plots import plot_chain, plot_curves
    from tasks.evaluation.plots import write_plot_data
    from tasks.stages.evaluate import headline, training_curves

    repo = tmp_path / "project"
    env = make_project(repo, tmp_path / "remote", "unused")
    for dep in ("pretrain", "sft", "dpo", "grpo", "packed", "chat", "dpo_reference", "corpus"):
        (repo / "data" / dep).mkdir(parents=True)
        (repo / "data" / dep / "x").write_text(dep)
    for step in (1, 2):
        (repo / "data/pretrain/metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "train/loss": 5.0 / s / step}) + "\n" for s in range(1, 6)))
        metrics = {"test_bits_per_char": 3.0 / step, "pretrain/test_bits_per_char": 3.0 / step}
        out = repo / "data/evaluate"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        (out / "metrics.json").write_text(json.dumps(metrics))
        (out / "headline.json").write_text(json.dumps(headline(metrics)))
        for name in ("samples.md", "evaluation.md", "items.json", "checks.json"):
            (out / name).write_text("{}")
        curves = training_curves(repo, ["pretrain"])
        write_plot_data(["pretrain"], metrics, curves, out)
        plot_chain(["pretrain"], metrics, out / "chain.png")
        plot_curves(curves, out / "curves.png")
        run_ok([VENV_BIN / "dvc", "commit", "-f", "evaluate"], repo, env)
        if step == 1:
            run_ok(["git", "add", "dvc.lock"], repo, env)
            run_ok(["git", "commit", "-qm", "first evaluation"], repo, env)
    diff = json.loads(run_ok([VENV_BIN / "dvc", "metrics", "diff", "--json"], repo, env))
    assert set(diff) == {"data/evaluate/headline.json"}, diff  # the headline only: a table that fits a screen
    change = diff["data/evaluate/headline.json"]["test_bits_per_char"]
    assert change["old"] == 3.0 and change["new"] == 1.5, diff
    shown = json.loads(run_ok([VENV_BIN / "dvc", "metrics", "show", "--json"], repo, env))
    assert len(json.dumps(shown)) < 1000, shown
    plots = json.loads(run_ok([VENV_BIN / "dvc", "plots", "show", "--json"], repo, env))
    assert not plots.get("errors"), plots["errors"]
    assert {"data/evaluate/chain.png", "data/evaluate/curves.png"} <= set(plots["data"]), plots["data"].keys()
    # The page renders offline: the PNGs are on it, and nothing is fetched from the network.
    run_ok([VENV_BIN / "dvc", "plots", "show", "-o", str(tmp_path / "plots")], repo, env)
    page = (tmp_path / "plots" / "index.html").read_text()
    assert page.count("<img") == 2 and "https://" not in page and "http://" not in page, page[:2000]


# --- the quick profile ----------------------------------------------------------------------------------------------

def test_a_profile_is_merged_over_the_params_and_an_unknown_one_is_named(params_root):
    import yaml as pyyaml

    from tasks.run.params import load_profile, run_params_text
    from tasks.run.params import parse_params

    shutil.copytree(PROJECT_ROOT / "profiles", params_root / "profiles")
    text = run_params_text(params_root / "params.yaml", {"sft.max_steps": 12}, load_profile(params_root, "quick"))
    params = parse_params(pyyaml.safe_load(text))
    assert params.pretrain.max_steps == 40 and params.sft.max_steps == 12  # --set wins over the profile
    assert params.pretrain.dtype == "auto" and params.grpo.objective.rewards == {"exact_answer": 1.0}
    assert params.grpo.objective.group_size == 4  # the profile's, merged into params.yaml's objective
    assert "# torchrun processes: auto = every GPU, else every CPU core" in text  # params.yaml's comments stay
    known = ", ".join(sorted(p.stem for p in (PROJECT_ROOT / "profiles").glob("*.yaml")))
    assert "quick" in known and "gpu" in known
    with pytest.raises(AstraiError, match=f"no such profile; profiles: {known} "):
        load_profile(params_root, "fast")
    # A name, never a path: ../params would merge params.yaml itself as a profile and start a full run.
    with pytest.raises(AstraiError, match=rf"^--profile \.\./params: no such profile; profiles: {known} "):
        load_profile(params_root, "../params")
    # The run's params carry the profile's name: the register stage reads it there (no environment variable).
    from tasks.run.params import params_of_run

    assert params_of_run(params_root, "params.yaml", None, "quick").params.register.profile == "quick"
    assert params_of_run(params_root, "params.yaml", None, None).params.register.profile == "default"


@pytest.mark.integration
def test_the_quick_profile_runs_the_whole_chain(tmp_path):
    """`astrai pipeline --profile quick` on the real params.yaml: every stage runs, a model is registered."""
    import json
    import subprocess
    import sys
    import time

    from conftest import make_quick_project

    repo, env = make_quick_project(tmp_path)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "astrai.cli", "pipeline", "--profile", "quick"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=900)
    elapsed = time.monotonic() - start
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    print(f"quick profile: {elapsed:.0f} s")
    assert "=== AstrAI pipeline finished ===" in out.stdout
    log = out.stdout + out.stderr  # the long stages say what they are doing
    assert "evaluate: 4 models" in log and re.search(r"evaluate: grpo on (cpu|cuda): bits/char on", log), log[-3000:]
    assert "dpo_reference: scoring the DPO pairs of data/dpo_reference/dpo_train.h5 with data/sft" in log
    registration = json.loads((repo / "data/register/registration.json").read_text())
    assert (registration["model_name"], registration["profile"], registration["version"]) == ("astrai-quick", "quick", 1)
    assert (repo / "params.yaml").read_bytes() == (PROJECT_ROOT / "params.yaml").read_bytes()
    assert "git add dvc.lock" not in log  # DVC's advice is not repeated in every task's log
    samples = (repo / "data/evaluate/samples.md").read_text()
    if len(samples) > 1500:  # the summary cuts the samples at a line end and says where the rest is
        assert "... (all samples: " in out.stdout and samples[:200] in out.stdout

    import mlflow

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("astrai").experiment_id])
    names = {k for r in runs for k in r.data.metrics}
    assert "final_train_loss" in names and not any(k.startswith("final_final") for k in names), names

    # Nothing changed: the second run opens no MLflow pipeline run and says the results are the last run's.
    again = subprocess.run([sys.executable, "-m", "astrai.cli", "pipeline", "--profile", "quick"], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-6000:]
    assert "nothing ran:" in again.stdout
    pipelines = client.search_runs([runs[0].info.experiment_id], filter_string="tags.`astrai.stage` = 'pipeline'")
    assert len(pipelines) == 1, [r.info.run_id for r in pipelines]


def test_make_clean_removes_every_output(tmp_path):
    import subprocess

    # the Makefile includes env.defaults
    for name in ("Makefile", "astrai_core/runtime/env.defaults", "data/README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PROJECT_ROOT / name, tmp_path / name)
    for out in ("corpus", "chat", "sft", "dpo_reference", "dpo", "grpo", "pretrain.ckpts", "evaluate"):
        (tmp_path / "data" / out).mkdir()
        (tmp_path / "data" / out / "f").write_text("x")
    (tmp_path / "data/pretrain.train_config.json").write_text("{}")
    subprocess.run(["make", "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["README.md"]


def test_make_pipeline_runs_the_pipeline_with_a_profile(tmp_path):
    import subprocess

    for name in ("Makefile", "astrai_core/runtime/env.defaults", "pyproject.toml", "requirements.lock"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PROJECT_ROOT / name, tmp_path / name)
    (tmp_path / ".venv/bin").mkdir(parents=True)
    (tmp_path / ".venv/bin/astrai").touch()  # newer than its prerequisites: make prints only the pipeline's command
    for extra, expected in (([], ".venv/bin/astrai pipeline"), (["PROFILE=quick"], ".venv/bin/astrai pipeline --profile quick")):
        out = subprocess.run(["make", "--no-print-directory", "-n", "pipeline", *extra], cwd=tmp_path, check=True,
                             capture_output=True, text=True)  # no "Entering directory" lines under `make test`
        assert out.stdout.strip().splitlines()[-1].strip() == expected


# --- bad input to `astrai generate`: one line, exit 2 ------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--model", "ckpt", "--prompt", ""], "--prompt: empty"),
    (["--model", "ckpt", "--prompt", "x", "--max-new-tokens", "-5"], "--max-new-tokens -5: must be at least 1"),
    (["--model", "ckpt", "--prompt", "x", "--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0"),
    (["--model", "ckpt", "--prompt", "x", "--top-k", "-3"], "--top-k -3: must be >= 0"),
    (["--model", "ckpt", "--prompt", "x", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--model", "models:/nope/1", "--prompt", "x"], "models:/nope/1: "),
    (["--model", "models:/nope@champion", "--prompt", "x"], "models:/nope@champion: "),
])
def test_generate_refuses_bad_input_in_one_line(tmp_path, args, message):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    out = subprocess.run([sys.executable, "-m", "astrai.cli", "generate", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, (out.stdout, out.stderr[-2000:])
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("astrai: error: ") and message in last, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


# --- training that never ends ---------------------------------------------------------------------------------------

def test_a_checkpoint_beyond_max_steps_is_refused(core_tiny_data, tmp_path, monkeypatch):
    """A (manifest-consistent) checkpoint whose step is past max_steps: refused, not trained forever."""
    import json

    import torch

    from astrai_core.runtime.io import sha256_file
    from astrai_core.training.train import train
    from test_train import make_cfg

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    cfg = make_cfg(core_tiny_data, tmp_path / "out", max_steps=10, checkpoint_every=5, val_data=None,
                   checkpoint_dir=str(tmp_path / "ckpts"), keep_checkpoints=5, resume="auto")
    train(cfg)
    newest = sorted((tmp_path / "ckpts").glob("step_*"))[-1]
    state = torch.load(newest / "train_state.pt", weights_only=True)
    state["step"] = 999
    torch.save(state, newest / "train_state.pt")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["train_state.pt"] = sha256_file(newest / "train_state.pt")
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AstraiError, match="step 999 is beyond max_steps 10"):
        train(cfg)


# --- two users, one registry ----------------------------------------------------------------------------------------

def test_a_fresh_sqlite_store_survives_two_processes_at_once(tmp_path):
    import os
    import subprocess
    import sys

    code = ("from pathlib import Path; from tasks.run.params import Params; from tasks.run.tracking import setup; "
            "print(setup(Params(), Path('.')))")
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-1500:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1  # one experiment, the same id for all


def test_two_registrations_at_once_agree_with_the_registry(tmp_path):
    """Both read "no champion" and move the alias: each looks again after moving it, so the better version ends
    champion and the two decisions read as one registration after the other."""
    import threading

    import mlflow

    from tasks.stages.register import claim_champion

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    client.create_registered_model("m")
    bpc = {}
    for v, value in (("1", 2.5), ("2", 2.4)):
        client.create_model_version("m", source=str(tmp_path))
        client.set_model_version_tag("m", v, "test_bits_per_char", f"{value:.6f}")
        bpc[v] = value
    barrier, results = threading.Barrier(2), {}

    def register(version):
        barrier.wait()  # both start together: each reads "no champion" before either moves the alias
        new = {"values": {"test_bits_per_char": bpc[version]}, "items": {}, "item_sets": {}}  # what the gate knows
        results[version] = claim_champion(client, "m", version, "test_bits_per_char", new, settle=0.3)

    threads = [threading.Thread(target=register, args=(v,)) for v in ("1", "2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert str(client.get_model_version_by_alias("m", "champion").version) == "2"
    # The decisions read as if one registration came after the other: never both "no previous champion".
    assert results["2"][0] is True, results
    if results["1"][0]:
        assert "beats version 1's" in results["2"][1], results
    assert sum("no previous champion" in why for _, why in results.values()) <= 1, results


# --- processes: the ranks die with their launcher ----------------------------------------------------------------

@pytest.mark.integration
def test_sigkill_of_the_launcher_group_kills_the_ranks(core_tiny_data, tmp_path):
    """torchrun starts the ranks in sessions of their own; SIGKILL of torchrun's process group must not leave
    them training."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from test_train import make_cfg

    cfg = make_cfg(core_tiny_data, tmp_path / "out", max_steps=100000, log_every=1, val_data=None)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(cfg.model_dump_json())
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), OMP_NUM_THREADS="1")
    env.pop("MLFLOW_RUN_ID", None)
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 "-m", "astrai_core.training.train", "--config", str(cfg_path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def ranks() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if str(cfg_path).encode() in cmd and b"torch.distributed.run" not in cmd:
                found.append(int(proc.name))
        return found

    try:
        for line in launcher.stdout:
            if line.startswith("step "):
                break
        assert len(ranks()) == 2
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 10
        while ranks() and time.time() < deadline:
            time.sleep(0.2)
        assert not ranks(), "ranks left training after their launcher was killed"
    finally:
        for pid in ranks():
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.integration
def test_a_single_node_run_listens_on_loopback_only(core_tiny_data, tmp_path):
    """A training stage's torchrun (run_torchrun: the agent, rank 0's store, gloo) listens on no interface but
    loopback; --standalone would have the agent listen on every interface (issue 14)."""
    import ipaddress

    import psutil

    from astrai_core.training.distributed import run_torchrun
    from test_train import make_cfg

    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(make_cfg(core_tiny_data, tmp_path / "out", max_steps=100000, log_every=1,
                                 val_data=None).model_dump_json())
    listening: dict[str, list[str]] = {}

    class Inspected(Exception):
        pass

    def on_line(line: str) -> None:
        if not line.startswith("step "):
            return
        for proc in psutil.process_iter(["cmdline"]):  # the agent and both ranks: their command lines name cfg_path
            if str(cfg_path) in (proc.info["cmdline"] or []):
                role = "agent" if "torch.distributed.run" in proc.info["cmdline"] else f"rank {proc.pid}"
                listening[role] = [c.laddr.ip for c in proc.net_connections(kind="inet")
                                   if c.status == psutil.CONN_LISTEN]
        raise Inspected  # run_torchrun kills the run

    with pytest.raises(Inspected):
        run_torchrun(cfg_path, 2, env={"OMP_NUM_THREADS": "1"}, on_line=on_line)
    assert len(listening) == 3, listening
    addresses = [ip for ips in listening.values() for ip in ips]
    assert len(addresses) >= 3, listening  # rank 0's store and each rank's gloo socket
    assert all(ipaddress.ip_address(ip).is_loopback for ip in addresses), listening


# --- corpus edge cases -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("files, message", [
    ({"a.txt": "one document\n", "b.txt": "two documents\n"}, "2 document(s) leave none for validation"),
    ({"a.txt": "text\n", "b.txt": "more\n", "c.txt": "\x00" * 10_000}, "c.txt: contains NUL bytes"),
])
def test_corpus_refuses_what_would_fail_later(tmp_path, files, message):
    from tasks.run.schema import CorpusParams
    from tasks.stages.corpus import build_corpus

    src = tmp_path / "src"
    src.mkdir()
    for name, text in files.items():
        (src / name).write_text(text, encoding="utf-8")
    with pytest.raises(AstraiError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_corpus(CorpusParams(source=str(src)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corpus_names_a_symlink_loop(tmp_path):
    from tasks.run.schema import CorpusParams
    from tasks.stages.corpus import build_corpus

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"document {i}\n")
    (src / "x.txt").symlink_to(src / "y.txt")
    (src / "y.txt").symlink_to(src / "x.txt")
    with pytest.raises(AstraiError, match="x.txt: symlink leads to no file"):
        build_corpus(CorpusParams(source=str(src)), tmp_path / "out")


# --- a quiet register stage ------------------------------------------------------------------------------------------

def test_register_logs_the_model_without_warnings_or_progress_bars(tmp_path, tiny_trained, monkeypatch, capfd):
    import json
    import shutil
    import warnings

    import mlflow

    from tasks.run.schema import Params
    from tasks.run.tracking import setup
    from tasks.stages.register import register

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    shutil.copytree(tiny_trained, tmp_path / "data" / "pretrain")
    (tmp_path / "metrics.json").write_text(json.dumps({"pretrain/task_accuracy": 0.5}))
    previous = mlflow.get_tracking_uri()
    params = Params(register={"model_name": "quiet"})
    try:
        setup(params, tmp_path)
        capfd.readouterr()
        with warnings.catch_warnings(record=True) as caught, mlflow.start_run():
            warnings.simplefilter("always")
            register(params, tmp_path / "metrics.json", tmp_path / "register", tmp_path)
        model = mlflow.pyfunc.load_model("models:/quiet@champion")
        assert model.metadata.get_params_schema() is not None  # the params are part of the signature
        assert isinstance(model.predict(["the king"], params={"max_new_tokens": 3})[0], str)
    finally:
        mlflow.set_tracking_uri(previous)
        monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    out, err = capfd.readouterr()
    mlflow_warnings = [str(w.message) for w in caught if "mlflow" in (w.filename or "")]
    assert not mlflow_warnings, mlflow_warnings
    assert "Downloading artifacts" not in out + err and "\x1b[" not in out + err, (out + err)[-2000:]


def test_a_stage_run_records_its_data_as_mlflow_datasets(tmp_path, monkeypatch):
    import mlflow

    from tasks.run.schema import Params
    from tasks.run.tracking import stage_run

    shutil.copy(PROJECT_ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {
        "pack": {"outs": [{"path": "data/packed", "md5": "a" * 32 + ".dir"}]},
        "tokenizer": {"outs": [{"path": "data/tokenizer", "md5": "b" * 32 + ".dir"}]}}}))
    for d in ("data/packed", "data/tokenizer"):
        (tmp_path / d).mkdir(parents=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("ASTRAI_PARENT_RUN_ID", raising=False)
    previous = mlflow.get_tracking_uri()
    try:
        with stage_run("pretrain", Params(), tmp_path) as run:
            run_id = run.info.run_id
        inputs = mlflow.MlflowClient().get_run(run_id).inputs.dataset_inputs
    finally:
        mlflow.set_tracking_uri(previous)
    assert {(i.dataset.name, i.dataset.digest) for i in inputs} == {("data/packed", "a" * 32),
                                                                     ("data/tokenizer", "b" * 32)}


def test_a_killed_stage_run_is_marked_failed_by_the_next_one(tmp_path, monkeypatch):
    import socket
    import subprocess

    import mlflow

    from tasks.run.schema import Params
    from tasks.run.tracking import setup, stage_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("ASTRAI_PARENT_RUN_ID", raising=False)
    previous = mlflow.get_tracking_uri()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that existed and is gone
    try:
        exp = setup(Params(), tmp_path)
        client = mlflow.MlflowClient()
        tags = {"astrai.stage": "pretrain", "astrai.host": socket.gethostname()}
        killed = client.create_run(exp, tags=tags | {"astrai.pid": str(gone.pid)}).info.run_id
        alive = client.create_run(exp, tags=tags | {"astrai.pid": "1"}).info.run_id  # still running elsewhere
        with stage_run("pretrain", Params(), tmp_path):
            pass
        status = {r: client.get_run(r).info.status for r in (killed, alive)}
    finally:
        mlflow.set_tracking_uri(previous)
    assert status == {killed: "FAILED", alive: "RUNNING"}


def test_a_prefect_home_in_a_missing_directory_is_made(tmp_path):
    """PREFECT_HOME two directories below one that exists (as `make test` gives each test worker): the temporary
    Prefect server an entry point starts answers (Prefect makes only the last directory; without
    astrai_core/runtime/env.py making the rest, its database cannot open and the client waits 120 s, then times out)."""
    import os
    import subprocess
    import sys

    home = tmp_path / "a" / "b" / "prefect"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="30")
    code = ("from astrai_core.runtime import env; env.apply()\n"
            "from prefect.client.orchestration import get_client\n"
            "with get_client(sync_client=True) as client: print(client.api_healthcheck() is None)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "True", out.stdout + out.stderr[-2000:]
    assert (home / "prefect.db").is_file()
