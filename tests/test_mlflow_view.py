"""What the team reads in MLflow: the experiment opens on its runs, the pipeline's run carries the headline metrics,
training runs log system metrics (from local rank 0 only) and the settings they used, each under one name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import PROJECT_ROOT
from test_chat_page import browser  # noqa: F401 (a fixture: headless Chromium, or a skip saying what is missing)


@pytest.fixture
def store(tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv(("ASTRAI_PARENT_RUN_ID"), raising=False)
    previous = mlflow.get_tracking_uri()
    yield uri
    mlflow.set_tracking_uri(previous)


def test_the_experiment_opens_on_its_runs(store, tmp_path):
    """The MLflow UI opens an experiment of unknown type on the GenAI traces page; tagged "custom_model_development"
    it opens on the runs table. An experiment made before the tag existed gets it on the next stage's start."""
    import mlflow

    from tasks.run.schema import Params
    from tasks.run.tracking import setup

    client = mlflow.MlflowClient(store)
    exp_id = setup(Params(), tmp_path)
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"
    old = client.create_experiment("older", artifact_location=(tmp_path / "a").as_uri())
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    assert setup(Params(tracking={"experiment": "older"}), tmp_path) == old
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_pipeline_run_carries_the_headline(store, tmp_path):
    import mlflow

    from flows.pipeline import log_headline

    (tmp_path / "data/evaluate").mkdir(parents=True)
    (tmp_path / "data/evaluate/headline.json").write_text(json.dumps(
        {"pretrain/test_bits_per_char": 2.5, "grpo/task_accuracy": 0.25, "test_bits_per_char": 2.6, "flags": 1}))
    mlflow.set_tracking_uri(store)
    with mlflow.start_run(experiment_id=mlflow.create_experiment("h", (tmp_path / "a").as_uri())) as run:
        log_headline(tmp_path)
    metrics = mlflow.MlflowClient(store).get_run(run.info.run_id).data.metrics
    assert metrics == {"pretrain.test_bits_per_char": 2.5, "grpo.task_accuracy": 0.25, "test_bits_per_char": 2.6,
                       "flags": 1.0}


def test_a_run_logs_the_settings_of_its_own_method_only():
    from astrai_core.training.config import DPOConfig, TrainConfig

    paths = dict(train_data="t.h5", tokenizer="tok.json", out_dir="out")
    assert not {"dpo", "grpo"} & set(TrainConfig(**paths).used())  # a seq run: no dpo.beta at its default
    dpo = TrainConfig(**paths, strategy="dpo", init_from="m", dpo=DPOConfig(beta=0.2, reference_logps="r.h5")).used()
    assert dpo["dpo"]["beta"] == 0.2 and "grpo" not in dpo


@pytest.mark.integration
def test_a_training_stage_run_shows_system_metrics_and_each_setting_once(store, tmp_path, core_tiny_data):
    """The pretrain stage's run as the stage makes it (tasks.run.tracking.stage_run) with the training core on 2
    torchrun ranks logging into it: MLflow's system metrics from local rank 0 alone (one value per step), the
    TrainConfig's settings, the section's launch settings as pretrain.*, nothing of the other methods and no setting
    twice."""
    import mlflow
    import yaml

    from astrai_core.training.config import TrainConfig
    from tasks.run.schema import Params
    from tasks.run.tracking import stage_run

    params = Params(pretrain={"nproc": 2, "optim": {"lr": 0.01, "min_lr": 0.001, "warmup_steps": 2}},
                    dpo={"objective": {"beta": 0.2}})
    cfg = TrainConfig(**params.pretrain.run_settings().model_dump(),
                      model=dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
                      train_data=str(core_tiny_data["train"]), tokenizer=str(core_tiny_data["tokenizer"]),
                      out_dir=str(tmp_path / "data/pretrain"), seq_len=32)
    cfg = cfg.model_copy(update={"batch_size": 8, "max_steps": 200, "log_every": 50, "eval_every": 1000,
                                 "checkpoint_every": 1000, "device": "cpu", "dtype": "fp32"})
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    with stage_run("pretrain", params, tmp_path) as run:
        env = {**os.environ, "MLFLOW_RUN_ID": run.info.run_id, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5",
               "PYTHONPATH": str(PROJECT_ROOT)}
        out = subprocess.run([sys.executable, "-m", "astrai.cli", "train", "--config", str(tmp_path / "train.yaml"),
                              "--nproc", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    client = mlflow.MlflowClient(store)
    logged = client.get_run(run.info.run_id).data
    # the section's launch keys only: its training settings are the TrainConfig's (optim.lr), logged once
    assert {k for k in logged.params if k.startswith("pretrain.")} == {"pretrain.nproc", "pretrain.max_restarts",
                                                                      "pretrain.enabled"}
    assert not [k for k in logged.params if k.startswith(("dpo.", "grpo."))], logged.params
    assert (logged.params["optim.lr"], logged.params["model.dim"], logged.params["strategy"]) == ("0.01", "32", "seq")
    assert "system/cpu_utilization_percentage" in logged.metrics and "system/system_memory_usage_megabytes" in \
        logged.metrics, sorted(logged.metrics)
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")]
    assert steps and len(steps) == len(set(steps)), steps  # one process sampled: rank 1 logged none
    assert "Started monitoring system metrics" not in out.stdout + out.stderr  # MLflow's lines kept out of the log


@pytest.mark.integration
def test_the_printed_link_opens_the_experiment_on_its_runs(store, tmp_path, browser):
    """MLflow 3.17's UI opens an experiment on its GenAI pages (Overview, Traces) unless the URL says
    workflowType=machine_learning: the link `astrai pipeline` prints (ui_link) opens on the runs table, in Chromium
    against a real `mlflow server`."""
    import socket

    import httpx
    import mlflow
    from selenium.webdriver.support.ui import WebDriverWait

    from tasks.run.schema import Params
    from tasks.run.tracking import setup, ui_link

    exp_id = setup(Params(), tmp_path)
    with mlflow.start_run(experiment_id=exp_id) as run:
        mlflow.log_metric("grpo.task_accuracy", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1", "--backend-store-uri", store],
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        browser.get(ui_link(url, exp_id))
        WebDriverWait(browser, 60).until(lambda d: f"/experiments/{exp_id}/runs" in d.current_url)
        browser.get(ui_link(url, exp_id, run.info.run_id))
        WebDriverWait(browser, 60).until(lambda d: "grpo.task_accuracy" in d.page_source)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_run_shorter_than_the_sampling_interval_has_system_metrics(tmp_path, monkeypatch):
    """Issue 43, item 14: a quick run's training runs showed no system metrics (MLflow samples every 10 s and drops
    the sample it is taking when stopped). A run of a fraction of a second has one, at its end."""
    import time

    import mlflow

    from astrai_core.training.metric_log import system_metrics

    uri, previous = f"sqlite:///{tmp_path / 'mlflow.db'}", mlflow.get_tracking_uri()
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("short", artifact_location=(tmp_path / "a").as_uri()))
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    monkeypatch.delenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", raising=False)
    mlflow.set_tracking_uri(uri)  # where the monitor logs, as a stage's rank 0 has it
    try:
        with system_metrics(local_rank=0):
            time.sleep(0.3)
    finally:
        mlflow.set_tracking_uri(previous)
    assert "system/cpu_utilization_percentage" in client.get_run(run.info.run_id).data.metrics
