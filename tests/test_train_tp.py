"""Tensor parallelism through the real training entry point (torchrun -m astrai_core.training.train, gloo, CPU):

* `parallel: tp` with tp_size 2 trains like one rank (the same global batch: a TP group is one data-parallel
  rank), and `fsdp+tp` on 4 ranks (2 data-parallel x 2 TP) trains like one rank fed both groups' batches;
* the post-training strategies too: SFT (packed conversations) and DPO under TP=2 train like one rank;
* a TP run stopped with SIGTERM, or killed with SIGKILL (full or sharded checkpoints), resumes to bitwise the
  weights of an uninterrupted TP run;
* a checkpoint written under TP=2 resumes on one rank and under DDP=2 (full single-rank files either way); a
  sharded one (checkpoint_format sharded: each rank's shards, torch.distributed.checkpoint) resumes on one rank,
  and one written on one rank resumes under TP=2;
* what TP cannot split is refused when the params are parsed, in one line naming the field.

The module-level split itself (every architecture option, the optimizer state, generation) is tested in
tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_posttrain import _reference, chat_setup  # noqa: F401 - chat_setup is a fixture
from test_posttrain import make_cfg as post_cfg
from test_resume import kill_run, make_cfg, read_until, torchrun, wait_ok, weights_sha

from astrai_core.checkpoint.checkpointer import find_resumable
from astrai_core.checkpoint.model_dir import verify_checkpoint
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import OUTPUT_MARK
from astrai_core.training.config import TrainConfig
from astrai_core.training.train import train
from tasks.run.params import parse_params

# G = 8 samples per step in every run below: tp (1 data-parallel rank x batch 4 x accumulation 2), fsdp+tp (2 x 2 x
# 2) and one rank (batch 4 x 2). checkpoint_every 8 leaves the step-8 checkpoint that the cross-parallelism
# resumes start from (torchrun run directly, not through launch(), keeps its checkpoints).
RUN = dict(max_steps=24, checkpoint_every=8, keep_checkpoints=3, eval_every=12, grad_accum=2)
TP = dict(parallel="tp", tp_size=2)
# Measured max abs weight difference from one rank after 24 AdamW steps (fp32, torch 2.13): see the report in
# the test output. A wrong loss scale (a TP copy counted twice) moves the weights by ~1e-3 (half the learning
# rate's step), far above this.
WEIGHT_TOL = 1e-4


def weights(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    return load_file(Path(cfg.out_dir) / "model.safetensors")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def resume_on_one_rank(step8: Path, cfg: TrainConfig, reference: TrainConfig, label: str) -> None:
    """cfg resumes from a step-8 checkpoint written by 2 ranks on one rank (in this process) and ends within
    WEIGHT_TOL of the reference run's weights."""
    resume_from(step8, cfg)
    with pytest.warns(UserWarning, match="written by 2 ranks, resuming on 1"):
        summary = train(cfg)
    assert summary["resumed_from_step"] == 8 and summary["steps"] == 24
    diff = max_diff(weights(cfg), weights(reference))
    print(f"{label}: weights {diff:.1e}")
    assert diff <= WEIGHT_TOL


