"""Exact resume: checkpoints (manifest, `latest`, keep-K, corrupt ones skipped) and real interrupted runs —
SIGTERM inside an accumulation window, SIGKILL of a torchrun group, a rank killed under --max-restarts, FSDP2 —
each resumed run's final weights compared bit for bit with an uninterrupted run's. Also two single-rank "nodes"
joined by c10d rendezvous."""

from __future__ import annotations

import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from astrai_core.checkpoint.checkpointer import find_resumable, save_resumable
from astrai_core.model.config import ModelConfig
from astrai_core.model.transformer import Transformer
from astrai_core.runtime.io import sha256_file
from astrai_core.training.callbacks import Callback
from astrai_core.training.config import TrainConfig
from astrai_core.training.train import train
from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def make_cfg(data: dict, out_dir, **kw) -> TrainConfig:
    base = dict(model=MODEL, optim=dict(lr=3e-3, min_lr=3e-4, warmup_steps=3), train_data=str(data["train"]),
                val_data=str(data["val"]), tokenizer=str(data["tokenizer"]), out_dir=str(out_dir), seq_len=32,
                batch_size=4, grad_accum=2, max_steps=16, log_every=1, eval_every=8, eval_batches=1, device="cpu",
                checkpoint_every=4, keep_checkpoints=2, resume="auto")
    return TrainConfig.model_validate({**base, **kw})


def weights_sha(cfg: TrainConfig) -> str:
    return sha256_file(Path(cfg.out_dir) / "model.safetensors")


# ---- checkpoint directory: latest pointer, keep-K, corrupt or incomplete checkpoints skipped ----------------

def test_resumable_checkpoints_keep_k_and_skip_corrupt(tmp_path, core_tiny_data):
    cfg = ModelConfig(**MODEL)
    model = Transformer(cfg)
    root = tmp_path / "ckpts"
    for step in (2, 4, 6, 8):
        save_resumable(root, step, keep=3, model=model, model_cfg=cfg, tokenizer_path=core_tiny_data["tokenizer"],
                       train_state={"step": step})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000006", "step_00000008"]
    assert (root / "latest").read_text().strip() == "step_00000008"
    assert find_resumable(root) == root / "step_00000008"
    state = torch.load(root / "step_00000008" / "train_state.pt", weights_only=True)
    assert state == {"step": 8}

    # A corrupted file: the manifest catches it, the one before is used.
    weights = root / "step_00000008" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="step_00000008.*sha256"):
        assert find_resumable(root) == root / "step_00000006"
    # An incomplete one (no manifest: e.g. copied by hand, or a staging dir renamed by mistake) is skipped too.
    (root / "step_00000006" / "manifest.json").unlink()
    with pytest.warns(UserWarning) as caught:
        assert find_resumable(root) == root / "step_00000004"
    assert [("sha256" in str(w.message), "manifest.json missing" in str(w.message)) for w in caught] == \
        [(True, False), (False, True)]
    # A staging directory of an interrupted write is never a candidate.
    (root / ".step_00000010.abc.tmp").mkdir()
    with pytest.warns(UserWarning) as caught:
        assert find_resumable(root) == root / "step_00000004"
    assert len(caught) == 2
    assert find_resumable(tmp_path / "nothing") is None


def test_sharded_checkpoints_hash_every_shard_file_and_skip_corrupt(tmp_path, core_tiny_data):
    from astrai_core.checkpoint.checkpointer import load_sharded, save_sharded
    from astrai_core.checkpoint.model_dir import load_model, verify_checkpoint
    from astrai_core.runtime.errors import AstraiError

    cfg = ModelConfig(**MODEL)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()  # an optimizer state to save
    root = tmp_path / "ckpts"
    for step in (2, 4, 6):  # what Trainee.save does on one process: the shards first, then the directory around them
        save_sharded(model, optimizer, root / ".dcp.tmp")
        save_resumable(root, step, keep=2, model=model, model_cfg=cfg, tokenizer_path=core_tiny_data["tokenizer"],
                       train_state={"step": step}, shards=root / ".dcp.tmp")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000006"]  # staging gone
    newest = root / "step_00000006"
    files = sorted(p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file())
    assert files == [".astrai-output", "config.json", "dcp/.metadata", "dcp/__0_0.distcp", "manifest.json", "tokenizer.json",
                     "train_state.pt"]  # no model.safetensors: nothing gathered
    assert sorted(verify_checkpoint(newest)) == [f for f in files if f not in ("manifest.json", ".astrai-output")]
    assert find_resumable(root) == newest
    # A sharded checkpoint is for resuming only: serving and init_from are told to use the final model directory.
    with pytest.raises(AstraiError, match="sharded training checkpoint"):
        load_model(newest)

    # The shards load back into a fresh model and optimizer (one process, no process group).
    fresh = Transformer(cfg)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    load_sharded(fresh, fresh_opt, newest / "dcp")
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])

    # A corrupted shard file: the manifest catches it, the one before is used.
    shard = newest / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"step_00000006/dcp/__0_0\.distcp: sha256"):
        assert find_resumable(root) == root / "step_00000004"
    (root / "step_00000004" / "dcp" / ".metadata").unlink()  # a missing one too
    with pytest.warns(UserWarning) as caught:
        assert find_resumable(root) is None
    assert [m for w in caught for m in ("06/dcp/__0_0.distcp: sha256", "04/dcp/.metadata: missing")
            if m in str(w.message)] == ["06/dcp/__0_0.distcp: sha256", "04/dcp/.metadata: missing"]


