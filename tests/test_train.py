"""The training loop: batch sampling, the loss, data checks, a real 2-rank torchrun run (with MLflow attached),
2 ranks x batch B against 1 process x batch 2B, and token-normalized loss under uneven masks (4x1 accumulation
= 1x4 batch = 2 ranks x 2 micro-steps)."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from astrai_core.data.batches import WindowSampler, open_tokens, read_windows
from astrai_core.model.losses import IGNORE_INDEX, token_loss_sum
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import sha256_file
from astrai_core.training.config import TrainConfig
from astrai_core.training.distributed import resolve_nproc, run_torchrun
from astrai_core.training.metric_log import MetricLogger, flatten
from astrai_core.training.strategies import seq as strategies_module
from astrai_core.training.train import train

MODEL = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def make_cfg(data: dict, out_dir, **kw) -> TrainConfig:
    base = dict(model=MODEL, optim=dict(lr=3e-3, min_lr=3e-4, warmup_steps=5), train_data=str(data["train"]),
                val_data=str(data["val"]), tokenizer=str(data["tokenizer"]), out_dir=str(out_dir), seq_len=32,
                batch_size=8, max_steps=20, log_every=5, eval_every=10, eval_batches=2, device="cpu")
    return TrainConfig.model_validate({**base, **kw})


def test_sampler_visits_every_window_once_per_epoch_and_resumes():
    s = WindowSampler(1001, 10, seed=7)  # 100 windows of 11 tokens
    a, b = s.starts(0, 100), s.starts(100, 100)
    assert sorted(a) == sorted(b) == list(range(0, 1000, 10))  # each window once per epoch
    assert not np.array_equal(a, b)  # reshuffled every epoch
    np.testing.assert_array_equal(s.starts(95, 10), np.concatenate([a[95:], b[:5]]))  # a batch across epochs
    s.next_starts(130)
    assert s.epoch == 1 and s.state_dict() == {"consumed_samples": 130}
    t = WindowSampler(1001, 10, seed=7)
    t.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(t.next_starts(8), s.next_starts(8))
    assert not np.array_equal(WindowSampler(1001, 10, seed=8).starts(0, 100), a)


def test_read_windows():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = read_windows(tokens, np.array([0, 500]), 16)
    assert x.dtype == torch.int64 and x.shape == (2, 16)
    assert x[1, 0] == 500 and y[1, -1] == 516
    torch.testing.assert_close(y[:, :-1], x[:, 1:])  # y is x shifted by one


def test_token_loss_sum_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]], [[0.0, 1.0], [0.0, 0.0]]])  # (B=2, T=2, V=2)
    targets = torch.tensor([[0, 0], [1, IGNORE_INDEX]])
    expected = math.log(2) + math.log(1 + math.exp(-2)) + math.log(1 + math.exp(-1))  # the masked one adds 0
    assert token_loss_sum(logits, targets).item() == pytest.approx(expected)
    # label smoothing eps: (1 - eps) * nll + eps * mean over classes of -log p
    eps, lp = 0.1, torch.log_softmax(logits, -1)
    by_hand = sum((1 - eps) * -lp[b, t, targets[b, t]] + eps * -lp[b, t].mean()
                  for b, t in [(0, 0), (0, 1), (1, 0)])
    assert token_loss_sum(logits, targets, eps).item() == pytest.approx(by_hand.item())


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


def test_metric_logger_sends_to_mlflow_off_the_step_and_raises_a_failed_send(tmp_path, monkeypatch):
    """With MLFLOW_RUN_ID the metrics reach the run from the sender thread: the first logged step at once, the
    steps after it together once `send_every` has passed (here not before flush: an hour), and by the time flush
    returns every step once and in order (1,200 metrics: two log_batch calls at MLflow's limit of 1,000). With a
    short `send_every` they arrive without a flush. A send that fails (here: a run the store does not have) is
    raised by the next flush."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    exp = client.create_experiment("m", artifact_location=str(tmp_path / "a"))

    def logged(run_id: str, key: str = "loss") -> list[int]:
        return [m.step for m in client.get_metric_history(run_id, key)]

    def wait_for(run_id: str, steps: list[int]) -> None:
        deadline = time.monotonic() + 60
        while logged(run_id) != steps and time.monotonic() < deadline:
            time.sleep(0.05)

    run_id = client.create_run(exp).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setattr(MetricLogger, "send_every", 3600.0)
    log = MetricLogger(tmp_path / "on")
    for step in range(1, 301):
        log.log({"loss": 1.0 / step, "lr": 0.1, "grad_norm": 1.0, "tokens_per_sec": 5.0}, step=step)
    assert log._sender is not None and log._sender.is_alive()  # sent from its own thread
    wait_for(run_id, [1])
    assert logged(run_id) == [1]  # the first step at once, the rest held back
    log.flush()
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec"):
        assert logged(run_id, key) == list(range(1, 301))
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [1.0 / s for s in range(1, 301)]

    run_id = client.create_run(exp).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setattr(MetricLogger, "send_every", 0.1)
    log = MetricLogger(tmp_path / "periodic")
    for step in range(1, 11):
        log.log({"loss": 1.0 / step}, step=step)
    wait_for(run_id, list(range(1, 11)))
    assert logged(run_id) == list(range(1, 11))  # sent without a flush
    log.flush()

    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)
    lost = MetricLogger(tmp_path / "lost")
    lost.log({"loss": 1.0}, step=1)
    with pytest.raises(MlflowException):
        lost.flush()


