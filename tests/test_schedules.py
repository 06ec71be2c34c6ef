"""Each learning-rate schedule's shape: warmup, peak, decay, restarts, floor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from astrai_core.training.config import OptimConfig
from astrai_core.training.optim import SCHEDULES, lr_at


def lrs(n: int, **kw) -> list[float]:
    optim = OptimConfig(**{"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, **kw})
    return [lr_at(s, optim, n) for s in range(n + 1)]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_schedule_warms_up_linearly_to_the_peak_and_stays_in_range(schedule):
    lr = lrs(100, schedule=schedule, restart_period=30)
    warm = lr[:11]
    assert all(b > a for a, b in zip(warm, warm[1:]))
    assert np.allclose(np.diff(warm), warm[0])  # linear, starting above zero
    assert lr[10] == pytest.approx(1e-3) and max(lr) == pytest.approx(1e-3)
    assert min(lr[10:]) >= 1e-4 - 1e-12  # after warmup, never below min_lr


def test_cosine():
    lr = lrs(100)
    decay = lr[10:]
    assert all(b <= a for a, b in zip(decay, decay[1:]))  # monotone cosine decay
    assert lr[55] == pytest.approx((1e-3 + 1e-4) / 2)  # halfway: midpoint
    assert lr[100] == pytest.approx(1e-4)
    assert lr_at(500, OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10), 100) == pytest.approx(1e-4)
    assert lr_at(0, OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0), 10) == pytest.approx(1e-3)


def test_sgdr_restarts_with_growing_periods():
    lr = lrs(200, schedule="sgdr", restart_period=20, restart_mult=2.0)
    # cycles start (at the peak) after warmup at 10, then 10 + 20 = 30, then 30 + 40 = 70, then 70 + 80 = 150
    restarts = [s for s in range(11, 201) if lr[s] > lr[s - 1]]
    assert restarts == [30, 70, 150]
    for start in (10, 30, 70, 150):
        assert lr[start] == pytest.approx(1e-3)
    assert lr[50] == pytest.approx((1e-3 + 1e-4) / 2)  # the middle of the 40-step cycle starting at 30
    assert lr[69] < 1.1e-4  # the end of a cycle is near min_lr
    same = lrs(100, schedule="sgdr", restart_period=30, restart_mult=1.0)
    assert [s for s in range(11, 101) if same[s] > same[s - 1]] == [40, 70, 100]  # fixed period


def test_warmup_stable_decay():
    lr = lrs(100, schedule="wsd", decay_fraction=0.2)
    assert all(x == pytest.approx(1e-3) for x in lr[10:80])  # stable
    decay = lr[80:]
    assert all(b < a for a, b in zip(decay, decay[1:]))
    assert np.allclose(np.diff(decay), np.diff(decay)[0])  # linear
    assert lr[90] == pytest.approx((1e-3 + 1e-4) / 2) and lr[100] == pytest.approx(1e-4)


def test_the_training_loop_follows_the_schedule(tmp_path, core_tiny_data):
    """The loop's wiring, not a LambdaLR built here: every logged train/lr of a real run is the schedule's lr at
    that step (the lr the step's update used, step s logging optimizer step s - 1)."""
    from astrai_core.training.config import TrainConfig
    from astrai_core.training.train import train

    optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=3, schedule="wsd", decay_fraction=0.5)
    cfg = TrainConfig(model=dict(vocab_size=300, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32),
                      optim=optim, train_data=str(core_tiny_data["train"]), tokenizer=str(core_tiny_data["tokenizer"]),
                      out_dir=str(tmp_path / "out"), seq_len=32, batch_size=2, max_steps=12, log_every=1, device="cpu")
    train(cfg, callbacks=[])
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, 13))
    assert [m["train/lr"] for m in logged] == pytest.approx([lr_at(s, optim, 12) for s in range(12)])
    assert len(set(round(m["train/lr"], 12) for m in logged)) > 5  # warmup, stable and decay all seen
