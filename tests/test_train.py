"""The training loop: schedule, batch sampling, data checks, a real 2-rank torchrun run (with MLflow attached),
and 2 ranks x batch B against 1 process x batch 2B."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from astrai_core.config import OptimConfig, TrainConfig
from astrai_core.distributed import resolve_nproc, run_torchrun
from astrai_core.errors import AstraiError
from astrai_core.io import sha256_file
from astrai_core.tracking import MetricLogger, flatten
from astrai_core.train import get_batch, lr_at, open_tokens, train

MODEL = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def make_cfg(data: dict, out_dir, **kw) -> TrainConfig:
    base = dict(model=MODEL, optim=dict(lr=3e-3, min_lr=3e-4, warmup_steps=5), train_data=str(data["train"]),
                val_data=str(data["val"]), tokenizer=str(data["tokenizer"]), out_dir=str(out_dir), seq_len=32,
                batch_size=8, max_steps=20, log_every=5, eval_every=10, eval_batches=2, device="cpu")
    return TrainConfig.model_validate({**base, **kw})


def test_lr_schedule():
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    lrs = [lr_at(s, optim, 100) for s in range(101)]
    warm = lrs[:11]
    assert all(b > a for a, b in zip(warm, warm[1:]))
    assert np.allclose(np.diff(warm), warm[0])  # linear, starting above zero
    assert lrs[10] == pytest.approx(1e-3) and max(lrs) == lrs[10]  # peak at warmup_steps
    decay = lrs[10:]
    assert all(b <= a for a, b in zip(decay, decay[1:]))  # monotone cosine decay
    assert lrs[55] == pytest.approx((1e-3 + 1e-4) / 2)  # halfway: midpoint
    assert lrs[100] == pytest.approx(1e-4) and lr_at(500, optim, 100) == pytest.approx(1e-4)
    assert lr_at(0, OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0), 10) == pytest.approx(1e-3)


def test_batches_do_not_depend_on_rank_layout():
    tokens = np.arange(1000, dtype=np.uint16)
    cpu = torch.device("cpu")
    x1, y1 = get_batch(tokens, [7, 3, 0], 16, 8, rank=0, world_size=1, device=cpu)
    parts = [get_batch(tokens, [7, 3, 0], 16, 4, rank=r, world_size=2, device=cpu) for r in range(2)]
    torch.testing.assert_close(x1, torch.cat([p[0] for p in parts]))
    torch.testing.assert_close(y1, torch.cat([p[1] for p in parts]))
    assert x1.dtype == torch.int64 and x1.shape == (8, 16)
    torch.testing.assert_close(y1[:, :-1], x1[:, 1:])  # y is x shifted by one
    assert not torch.equal(x1, get_batch(tokens, [7, 4, 0], 16, 8, 0, 1, cpu)[0])  # another step, another batch


def test_data_checks(tmp_path, core_tiny_data, core_write_packed):
    sha = sha256_file(core_tiny_data["tokenizer"])
    with pytest.raises(AstraiError, match="tokenizer"):
        open_tokens(core_tiny_data["train"], "0" * 64, 300, 32)
    with pytest.raises(AstraiError, match="exceeds model.vocab_size"):
        open_tokens(core_tiny_data["train"], sha, 256, 32)
    short = core_write_packed(tmp_path / "short.h5", [1, 2, 3], tokenizer_sha256=sha, vocab_size=300)
    with pytest.raises(AstraiError, match="fewer than seq_len"):
        open_tokens(short, sha, 300, 32)
    assert isinstance(open_tokens(core_tiny_data["train"], sha, 300, 32), np.ndarray)  # small: loaded into RAM


def test_metric_logger(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    off = MetricLogger(tmp_path / "off", enabled=False)
    off.log({"a": 1.0}, step=1)
    off.log_params({"a": 1})
    assert not (tmp_path / "off").exists()
    on = MetricLogger(tmp_path / "on")
    on.log({"a": 1.0}, step=1)
    on.log({"a": 0.5}, step=2)
    assert [json.loads(line)["a"] for line in on.path.read_text().splitlines()] == [1.0, 0.5]
    assert flatten({"model": {"dim": 8}, "seed": 1}) == {"model.dim": 8, "seed": 1}


def test_resolve_nproc():
    assert resolve_nproc(3, "cpu") == 3
    assert resolve_nproc("auto", "cpu") >= 1


@pytest.fixture(scope="module")
def two_rank_run(core_tiny_data, tmp_path_factory):
    """A real torchrun run: 2 ranks x batch 4 x 2 accumulation micro-steps, fp32, logging into an MLflow run."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("core_two_ranks")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("core", artifact_location=str(root / "artifacts"))).info.run_id
    cfg = make_cfg(core_tiny_data, root / "ckpt", batch_size=4, grad_accum=2)
    cfg_path = root / "cfg.json"
    cfg_path.write_text(cfg.model_dump_json())
    lines: list[str] = []
    run_torchrun(cfg_path, 2, env={"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": uri}, on_line=lines.append)
    return cfg, lines, client, run_id