def test_a_failed_run_sends_the_metrics_it_logged(core_tiny_data, tmp_path, monkeypatch):
    """A run that fails mid-way still sends the steps it logged before the failure (held back by the sender's
    interval otherwise, and lost with the process)."""
    from mlflow.tracking import MlflowClient

    from astrai_core.training.callbacks import Callback

    class FailAt(Callback):
        def on_optimizer_step_end(self, run):
            if run.step == 7:
                raise RuntimeError("failed at step 7")

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("f", artifact_location=str(tmp_path / "a"))).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setattr(MetricLogger, "send_every", 3600.0)
    with pytest.raises(RuntimeError, match="failed at step 7"):
        train(make_cfg(core_tiny_data, tmp_path / "run", log_every=1, val_data=None), callbacks=[FailAt()])
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == list(range(1, 8))


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
@pytest.mark.parametrize("case", ["non_finite", "missing_data"])
def test_astrai_train_reports_a_rank_error_as_one_line(core_tiny_data, tmp_path, case):
    """`astrai train` (the launch path every stage shares): whatever a rank raised, the user reads one line."""
    import subprocess
    import sys

    import yaml

    kw = (dict(optim=dict(lr=1e6, min_lr=0, warmup_steps=0, grad_clip=0), max_steps=50, val_data=None)
          if case == "non_finite" else dict(train_data=str(tmp_path / "missing.h5")))
    cfg = make_cfg(core_tiny_data, tmp_path / "out", **kw)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "astrai.cli", "train", "--config", str(tmp_path / "cfg.yaml"),
                          "--nproc", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr  # one line
    expected = r"astrai: error: step \d+: non-finite loss .* lower optim.lr" if case == "non_finite" else \
        rf"astrai: error: {tmp_path / 'missing.h5'}: packed token file not found"
    assert __import__("re").match(expected, out.stderr.strip()), out.stderr
    assert not (tmp_path / "out").exists()


HANGING_TEARDOWN_WRAPPER = '''
import time
import torch.distributed
torch.distributed.destroy_process_group = lambda *a, **k: time.sleep(3600)  # the gloo deadlock of torch issue 56297
import astrai_core.training.train
astrai_core.training.train.main()
'''


