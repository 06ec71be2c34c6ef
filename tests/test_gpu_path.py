"""The training step's GPU path, checked on the CPU (issue 44, items 1-3). No GPU is needed, and none is used:

* the loss's kernels do not grow with the tokens off the CPU: counted on the CPU with losses.CHUNKED_DEVICES
  emptied, so that the CPU takes the branch of losses.token_loss_sum that CUDA takes;
* a step that does not log waits for the device nowhere (no `.item()`, `bool(tensor)`: each is one
  aten._local_scalar_dense, which on a GPU is a host sync);
* the model and the loss compile with no graph break.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from astrai_core.model import losses
from astrai_core.model.config import ModelConfig
from astrai_core.model.losses import token_loss_sum
from astrai_core.model.transformer import Transformer
from astrai_core.training.config import TrainConfig
from astrai_core.training.train import train


class Dispatched(TorchDispatchMode):
    """Counts every aten operator called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


LARGE = ModelConfig(vocab_size=32768, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256)


def step_ops(batch: int, seq: int) -> collections.Counter[str]:
    """Operators of one training step's forward, loss and backward."""
    torch.manual_seed(0)
    model = Transformer(LARGE)
    x, y = torch.randint(0, LARGE.vocab_size, (2, batch, seq))
    with Dispatched() as counter:
        token_loss_sum(model(x), y).backward()
    return counter.ops


def test_off_the_cpu_a_steps_kernels_do_not_grow_with_its_tokens(monkeypatch):
    """At vocabulary 32,768 the chunked loss walked the logits 16 rows at a time: ~10 kernels per 16 tokens (on an
    H100, 86 % of a step went there). Off the CPU a step of 4 x 256 tokens dispatches exactly as many operators as
    one of 1 x 64."""
    monkeypatch.setattr(losses, "CHUNKED_DEVICES", ())
    small, large = step_ops(1, 64), step_ops(4, 256)
    assert sum(large.values()) == sum(small.values()), (large - small).most_common(5)


def test_the_loss_equals_cross_entropy_on_either_path():
    """The eager CPU path (chunks) and the other one (one pass) give F.cross_entropy's value and gradient."""
    torch.manual_seed(0)
    logits = torch.randn(3, 70, 300, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, 300, (3, 70))
    targets[0, :5] = -100
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), targets.reshape(-1), reduction="sum")
    (g_expected,) = torch.autograd.grad(expected, logits)
    chunked = token_loss_sum(logits, targets)  # eager CPU: _CrossEntropySum
    compiled = torch.compile(token_loss_sum, backend="aot_eager")(logits, targets)  # the one-pass branch
    for value in (chunked, compiled):
        (g,) = torch.autograd.grad(value, logits)
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(g, g_expected, rtol=1e-5, atol=1e-6)


def test_a_step_that_does_not_log_waits_for_the_device_nowhere(core_tiny_data, tmp_path, monkeypatch):
    """train() with logging, validation and checkpoints only at the end: the host reads a device value (one
    aten._local_scalar_dense each) as often in 8 steps as in 2, so a step in between reads none."""
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)

    def reads(steps: int) -> int:
        cfg = TrainConfig.model_validate(dict(
            model=dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
            optim=dict(lr=3e-3, min_lr=3e-4, warmup_steps=1), train_data=str(core_tiny_data["train"]),
            val_data=str(core_tiny_data["val"]), tokenizer=str(core_tiny_data["tokenizer"]),
            out_dir=str(tmp_path / f"run{steps}"), seq_len=32, batch_size=4, max_steps=steps, log_every=1000,
            eval_every=1000, checkpoint_every=0, eval_batches=1, device="cpu"))
        with Dispatched() as counter:
            train(cfg, callbacks=[])
        return counter.ops["aten._local_scalar_dense.default"]

    assert reads(8) == reads(2)


def test_a_non_finite_step_is_still_caught_and_named(core_tiny_data, tmp_path, monkeypatch):
    """The finite check, now read where the loop waits anyway, still stops the run naming the first bad step
    (step 1 here: the learning rate is absurd) and saves nothing."""
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    cfg = TrainConfig.model_validate(dict(
        model=dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
        optim=dict(lr=1e6, min_lr=0, warmup_steps=0, grad_clip=0), train_data=str(core_tiny_data["train"]),
        tokenizer=str(core_tiny_data["tokenizer"]), out_dir=str(tmp_path / "ckpt"), seq_len=32, batch_size=4,
        max_steps=30, log_every=10, checkpoint_every=0, device="cpu"))
    with pytest.raises(RuntimeError, match=r"step \d: non-finite loss or gradient norm"):
        train(cfg, callbacks=[])
    assert not (tmp_path / "ckpt").exists()


def test_the_model_and_the_loss_compile_without_graph_breaks():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32))
    x, y = torch.randint(0, 300, (2, 32)), torch.randint(0, 300, (2, 32))
    explained = torch._dynamo.explain(lambda x, y: token_loss_sum(model(x), y))(x, y)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_every_stage_resolves_its_device_in_one_place(tmp_path):
    """`device: auto` is the GPU when torch sees one, else the CPU (here: no GPU); asking for cuda without one is
    one line naming the values, from `astrai generate` as from a stage."""
    import subprocess
    import sys

    from astrai_core.runtime.device import resolve_device
    from astrai_core.runtime.errors import AstraiError
    from conftest import PROJECT_ROOT

    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(AstraiError, match="device tpu: expected auto, cpu or cuda"):
        resolve_device("tpu")
    if torch.cuda.is_available():
        return
    out = subprocess.run([sys.executable, "-m", "astrai.cli", "generate", "--model", str(tmp_path), "--prompt", "x",
                          "--device", "cuda"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert out.returncode == 2 and out.stderr.strip() == ("astrai: error: device cuda: expected auto, cpu or cuda "
                                                          "(and cuda needs a GPU build of torch and a GPU)"), out.stderr