@pytest.mark.integration
def test_torchrun_two_ranks(two_rank_run):
    cfg, lines, client, run_id = two_rank_run
    ckpt = Path(cfg.out_dir)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "manifest.json", "summary.json",
                 "train_config.json", "train_state.pt", "metrics.jsonl"):
        assert (ckpt / name).is_file(), name
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20 and summary["tokens_seen"] == 20 * 2 * 4 * 2 * 32
    assert summary["final_train_loss"] < math.log(300) - 0.8, summary
    assert summary["final_val_loss"] < math.log(300) - 0.8, summary
    assert TrainConfig.model_validate_json((ckpt / "train_config.json").read_text()) == cfg
    metrics = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [5, 10, 15, 20]
    assert metrics[-1]["train/loss"] < metrics[0]["train/loss"]
    assert sum("val/loss" in m for m in metrics) == 2
    assert sum(line.startswith("step ") for line in lines) == 4  # rank 0 only, streamed to on_line
    # MLflow: step-wise metrics and the flattened config, logged by rank 0 into the caller's run
    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == [5, 10, 15, 20]
    params = client.get_run(run_id).data.params
    assert params["model.dim"] == "32" and params["optim.lr"] == "0.003"
    assert client.get_run(run_id).info.status == "RUNNING"  # the caller owns the run's lifecycle


@pytest.mark.integration
def test_two_ranks_equal_one_rank_with_double_batch(two_rank_run, core_tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    cfg2, *_ = two_rank_run
    cfg1 = cfg2.model_copy(update={"batch_size": 8, "out_dir": str(tmp_path / "ckpt")})
    summary = train(cfg1)
    assert summary["world_size"] == 1
    w1 = load_file(tmp_path / "ckpt" / "model.safetensors")
    w2 = load_file(Path(cfg2.out_dir) / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=1e-4, msg=k)


def test_non_finite_loss_stops(core_tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    cfg = make_cfg(core_tiny_data, tmp_path / "ckpt", optim=dict(lr=1e6, min_lr=0, warmup_steps=0, grad_clip=0),
                   max_steps=50, val_data=None)
    with pytest.raises(RuntimeError, match="non-finite"):
        train(cfg)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.integration
def test_torchrun_failure_raises_with_output(core_tiny_data, tmp_path):
    cfg = make_cfg(core_tiny_data, tmp_path / "ckpt", train_data=str(tmp_path / "missing.h5"))
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    with pytest.raises(RuntimeError, match="missing.h5"):
        run_torchrun(tmp_path / "cfg.json", 2, on_line=lambda line: None)


@pytest.mark.integration
def test_torchrun_interrupt_kills_every_rank(core_tiny_data, tmp_path):
    cfg = make_cfg(core_tiny_data, tmp_path / "ckpt", max_steps=100000, log_every=1)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(cfg.model_dump_json())

    def interrupt(line: str) -> None:
        if line.startswith("step "):  # the ranks are training
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_torchrun(cfg_path, 2, on_line=interrupt)
    alive = []
    for proc in Path("/proc").iterdir():
        try:
            if str(cfg_path).encode() in (proc / "cmdline").read_bytes():
                alive.append(proc.name)
        except OSError:
            continue
    assert not alive, f"left running: {alive}"
    assert not (tmp_path / "ckpt").exists()