@pytest.mark.integration
def test_a_failing_rank_exits_without_tearing_down_its_group(core_tiny_data, tmp_path):
    """Both ranks fail at the same non-finite step; tearing the gloo group down there can hang a rank for good
    (it did in CI), so a failing rank must leave without it. Here a teardown that never returns stands for the
    deadlock: the ranks still exit with the error line."""
    import subprocess
    import sys

    cfg = make_cfg(core_tiny_data, tmp_path / "out", optim=dict(lr=1e6, min_lr=0, warmup_steps=0, grad_clip=0),
                   max_steps=50, val_data=None)
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    (tmp_path / "rank.py").write_text(HANGING_TEARDOWN_WRAPPER)
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(tmp_path / "rank.py"), "--config", str(tmp_path / "cfg.json")],
                             capture_output=True, text=True, timeout=90, start_new_session=True,
                             env={**__import__("os").environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail("a failing rank hung in the process group's teardown")
    assert out.returncode != 0
    assert re.search(r"^error: step \d+: non-finite loss", out.stderr, re.M), out.stderr


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


# ---- loss normalization: uneven masks, accumulation and ranks never change the gradient ----------------------

MASKING_WRAPPER = '''
"""torchrun entry for the test: astrai_core.training.train with targets masked unevenly (a function of each window)."""
import astrai_core.training.strategies.seq as t

_read = t.read_windows

def masked(tokens, starts, seq_len):
    x, y = _read(tokens, starts, seq_len)
    y = y.clone()
    for i, s in enumerate(starts):
        y[i, : int(s) % (seq_len - 1)] = t.IGNORE_INDEX  # 0 .. seq_len - 2 of seq_len targets masked
    return x, y

t.read_windows = masked
import astrai_core.training.train
astrai_core.training.train.main()
'''


def _final_weights(cfg):
    return load_file(Path(cfg.out_dir) / "model.safetensors")


@pytest.mark.integration
def test_uneven_masks_accumulation_and_ranks_give_the_same_update(core_tiny_data, tmp_path, monkeypatch):
    """One global batch of 4 windows per step, masked unevenly, split as 1x4 (one batch), 4x1 (accumulation) and
    2 ranks x 2 micro-steps of 1: the same weights after 8 steps, since every micro-batch's summed loss is
    divided by the step's target count over all micro-steps and ranks."""
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    namespace: dict = {}
    wrapper_defs = MASKING_WRAPPER.split("t.read_windows = masked")[0]  # the function only: patch via monkeypatch
    exec(compile(wrapper_defs, "wrapper", "exec"), namespace)
    monkeypatch.setattr(strategies_module, "read_windows", namespace["masked"])

    def cfg(name, **kw):
        return make_cfg(core_tiny_data, tmp_path / name, max_steps=8, log_every=4, eval_every=0, **kw)

    batch, accum = cfg("batch", batch_size=4), cfg("accum", batch_size=1, grad_accum=4)
    train(batch)
    train(accum)
    ranks = cfg("ranks", batch_size=1, grad_accum=2)
    (tmp_path / "wrapper.py").write_text(MASKING_WRAPPER)
    (tmp_path / "ranks.json").write_text(ranks.model_dump_json())
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(tmp_path / "wrapper.py"), "--config", str(tmp_path / "ranks.json")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]

    reference = _final_weights(batch)
    for other in (accum, ranks):
        w = _final_weights(other)
        for k in reference:
            torch.testing.assert_close(w[k], reference[k], atol=1e-5, rtol=1e-4, msg=f"{other.out_dir}: {k}")
    # The masks really are uneven: a per-micro-batch mean would have weighted these windows differently.
    starts = WindowSampler(len(open_tokens(batch.train_data, sha256_file(batch.tokenizer), 300, 32)), 32,
                           batch.seed).starts(0, 4)
    assert len({int(s) % 31 for s in starts}) > 1


def test_activation_checkpointing_and_token_budget(core_tiny_data, tmp_path, monkeypatch):
    """Recomputing the blocks in backward changes memory, not numbers; max_tokens sets the number of steps."""
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    runs = {}
    for ac in (False, True):
        cfg = make_cfg(core_tiny_data, tmp_path / f"ac_{ac}", max_tokens=700, activation_checkpointing=ac,
                       label_smoothing=0.1, val_data=None)  # 8 x 32 = 256 tokens per step: 3 steps
        assert train(cfg)["steps"] == 3
        runs[ac] = load_file(Path(cfg.out_dir) / "model.safetensors")
    for k in runs[False]:
        torch.testing.assert_close(runs[True][k], runs[False][k], atol=0, rtol=0, msg=k)


def test_callback_lifecycle(core_tiny_data, tmp_path, monkeypatch):
    from astrai_core.training.callbacks import Callback

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    hooks = [h for h in vars(Callback) if h.startswith("on_")]

    class Record(Callback):
        def __init__(self):
            self.calls = []

    for h in hooks:
        setattr(Record, h, lambda self, run, *a, _h=h: self.calls.append(_h.removeprefix("on_")))
    rec = Record()
    train(make_cfg(core_tiny_data, tmp_path / "ok", max_steps=2, grad_accum=2, val_data=None,
                   optim=dict(lr=3e-3, min_lr=3e-4, warmup_steps=1)), callbacks=[rec])
    step = ["batch_begin", "batch_end"] * 2 + ["optimizer_step_begin", "optimizer_step_end"]
    assert rec.calls == ["train_begin", "epoch_begin", *step, *step, "epoch_end", "train_end"]
    # Checkpointing is the loop's own step, not a callback: the run is saved whatever the callbacks are.
    assert (tmp_path / "ok" / "model.safetensors").is_file()

    rec = Record()
    bad = make_cfg(core_tiny_data, tmp_path / "bad", optim=dict(lr=1e6, min_lr=0, warmup_steps=0, grad_clip=0),
                   max_steps=50, val_data=None)
    with pytest.raises(RuntimeError, match="non-finite"):
        train(bad, callbacks=[rec])
    assert rec.calls[-1] == "error"