# ---- in-process: SIGTERM inside an accumulation window, early stopping ---------------------------------------

# A process that installs the training loop's SIGTERM handler and writes one byte each time it sees the flag set.
FLAG_CHILD = """
import os, signal
from astrai_core.training.train import StopFlag
stop = StopFlag()
signal.signal(signal.SIGTERM, stop.set)
os.write(1, b"r")
while True:
    while not stop.requested:
        pass
    stop.requested = False
    os.write(1, b"s")
"""


def test_a_second_sigterm_inside_the_handler_does_not_hang_the_rank():
    """torchrun forwards SIGTERM to each rank that a scheduler (or this suite's kill_run) also sent it, so the
    second can land while the handler for the first is running. Pairs of signals a few microseconds apart: with a
    lock in the handler (threading.Event) about 1 pair in 13 deadlocked the process here."""
    proc = subprocess.Popen([sys.executable, "-c", FLAG_CHILD], stdout=subprocess.PIPE, env=rank_env())
    try:
        fd = proc.stdout.fileno()
        assert select.select([fd], [], [], 60)[0] and os.read(fd, 1) == b"r"
        for i in range(300):
            os.kill(proc.pid, signal.SIGTERM)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < (i % 50) * 2e-6:
                pass
            os.kill(proc.pid, signal.SIGTERM)
            assert select.select([fd], [], [], 5)[0], f"no reply after signal pair {i}: the handler hung"
            os.read(fd, 64)
    finally:
        proc.kill()
        proc.wait()


class SigtermAt(Callback):
    """Send this process SIGTERM after micro-step `micro` of step `step` (0-based), i.e. inside the window."""

    def __init__(self, step: int, micro: int) -> None:
        self.step, self.micro = step, micro

    def on_batch_end(self, run) -> None:
        if run.step == self.step and run.micro == self.micro:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_inside_accumulation_window_then_resume_is_exact(core_tiny_data, tmp_path, monkeypatch):
    from astrai_core.training.train import default_callbacks

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    ref = make_cfg(core_tiny_data, tmp_path / "ref" / "out", grad_accum=3, checkpoint_every=0)
    assert train(ref)["steps"] == 16

    cfg = make_cfg(core_tiny_data, tmp_path / "run" / "out", grad_accum=3, checkpoint_every=0)
    stopped = train(cfg, callbacks=default_callbacks() + [SigtermAt(step=6, micro=1)])
    assert stopped["stopped"] == "SIGTERM" and stopped["steps"] == 7  # the step in flight was finished
    assert not Path(cfg.out_dir).exists()  # not a finished model
    assert (Path(cfg.checkpoints) / "latest").read_text().strip() == "step_00000007"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is restored

    resumed = train(cfg)
    assert resumed["resumed_from_step"] == 7 and resumed["steps"] == 16 and resumed["stopped"] is None
    assert weights_sha(cfg) == weights_sha(ref)
    # The metric curve continues where it stopped: one line per step, no duplicates.
    import json

    steps = [json.loads(line)["step"] for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 17))
    state = torch.load(Path(cfg.out_dir) / "train_state.pt", weights_only=True)
    assert state["step"] == 16 and state["consumed_samples"] == 16 * 3 * 4
    assert state["consumed_tokens"] == 16 * 3 * 4 * 32 and len(state["rng"]) == 1
    assert set(state["rng"][0]) >= {"python", "numpy", "torch"}


