"""A failure is one line: `astrai: error: <file>[:<line>]: <what>` last on stderr, exit non-zero, no traceback on
the console; tracebacks, torchrun's failure report and every line a stage printed go to the log file that line
names (tasks/run/log.py)."""

from __future__ import annotations

import os
import re
import socket
import subprocess

import pytest

from conftest import PROJECT_ROOT, VENV_BIN, make_project
from tasks.run.log import ConsoleFilter, crash_line

LOG_NAMED = re.compile(r"\(.*full log: (\S+\.log)\)$")


def _run(cmd, cwd, env=None, timeout=600):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or dict(os.environ), capture_output=True, text=True,
                          timeout=timeout)


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("astrai: error: "), out.stderr
    return last


@pytest.mark.integration
def test_a_failed_stage_in_astrai_pipeline_is_one_line_naming_the_log(tmp_path):
    """A corpus file that is not UTF-8 (found only when the corpus stage reads it): `astrai pipeline` ends with the
    stage's error as its last line, naming the run's log, which holds what the stage printed."""
    repo = tmp_path / "project"
    env = make_project(repo, tmp_path / "remote", "astrai-errors")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("ROMEO.\nBut soft, what light through yonder window breaks?\n" * 20)
    (corpus / "bad.txt").write_bytes(b"caf\xe9 au lait\n")
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    # A corpus without plays: no stage that needs demo chat data (tasks/run/checks.py check_inputs refuses it up front).
    no_chat = [a for kind in ("sft", "dpo", "grpo") for a in ("--set", f"{kind}.enabled=false")]
    out = _run([VENV_BIN / "astrai", "pipeline", "--set", f"corpus.source={corpus}", *no_chat,
                "--set", "register.metric=test_bits_per_char"], repo, env)
    last = _one_error_line(out)
    assert "bad.txt:1: not UTF-8" in last and "(stage corpus; full log: .astrai/logs/pipeline-" in last, last
    log = repo / LOG_NAMED.search(last)[1]
    assert "astrai stage corpus" in log.read_text() and "not UTF-8" in log.read_text()


def test_a_failed_torchrun_is_one_line_and_its_report_goes_to_the_log(tmp_path, core_tiny_data):
    """`astrai train` whose ranks fail: the console shows the rank's error, not its traceback nor torchrun's
    ChildFailedError report; both are in the log the last line names. The inputs pass the launcher's checks
    (check_train_inputs); the model is too wide to allocate, which only the rank finds."""
    (tmp_path / "cfg.yaml").write_text(
        f"train_data: {core_tiny_data['train']}\ntokenizer: {core_tiny_data['tokenizer']}\nout_dir: {tmp_path}/out\n"
        "max_steps: 2\nseq_len: 32\noptim: {warmup_steps: 0}\n"
        "model: {vocab_size: 300, dim: 1073741824, n_layers: 1, n_heads: 4, n_kv_heads: 2, max_seq_len: 32}\n")
    out = _run([VENV_BIN / "astrai", "train", "--config", "cfg.yaml", "--nproc", "1"], tmp_path,
               dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)), timeout=300)
    last = _one_error_line(out)
    assert "allocate" in last and "ChildFailedError" not in out.stdout + out.stderr
    log = (tmp_path / LOG_NAMED.search(last)[1]).read_text()
    assert "Traceback (most recent call last):" in log and "ChildFailedError" in log


def test_console_filter_hides_tracebacks_and_torchruns_report_until_the_next_error_line():
    keep = ConsoleFilter()
    lines = ["pretrain: step 1/10 loss 5.0", "[rank0]:Traceback (most recent call last):", '  File "x.py", line 1',
             "ValueError: 4 validation errors", "train_data", "  Field required", "[rank0]:error: ValueError: bad",
             "E1126 00:07:23 api.py:1002] failed (exitcode: 2)", "Traceback (most recent call last):",
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 60,
             "astrai_core.training.train FAILED",
             "Failures:", "  <NO_OTHER_FAILURES>", "=" * 60]
    assert [line for line in lines if keep(line)] == ["pretrain: step 1/10 loss 5.0", "[rank0]:error: ValueError: bad",
                                                      "E1126 00:07:23 api.py:1002] failed (exitcode: 2)"]


def test_crash_line_names_the_innermost_frame_and_keeps_the_traceback(tmp_path):
    def broken():
        return {}["key"]

    try:
        broken()
    except KeyError as e:
        line = crash_line(e, tmp_path / "x.log")
    assert re.fullmatch(rf"\S*test_errors\.py:\d+: KeyError: 'key' \(traceback: {tmp_path}/x\.log\)", line), line
    assert "Traceback (most recent call last)" in (tmp_path / "x.log").read_text()


def test_make_run_deployment_without_a_server_says_so_in_one_line():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run(["make", "-s", "run-deployment", f"PREFECT_PORT={port}"], PROJECT_ROOT, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr
    ours = [line for line in out.stderr.splitlines() if line.startswith("astrai: error: ")]
    assert ours == [f"astrai: error: Makefile: no Prefect server at http://127.0.0.1:{port}/api; start one, a worker and "
                    "the deployment with: make server worker deploy"], out.stderr


def test_a_failing_rank_also_appends_its_error_line_to_the_error_file(tmp_path):
    """ASTRAI_ERROR_FILE (set by the Slurm job script): a rank's last word goes there too, appended, because its
    stderr reaches the job's log through srun on the first node, which may be the node that was lost."""
    errors = tmp_path / "pretrain-7.errors"
    env = {**os.environ, "ASTRAI_ERROR_FILE": str(errors)}
    lines = []
    for name in ("missing-a.json", "missing-b.json"):
        out = _run([VENV_BIN / "python", "-m", "astrai_core.training.train", "--config", tmp_path / name], PROJECT_ROOT,
                   env, timeout=120)
        assert out.returncode == 2, out.stderr
        lines.append(out.stderr.strip().splitlines()[-1])
        assert lines[-1].startswith("error: ") and name in lines[-1], out.stderr
    assert errors.read_text().splitlines() == lines  # both, in order: appended, never overwritten


def test_a_tracking_server_that_does_not_answer_is_one_line(tmp_path):
    """Issue 43, item 10: MLflow killed under a stage ended it in the crash form (rest_utils.py:321). A stage
    whose tracking server stops answering says so in one line naming the server, and how to go on."""
    import shutil
    import sys

    from conftest import free_port

    shutil.copy(PROJECT_ROOT / "params.yaml", tmp_path / "params.yaml")
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "astrai.cli", "stage", "tokenizer"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT),
                                                      "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}",
                                                      "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    line = _one_error_line(out)
    assert out.returncode == 2 and line.startswith(
        f"astrai: error: stage tokenizer: the MLflow tracking server at http://127.0.0.1:{port} did not answer ("), line
    assert "once it answers again, run the stage again" in line


def test_a_prefect_server_that_does_not_answer_is_one_line(tmp_path):
    """Issue 43, item 10: with the Prefect server's database down a pipeline ended in Prefect's traceback and a
    crash-form line (prefect/client/base.py: PrefectHTTPStatusError). A server that does not answer is one line."""
    import shutil
    import sys

    from conftest import free_port

    shutil.copy(PROJECT_ROOT / "params.yaml", tmp_path / "params.yaml")
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "astrai.cli", "pipeline"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT),
                                           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"})
    line = _one_error_line(out)
    assert out.returncode == 2 and line.startswith(
        f"astrai: error: the Prefect server (http://127.0.0.1:{port}/api) did not answer ("), line
    assert (tmp_path / "params.yaml").read_bytes() == (PROJECT_ROOT / "params.yaml").read_bytes()