def test_dtype_auto_is_bf16_only_where_the_device_has_it_natively(monkeypatch):
    from astrai_core.runtime.device import uses_bf16

    cpu = torch.device("cpu")
    for native in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert uses_bf16("auto", cpu) is native
        assert uses_bf16("bf16", cpu) and not uses_bf16("fp32", cpu)  # an explicit choice is kept
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert uses_bf16("auto", cpu)


def test_generation_dtype_auto_is_bf16_only_where_native_and_for_a_model_big_enough(monkeypatch, tmp_path):
    """`astrai serve` / `astrai generate` --dtype: auto gives bf16 weights only on a bf16-native device and from
    BF16_FROM_PARAMETERS parameters (counted from config.json); an explicit choice is kept; anything else is refused
    naming the option."""
    from astrai_core.checkpoint.model_dir import inference_dtype_of
    from astrai_core.model.config import ModelConfig
    from astrai_core.runtime.device import BF16_FROM_PARAMETERS, inference_dtype

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    for native in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        for parameters in (BF16_FROM_PARAMETERS - 1, BF16_FROM_PARAMETERS, 135_000_000):
            want = torch.bfloat16 if native and parameters >= BF16_FROM_PARAMETERS else torch.float32
            assert inference_dtype("auto", cpu, parameters)[0] == want, (native, parameters)
            assert inference_dtype("fp32", cpu, parameters) == (torch.float32, "--dtype")
            assert inference_dtype("bf16", cpu, parameters) == (torch.bfloat16, "--dtype")
            # batch invariance holds in fp32 only (tests/test_engine.py): auto gives it fp32, bf16 is refused
            assert inference_dtype("auto", cpu, parameters, batch_invariant=True)[0] == torch.float32
    with pytest.raises(ValueError, match="--dtype bf16 and --batch-invariant cannot be combined"):
        inference_dtype("bf16", cpu, 135_000_000, batch_invariant=True)
    with pytest.raises(ValueError, match="--dtype fp16: expected auto, fp32 or bf16"):
        inference_dtype("fp16", cpu, 10)
    # counted from the checkpoint's config (on a bf16-native CPU): the demo's model (0.66M) stays fp32, 6.7M go bf16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    for dim, want in ((128, torch.float32), (384, torch.bfloat16)):
        cfg = ModelConfig(vocab_size=512, dim=dim, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64)
        (tmp_path / str(dim)).mkdir()
        (tmp_path / str(dim) / "config.json").write_text(cfg.model_dump_json())
        dtype, why = inference_dtype_of(tmp_path / str(dim), "auto", cpu)
        assert dtype == want, (dim, why)


def test_progress_lines_end_with_the_time_left(core_tiny_data, tmp_path, monkeypatch, capsys):
    from astrai_core.runtime.progress import eta

    assert (eta(30, 10, 20.0), eta(0, 5, 9.0), eta(1000, 10, 50.0), eta(10, 0, 0.0)) == ("1m00s", "0s", "1h23m", "0s")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    train(make_cfg(core_tiny_data, tmp_path / "out", max_steps=10, log_every=5, eval_every=0))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and lines[0].split(" | ")[-1].startswith("eta ") and lines[-1].endswith("| eta 0s"), lines


def test_compiled_kernels_are_cached_per_cpu_instruction_set(tmp_path, monkeypatch):
    """A cluster's nodes share the project's kernel cache; inductor's own key does not tell AVX-512 code from
    AVX2 code, so each instruction set gets a folder of its own (parallel.compile_cache_dir)."""
    import os
    import subprocess
    import sys
    from types import SimpleNamespace

    from astrai_core.runtime.device import Dist
    from astrai_core.training.parallel import wrap

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cfg = SimpleNamespace(compile=True, compile_cache_dir=str(tmp_path / "kernels"), parallel="ddp", model=None)
    wrap(torch.nn.Linear(2, 2), cfg, Dist(0, 0, 1, torch.device("cpu")), None)  # compiles at the first call only
    isa = torch.backends.cpu.get_cpu_capability().lower()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kernels" / isa)
    folders = {}
    native = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    # torch held to AVX2 kernels (as on the slow kind of machine), and as it is here
    for name, env in (("avx2", {**native, "ATEN_CPU_CAPABILITY": "avx2"}), ("native", native)):
        folders[name] = subprocess.run(
            [sys.executable, "-c",
             "from astrai_core.training.parallel import compile_cache_dir; print(compile_cache_dir('k'))"],
            env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert folders["avx2"].endswith("/k/avx2")
    assert folders["native"].endswith(f"/k/{isa}")