def test_early_stopping_stops(core_tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    # lr ~ 0: the validation loss cannot improve by min_delta, so patience 2 stops at the 3rd validation (step 6).
    cfg = make_cfg(core_tiny_data, tmp_path / "out", max_steps=40, eval_every=2, early_stopping_patience=2,
                   early_stopping_min_delta=1e-3, optim=dict(lr=1e-12, min_lr=0.0, warmup_steps=0),
                   checkpoint_every=0, grad_accum=1)
    summary = train(cfg)
    assert summary["stopped"].startswith("early stopping") and summary["steps"] == 6
    assert (Path(cfg.out_dir) / "model.safetensors").is_file()  # a finished run: final checkpoint written


# ---- real torchrun runs --------------------------------------------------------------------------------------

# Long enough that a kill at a "random" step lands well before the end (a step takes a few tens of ms).
RUN = dict(max_steps=40, checkpoint_every=5, eval_every=20)

def rank_env() -> dict[str, str]:
    """The environment torchrun's ranks get here: one thread each, this checkout importable, no MLflow parent."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_RUN_ID", None)
    return env


def torchrun(cfg: TrainConfig, *args: str, nproc: int = 2) -> subprocess.Popen:
    """Start `torchrun ... -m astrai_core.training.train --config CFG --resume auto` in its own process group."""
    cfg_path = Path(cfg.out_dir).parent / f"{Path(cfg.out_dir).name}.cfg.json"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(cfg.model_dump_json())
    if not any(a.startswith("--nnodes") for a in args):
        args = ("--standalone", *args)
    env = rank_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *args,
           "-m", "astrai_core.training.train", "--config", str(cfg_path), "--resume", "auto"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_ok(proc: subprocess.Popen, timeout: float = 120) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def read_until(proc: subprocess.Popen, prefix: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"never saw {prefix!r}:\n{''.join(lines)[-3000:]}")


def run_pids(cfg: TrainConfig) -> list[int]:
    """torchrun and its ranks (the ranks run in sessions of their own, so a process-group kill misses them)."""
    marker = f"{Path(cfg.out_dir).name}.cfg.json".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(Path(cfg.out_dir).parent).encode() in (proc / "cmdline").read_bytes() \
                    and marker in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def kill_run(proc: subprocess.Popen, cfg: TrainConfig, sig: int) -> str:
    """Send `sig` to torchrun and every rank at once (a node going down, or a scheduler preempting the job)."""
    pids = run_pids(cfg)
    assert len(pids) >= 3, pids
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    out, _ = proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while run_pids(cfg) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not run_pids(cfg)
    return out


@pytest.fixture(scope="module")
def reference(core_tiny_data, tmp_path_factory) -> dict:
    """Uninterrupted 2-rank runs (DDP and FSDP) of the config every interrupted run below repeats."""
    root = tmp_path_factory.mktemp("resume_ref")
    cfgs = {mode: make_cfg(core_tiny_data, root / mode / "out", parallel=mode, **RUN) for mode in ("ddp", "fsdp")}
    procs = {mode: torchrun(cfg) for mode, cfg in cfgs.items()}
    for proc in procs.values():
        wait_ok(proc)
    return cfgs


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_torchrun_stopped_and_resumed_is_bitwise_exact(reference, core_tiny_data, tmp_path, sig):
    cfg = make_cfg(core_tiny_data, tmp_path / "out", **RUN)
    at = random.Random(int(sig)).randint(8, 25)  # a "random" but reproducible step
    proc = torchrun(cfg)
    seen = read_until(proc, "checkpoint ")  # a periodic one exists: a SIGKILL then has something to resume from
    if not any(line.startswith(f"step {at}/") for line in seen):
        read_until(proc, f"step {at}/")
    out = kill_run(proc, cfg, sig)
    if sig == signal.SIGTERM:  # graceful: the ranks finish the step and checkpoint
        assert "stopped at step" in out and "SIGTERM" in out, out[-3000:]
    assert not Path(cfg.out_dir).exists()
    latest = find_resumable(cfg.checkpoints)
    assert latest is not None, "no checkpoint to resume from: the rerun would only show determinism"
    out = wait_ok(torchrun(cfg))
    resumed = re.search(rf"resuming from {re.escape(str(latest))} \(step (\d+)\)", out)
    assert resumed and int(resumed[1]) >= 5, out[-3000:]  # it resumed, at a checkpoint's step, not at 0
    assert weights_sha(cfg) == weights_sha(reference["ddp"])


def rank_pid(cfg: TrainConfig, rank: int) -> int | None:
    for pid in run_pids(cfg):
        try:
            if f"\0RANK={rank}\0".encode() in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                return pid
        except OSError:
            continue
    return None


@pytest.mark.integration
def test_a_rank_whose_launcher_dies_while_it_starts_never_trains(core_tiny_data, tmp_path):
    """torchrun killed while its rank still imports torch, before the rank can ask the kernel to kill it with its
    launcher: the rank ends instead of training alone and writing outputs (CI, 2026-12-03: a rank of bench/gpu.py
    outlived its SIGKILLed launcher)."""
    cfg = make_cfg(core_tiny_data, tmp_path / "out", max_steps=40)
    proc = torchrun(cfg, nproc=1)
    deadline = time.monotonic() + 60
    while True:  # the rank: its interpreter started, torch's libraries being loaded, not yet at init_distributed
        ranks = [pid for pid in run_pids(cfg) if pid != proc.pid]
        try:
            if ranks and b"libtorch_cpu" in Path(f"/proc/{ranks[0]}/maps").read_bytes():
                break
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "no rank started"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 120
    while run_pids(cfg) and time.monotonic() < deadline:  # orphaned, it would train its 40 steps and write
        time.sleep(0.1)
    assert not run_pids(cfg)
    assert not Path(cfg.out_dir).exists() and find_resumable(cfg.checkpoints) is None


@pytest.mark.integration
def test_dead_rank_restarts_group_which_resumes(reference, core_tiny_data, tmp_path):
    cfg = make_cfg(core_tiny_data, tmp_path / "out", **RUN)
    proc = torchrun(cfg, "--max-restarts=3")
    read_until(proc, "step 12/")
    pid = rank_pid(cfg, rank=1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    out = wait_ok(proc)
    assert "resuming from" in out, out[-3000:]
    assert weights_sha(cfg) == weights_sha(reference["ddp"])


RESTART_SCRIPT = """
import os, time
import torch, torch.distributed as dist
from astrai_core.training.distributed import init_distributed
restart, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if restart == 1 and rank == 0:
    time.sleep(3)  # the restarted rank 1 looks for rank 0's address before rank 0 has written it
init_distributed("gloo", "cpu")
x = torch.ones(1)
dist.all_reduce(x)
print(f"restart {restart} rank {rank}: all_reduce {x.item():g}", flush=True)
if restart == 0:
    if rank == 1:
        os._exit(3)  # dies with its group built: torchrun restarts both ranks
    time.sleep(60)  # rank 0 waits to be stopped by torchrun
dist.destroy_process_group()
"""


@pytest.mark.integration
def test_restarted_group_never_reads_the_dead_groups_addresses(tmp_path):
    # torchrun's store outlives a restart (--max-restarts), and with it the first group's gloo addresses: a
    # restarted rank that read its peer's old address got "connectFullMesh ... Connection refused" or hung (what
    # made test_dead_rank_restarts_group_which_resumes flaky). A race, so not every run shows it: before the fix
    # 2 of 3 runs of this script failed on this machine, 0 of 6 after; three runs here.
    script = tmp_path / "restart.py"
    script.write_text(RESTART_SCRIPT)
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "--max-restarts=1", str(script)], env=rank_env(), capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        for rank in (0, 1):
            assert f"restart 1 rank {rank}: all_reduce 2" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.integration
def test_fsdp_matches_ddp_and_resumes_exactly(reference, core_tiny_data, tmp_path):
    from safetensors.torch import load_file

    ddp = load_file(Path(reference["ddp"].out_dir) / "model.safetensors")
    fsdp = load_file(Path(reference["fsdp"].out_dir) / "model.safetensors")
    assert ddp.keys() == fsdp.keys()
    for k in ddp:
        torch.testing.assert_close(fsdp[k], ddp[k], atol=1e-5, rtol=1e-4, msg=k)

    cfg = make_cfg(core_tiny_data, tmp_path / "out", parallel="fsdp", **RUN)
    proc = torchrun(cfg)
    read_until(proc, "step 13/")
    kill_run(proc, cfg, signal.SIGKILL)
    assert find_resumable(cfg.checkpoints) is not None
    assert "resuming from" in wait_ok(torchrun(cfg))
    assert weights_sha(cfg) == weights_sha(reference["fsdp"])


@pytest.mark.integration
def test_two_single_rank_nodes_with_c10d_rendezvous(reference, core_tiny_data, tmp_path):
    cfg = make_cfg(core_tiny_data, tmp_path / "out", **{**RUN, "checkpoint_every": 0})
    rdzv = ["--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_id=t"]
    nodes = [torchrun(cfg, *rdzv, f"--node_rank={i}", nproc=1) for i in range(2)]
    for node in nodes:
        wait_ok(node)
    assert weights_sha(cfg) == weights_sha(reference["ddp"])