def losses(cfg: TrainConfig) -> list[float]:
    lines = (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [m["train/loss"] for m in map(json.loads, lines) if "train/loss" in m]


@pytest.fixture(scope="module")
def runs(core_tiny_data, tmp_path_factory) -> dict[str, TrainConfig]:
    """Uninterrupted runs of one config: one rank (in this process), TP=2 (torchrun), and TP=2 writing sharded
    checkpoints."""
    root = tmp_path_factory.mktemp("tp_runs")
    cfgs = {"one": make_cfg(core_tiny_data, root / "one" / "out", **RUN),
            "tp": make_cfg(core_tiny_data, root / "tp" / "out", **RUN, **TP),
            "tp_sharded": make_cfg(core_tiny_data, root / "tp_sharded" / "out", **RUN, **TP,
                                   checkpoint_format="sharded")}
    proc = torchrun(cfgs["tp"])
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_RUN_ID", raising=False)  # no MLflow run around the in-process one
        train(cfgs["one"])
    out = wait_ok(proc)
    assert "(cpu, fp32, tp, 1 x tp 2), 24 steps of 8 samples" in out, out[-2000:]
    wait_ok(torchrun(cfgs["tp_sharded"]))  # after the others: more ranks than cores at once made exits hang
    return cfgs


@pytest.mark.integration
def test_tp2_trains_like_one_rank(runs, monkeypatch):
    diff = max_diff(weights(runs["one"]), weights(runs["tp"]))
    loss_diff = max(abs(a - b) for a, b in zip(losses(runs["one"]), losses(runs["tp"]), strict=True))
    print(f"tp=2 vs one rank after 24 steps: weights {diff:.1e}, train/loss {loss_diff:.1e}")
    assert diff <= WEIGHT_TOL and loss_diff <= 1e-5
    summary = json.loads((Path(runs["tp"].out_dir) / "summary.json").read_text())
    assert summary["tokens_seen"] == 24 * 8 * 32  # the TP copy of the batch is not counted


@pytest.mark.integration
def test_fsdp_tp_2x2_trains_like_one_rank(runs, core_tiny_data, tmp_path):
    cfg = make_cfg(core_tiny_data, tmp_path / "out", **{**RUN, "batch_size": 2, "checkpoint_every": 0},
                   parallel="fsdp+tp", tp_size=2)
    out = wait_ok(torchrun(cfg, nproc=4), timeout=300)
    assert "(cpu, fp32, fsdp+tp, 2 x tp 2), 24 steps of 8 samples" in out, out[-2000:]
    diff = max_diff(weights(runs["one"]), weights(cfg))
    loss_diff = max(abs(a - b) for a, b in zip(losses(runs["one"]), losses(cfg), strict=True))
    print(f"fsdp+tp 2x2 vs one rank after 24 steps: weights {diff:.1e}, train/loss {loss_diff:.1e}")
    assert diff <= WEIGHT_TOL and loss_diff <= 1e-5


@pytest.mark.integration
def test_tp_stopped_by_sigterm_resumes_bitwise(runs, core_tiny_data, tmp_path):
    cfg = make_cfg(core_tiny_data, tmp_path / "out", **RUN, **TP)
    proc = torchrun(cfg)
    read_until(proc, "step 11/")
    out = kill_run(proc, cfg, signal.SIGTERM)
    assert "stopped at step" in out and "SIGTERM" in out, out[-3000:]
    assert not Path(cfg.out_dir).exists()
    out = wait_ok(torchrun(cfg))
    assert "resuming from" in out and "(step 8)" not in out, out[-3000:]  # the SIGTERM checkpoint, not step 8
    assert weights_sha(cfg) == weights_sha(runs["tp"])


@pytest.mark.integration
@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_tp_killed_by_sigkill_resumes_bitwise(runs, core_tiny_data, tmp_path, checkpoint_format):
    cfg = make_cfg(core_tiny_data, tmp_path / "out", **RUN, **TP, checkpoint_format=checkpoint_format)
    at = random.Random(checkpoint_format).randint(9, 20)  # a "random" but reproducible step after a checkpoint
    proc = torchrun(cfg)
    read_until(proc, f"step {at}/")
    kill_run(proc, cfg, signal.SIGKILL)  # torchrun and both ranks at once: no rank gets to write anything
    assert not Path(cfg.out_dir).exists()
    latest = find_resumable(cfg.checkpoints)
    assert latest is not None and latest.name in ("step_00000008", "step_00000016"), latest
    assert (latest / "dcp").is_dir() == (checkpoint_format == "sharded")
    out = wait_ok(torchrun(cfg))
    assert f"resuming from {latest}" in out, out[-3000:]
    assert weights_sha(cfg) == weights_sha(runs["tp"])


@pytest.mark.integration
def test_sft_and_dpo_under_tp_train_like_one_rank(chat_setup, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    dpo = {"beta": 0.5, "reference_logps": _reference(chat_setup, tmp_path / "ref.h5")}
    for strategy, kw in (("sft", {}), ("dpo", {"dpo": dpo})):
        one = post_cfg(chat_setup, tmp_path / strategy / "one", strategy, max_steps=8, **kw)
        tp = post_cfg(chat_setup, tmp_path / strategy / "tp", strategy, max_steps=8, **kw, **TP)
        proc = torchrun(tp)
        train(one)
        wait_ok(proc)
        diff = max_diff(weights(one), weights(tp))
        m_one, m_tp = ([json.loads(line) for line in (Path(c.out_dir) / "metrics.jsonl").read_text().splitlines()]
                       for c in (one, tp))
        # Relative where large (DPO's summed log-probabilities are in the hundreds); DPO's rewards are beta x
        # differences of such sums, where fp32 rounding leaves up to ~1e-5 (measured 6e-6).
        metric_diff = max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(m_one, m_tp, strict=True) for k in a
                          if k not in ("step", "time", "train/tokens_per_sec"))
        print(f"{strategy} tp=2 vs one rank after 8 steps: weights {diff:.1e}, metrics (relative) {metric_diff:.1e}")
        assert diff <= WEIGHT_TOL and metric_diff <= 5e-5
        assert all(a.keys() == b.keys() for a, b in zip(m_one, m_tp))


def resume_from(step_dir: Path, cfg: TrainConfig) -> None:
    """Make `step_dir` (another run's checkpoint) the newest checkpoint of `cfg`'s run."""
    root = Path(cfg.checkpoints)
    root.mkdir(parents=True)
    shutil.copytree(step_dir, root / step_dir.name)
    (root / "latest").write_text(step_dir.name + "\n")


@pytest.mark.integration
def test_tp_checkpoint_resumes_on_one_rank_and_under_ddp(runs, core_tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    step8 = {name: Path(runs[name].checkpoints) / "step_00000008" for name in ("one", "tp")}
    # TP writes the single-rank files: the weights and the (name-keyed) optimizer state of one model.
    assert set(load_file(step8["tp"] / "model.safetensors")) == set(load_file(step8["one"] / "model.safetensors"))

    # On one rank (ddp, tp_size 1): the rest of the run is the one-rank run's.
    one = make_cfg(core_tiny_data, tmp_path / "one" / "out", **RUN)
    resume_on_one_rank(step8["tp"], one, runs["one"], "tp=2 checkpoint resumed on one rank vs one rank")

    # Under DDP=2 (each rank a batch of 4: 16 samples a step from step 8 on): the same as DDP=2 resumed from the
    # one-rank run's step-8 checkpoint, whose optimizer state is the position-keyed one DDP writes.
    ddp = {name: make_cfg(core_tiny_data, tmp_path / f"ddp_from_{name}" / "out", **RUN) for name in ("one", "tp")}
    for name, cfg in ddp.items():  # one after the other: 4 ranks at once on 2 cores made exits hang (see report)
        resume_from(step8[name], cfg)
        assert "resuming from" in wait_ok(torchrun(cfg))
        state = torch.load(Path(cfg.out_dir) / "train_state.pt", weights_only=True)
        assert state["consumed_samples"] == 8 * 8 + 16 * 16
    diff = max_diff(weights(ddp["one"]), weights(ddp["tp"]))
    print(f"DDP=2 resumed from the tp=2 vs the one-rank checkpoint: weights {diff:.1e}")
    assert diff <= WEIGHT_TOL


# ---- refusals at parse time ---------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, message", [
    (dict(model=dict(n_heads=4, n_kv_heads=1), pretrain=dict(parallel="tp", tp_size=2, nproc=2)),
     "params.yaml: pretrain: model.n_kv_heads (1) is not divisible by tp_size (2)"),
    (dict(model=dict(dim=96, n_heads=6, n_kv_heads=6), pretrain=dict(parallel="fsdp+tp", tp_size=4, nproc=8)),
     "params.yaml: pretrain: model.n_heads (6) is not divisible by tp_size (4)"),
    (dict(model=dict(attention="mla"), pretrain=dict(parallel="tp", tp_size=2, nproc=2)),
     "params.yaml: pretrain: model.attention 'mla' is not supported with tensor parallelism"),
    (dict(model=dict(n_experts=4), sft=dict(parallel="tp", tp_size=2, nproc=2)),
     "params.yaml: sft: model.n_experts (4) is not supported with tensor parallelism"),
    (dict(sft=dict(parallel="tp", tp_size=2, nproc=2, lora={})),
     "params.yaml: sft: lora is not supported with tensor parallelism"),
    (dict(grpo=dict(parallel="fsdp+tp", tp_size=2, nproc=4)),
     "params.yaml: grpo: strategy 'grpo' is not supported with parallel 'fsdp+tp' yet"),
    (dict(pretrain=dict(parallel="tp", tp_size=2, nproc=4)),
     "params.yaml: pretrain.nproc: parallel 'tp' runs on exactly tp_size ranks: tp_size is 2, the ranks 4"),
    (dict(dpo=dict(parallel="fsdp+tp", tp_size=2, nproc=3)),
     "params.yaml: dpo.nproc: parallel 'fsdp+tp': tp_size (2) must divide the number of ranks (3)"),
    (dict(pretrain=dict(tp_size=2)),
     "params.yaml: pretrain: tp_size (2) applies to parallel 'tp' or 'fsdp+tp' only"),
    (dict(pretrain=dict(parallel="tp")), "params.yaml: pretrain: parallel 'tp' needs tp_size >= 2"),
])
def test_params_refuse_what_tp_cannot_split(raw, message):
    with pytest.raises(AstraiError) as e:
        parse_params(raw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_params_accept_tp_with_only_params_changed():
    params = parse_params(dict(pretrain=dict(parallel="tp", tp_size=2, nproc=2),
                               sft=dict(parallel="fsdp+tp", tp_size=2, nproc=4), dpo=dict(parallel="tp", tp_size=2)))
    assert (params.pretrain.parallel, params.sft.tp_size, params.dpo.nproc) == ("tp", 2, "auto")


def test_ranks_that_do_not_fit_tp_are_one_line(core_tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    # nproc "auto" is checked by the ranks: 1 rank cannot hold a TP=2 split.
    cfg = make_cfg(core_tiny_data, tmp_path / "out", max_steps=1, optim=dict(warmup_steps=0), **TP)
    with pytest.raises(AstraiError, match=r"^parallel 'tp' runs on exactly tp_size ranks: tp_size is 2, the ranks 1"):
        train(cfg)


# ---- sharded checkpoints (checkpoint_format sharded) -------------------------------------------------------------

@pytest.mark.integration
def test_sharded_checkpoints_resume_from_tp2_on_one_rank_and_back(runs, core_tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    sharded = runs["tp_sharded"]
    # The format changes what is written, not what is computed; the final model is the plain full one.
    assert weights_sha(sharded) == weights_sha(runs["tp"])
    assert not (Path(sharded.out_dir) / "dcp").exists()
    root = Path(sharded.checkpoints)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000008", "step_00000016"]  # staging gone
    step8 = root / "step_00000008"
    # Each rank wrote its own shards (nothing gathered), and the manifest hashes every file.
    files = verify_checkpoint(step8)
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(files) and "model.safetensors" not in files
    assert set(files) == {p.relative_to(step8).as_posix() for p in step8.rglob("*")
                          if p.is_file() and p.name not in ("manifest.json", OUTPUT_MARK)}  # the mark comes last
    assert "optimizer" not in torch.load(step8 / "train_state.pt", weights_only=True)  # it is in the shards

    # A corrupted shard of rank 1's: the manifest catches it, and the checkpoint before is resumed instead.
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    shard = copy / "step_00000016" / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"step_00000016/dcp/__1_0\.distcp: sha256 does not match"):
        assert find_resumable(copy) == copy / "step_00000008"

    # Resumed on one rank (2 ranks -> 1; TP's shards -> plain tensors): the rest is the one-rank run's.
    one = make_cfg(core_tiny_data, tmp_path / "one" / "out", **RUN, checkpoint_format="sharded")
    resume_on_one_rank(step8, one, runs["one"], "tp=2 sharded checkpoint (step 8) resumed on one rank vs one rank")

    # And back (1 rank -> 2; plain tensors -> TP's shards): that run's step-16 checkpoint, one process's shards,
    # resumed under TP=2 ends where the uninterrupted TP run does.
    step16 = Path(one.checkpoints) / "step_00000016"
    assert {"dcp/__0_0.distcp", "dcp/.metadata"} <= set(verify_checkpoint(step16))
    tp = make_cfg(core_tiny_data, tmp_path / "tp" / "out", **RUN, **TP)
    resume_from(step16, tp)
    out = wait_ok(torchrun(tp))
    assert f"resuming from {Path(tp.checkpoints) / step16.name}" in out and "written by 1 ranks, resuming on 2" in out
    diff = max_diff(weights(tp), weights(runs["tp"]))
    print(f"its step-16 sharded checkpoint resumed under tp=2 vs tp=2: weights {diff:.1e}")
    assert diff <= WEIGHT_TOL
