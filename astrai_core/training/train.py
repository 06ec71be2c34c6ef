"""The training loop, read top to bottom in train(): every strategy (seq, sft, dpo, grpo), DDP, FSDP2 or tensor
parallelism across ranks, exact resume.

Run it alone (cfg.json is a TrainConfig as JSON):

    python -m astrai_core.training.train --config cfg.json                                        # one process
    torchrun --standalone --nproc_per_node=2 -m astrai_core.training.train --config cfg.json      # 2 ranks, one machine
    torchrun --nnodes=2 --node_rank=$NODE --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=RUN \\
        --nproc_per_node=8 -m astrai_core.training.train --config cfg.json --resume auto          # on each of 2 nodes
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 -m astrai_core.training.train \\
        --config cfg.json --resume auto          # a rank that dies restarts the group, which resumes on its own

Data: the training tokens are cut into non-overlapping windows of seq_len + 1, shuffled once per epoch by
(seed, epoch). Step s trains on the global samples [s*G, (s+1)*G), G = ranks x grad_accum x batch_size, and
micro-step m of rank r takes slice m * ranks + r of them. So a run is a pure function of (config, step): 2 ranks
x batch B trains exactly like 1 rank x batch 2B, 4 micro-steps of 1 like one batch of 4, and the sampler's
position is a sample count. "Ranks" here are the data-parallel ones: with tensor parallelism (parallel tp or
fsdp+tp, astrai_core/training/parallel.py) the tp_size ranks of a TP group split one model and share its batches, so
TP=2 x batch B trains like 1 rank x batch B.

Loss: summed over target tokens and divided by the number of target tokens of the whole step (every micro-step
on every data-parallel rank; targets equal to IGNORE_INDEX do not count), times the data-parallel size because
DDP and FSDP average gradients over those ranks (a TP group computes one loss and is one such rank). Masking and
the split into micro-steps and ranks therefore never change the gradient.

One step: the strategy's micro-batches -> forward and backward over the accumulation window -> the gradient norm
(whether it and the loss are finite stays on the device; the run stops at the next step that logs, validates or
checkpoints, naming the first bad step) -> clipping -> optimizer and schedule -> validation and early stopping ->
metrics -> a resumable checkpoint when due. Callbacks (astrai_core/training/callbacks.py) observe each point; the run's
counters live in RunState, which a checkpoint keeps with the model, optimizer, schedule, data position and RNGs.
What the loop trains is built for its parallel layout by astrai_core/training/parallel.py (build), the strategy behind
its contract in astrai_core/training/strategies/, and checkpoints are written and resumed by
astrai_core/checkpoint/checkpointer.py (Checkpointer).

Stopping and resuming: SIGTERM asks for a stop; the current step (all its micro-steps) finishes, the ranks agree
by an all-reduce, a resumable checkpoint is written and the process exits 0. A killed run (SIGKILL, a lost node)
resumes from the newest periodic checkpoint (checkpoint_every). On CPU with the same config a resumed run ends
with weights bitwise equal to an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from astrai_core.checkpoint.checkpointer import Checkpointer, load_train_state, resumable_checkpoint
from astrai_core.data.batches import open_checked
from astrai_core.runtime import env
from astrai_core.runtime.device import DataGroup, Dist
from astrai_core.runtime.errors import AstraiError, TrainingError
from astrai_core.runtime.io import disk_full, sha256_file
from astrai_core.training.callbacks import Callback, ProgressBar, RunState
from astrai_core.training.config import TrainConfig
from astrai_core.training.distributed import cleanup, init_distributed, lost_peers, report_error
from astrai_core.training.metric_log import MetricLogger, system_metrics
from astrai_core.training.parallel import Trainee, build, grad_sync, total_grad_norm


def default_callbacks() -> list[Callback]:
    """What a run shows besides its metrics files: the progress line (a tqdm bar on a terminal)."""
    return [ProgressBar()]


def emit(callbacks: list[Callback], hook: str, run: RunState, *args) -> None:
    for cb in callbacks:
        getattr(cb, hook)(run, *args)


def due(step: int, every: int) -> bool:
    """Whether a periodic action (every `every` steps; 0: never) falls on `step`."""
    return every > 0 and step % every == 0


class StopFlag:
    """Set by the SIGTERM handler. A plain attribute and no lock: threading.Event.set takes one, and a second
    SIGTERM landing while the handler holds it (torchrun forwards to each rank the SIGTERM a scheduler may also
    send it) runs the handler again inside itself, which then waits on its own lock forever."""

    requested = False

    def set(self, *_) -> None:
        self.requested = True


def mean_over_ranks(sums: dict[str, torch.Tensor], stats: dict[str, tuple[float, float]], units: int,
                    dp: DataGroup, device: torch.device) -> dict[str, float]:
    """The strategy's metrics of this step, averaged over the data-parallel ranks: `sums` per loss unit (divided by
    the step's unit count), `stats` as (sum, count) pairs. Every rank holds the same keys, so one all-reduce does."""
    keys, stat_keys = sorted(sums), sorted(stats)
    if not keys and not stat_keys:
        return {}
    values = [sums[k].reshape(()).to(device) for k in keys]
    values += [torch.tensor(float(stats[k][i]), device=device) for k in stat_keys for i in (0, 1)]
    total = dp.all_reduce_sum(torch.stack(values).double()).tolist()
    out = {k: total[i] / units for i, k in enumerate(keys)}
    for j, k in enumerate(stat_keys):
        s, n = total[len(keys) + 2 * j], total[len(keys) + 2 * j + 1]
        out[k] = s / n if n else float("nan")
    return out


# ---- one step ------------------------------------------------------------------------------------------------

class FiniteCheck:
    """Whether every step's loss and gradient norm were finite, kept on the device: reading it each step would make
    the host wait for the whole step there, every step (on a GPU the next batch is read while the step runs only
    if nothing waits). The loop reads it wherever it waits anyway: logging, validation, a checkpoint, the end. A
    non-finite step's update may reach the weights before the read; the run then stops there with the first bad
    step named, and nothing after that step is saved."""

    def __init__(self, device: torch.device) -> None:
        self.first_bad = torch.zeros((), dtype=torch.long, device=device)  # 0: every step so far was finite

    def add(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        bad = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
        self.first_bad = torch.where(bad & (self.first_bad == 0), step, self.first_bad)

    def check(self) -> None:
        if step := int(self.first_bad):
            raise TrainingError(f"step {step}: non-finite loss or gradient norm; lower optim.lr, raise "
                                "optim.warmup_steps or use fp32")


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed loss
    units: int  # loss units (target tokens, pairs, completion tokens) of the whole step, every data rank
    tokens: int  # tokens fed to the model in the whole step
    grad_norm: torch.Tensor


def train_step(t: Trainee, run: RunState, callbacks: list[Callback], cfg: TrainConfig,
               finite: FiniteCheck) -> StepResult:
    """One optimizer step: the strategy's preparation (GRPO's rollouts) and this rank's micro-batches, forward and
    backward over the accumulation window, the gradient norm (with the loss, into `finite`), clipping, the update.
    The step's strategy metrics go to run.metrics. Nothing here waits for the device in a one-rank step (the finite
    check is read by the loop), so on a GPU the host reads the next batch while this one runs."""
    stats = t.strategy.prepare(run.step, t.model, t.dp)
    batches = t.strategy.micro_batches(run.step)
    units, tokens = sum(b.count for b in batches), sum(b.n_tokens for b in batches)
    if t.dp.size > 1:  # the whole step's counts: one all-reduce, and the one wait for the device in a multi-rank step
        counts = torch.tensor([float(units), float(tokens)], device=t.device)
        units, tokens = (int(v) for v in t.dp.all_reduce_sum(counts).tolist())
    if units == 0:
        raise TrainingError(f"step {run.step + 1}: nothing to learn from in the whole step (every target masked); "
                            "check the data")

    # The loss is summed over units and divided by the whole step's count (times the data-parallel size: DDP and
    # FSDP average the ranks' gradients; a TP group computes one loss, whose gradient its ranks share).
    loss_sum = torch.zeros((), device=t.device)
    metric_sums: dict[str, torch.Tensor] = {}
    for run.micro, batch in enumerate(batches):
        emit(callbacks, "on_batch_begin", run)
        # Gradients are all-reduced only on the last micro-step; the earlier ones just accumulate locally.
        with grad_sync(t.wrapped, t.model, enabled=run.micro == cfg.grad_accum - 1):
            loss, metrics = t.strategy.loss(batch.logits(t.wrapped, t.autocast), batch)
            scaled = loss * (t.dp.size / units)
            aux = getattr(t.model, "aux_loss", None)  # e.g. a mixture-of-experts balance loss
            if isinstance(aux, torch.Tensor):
                scaled = scaled + aux / cfg.grad_accum
            scaled.backward()
        loss_sum += loss.detach()
        for k, v in metrics.items():
            metric_sums[k] = metric_sums.get(k, 0) + v.detach().float()
        emit(callbacks, "on_batch_end", run)
    run.metrics.update(mean_over_ranks(metric_sums, stats, units, t.dp, loss_sum.device))

    # The norm is taken after the all-reduce, so it is the same on every rank (and a non-finite loss on one rank
    # makes it non-finite everywhere). Whether it is finite stays on the device (FiniteCheck).
    params = list(t.model.parameters())
    grad_norm = total_grad_norm(params)
    finite.add(run.step + 1, loss_sum, grad_norm)
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.grad_clip, grad_norm)
    emit(callbacks, "on_optimizer_step_begin", run)
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, units, tokens, grad_norm)


def validate(t: Trainee, run: RunState, cfg: TrainConfig) -> bool:
    """The strategy's held-out metrics into run.metrics (held-out loss, or GRPO's held-out task accuracy), and
    early stopping on val/loss: True when the run should end here."""
    run.metrics.update(t.strategy.validate(t.wrapped, t.model, t.dp))
    run.val_loss = run.metrics.get("val/loss")
    if not cfg.early_stopping_patience:
        return False
    if run.val_loss < run.best_val - cfg.early_stopping_min_delta:
        run.best_val, run.bad_validations = run.val_loss, 0
    else:
        run.bad_validations += 1
    if run.bad_validations < cfg.early_stopping_patience or run.step >= t.max_steps:
        return False
    run.stop = (f"early stopping: no val/loss improvement in {run.bad_validations} validations "
                f"(best {run.best_val:.4f})")
    return True


class Throughput:
    """Tokens per second: over the log window (reset each time it is read), and over the run without its first
    step (warm-up) for the summary. Steps only: validation and checkpoints are not timed."""

    def __init__(self) -> None:
        self.window_seconds, self.window_tokens = 0.0, 0
        self.seconds, self.tokens = 0.0, 0

    def add(self, seconds: float, tokens: int, warm: bool) -> None:
        self.window_seconds, self.window_tokens = self.window_seconds + seconds, self.window_tokens + tokens
        if warm:
            self.seconds, self.tokens = self.seconds + seconds, self.tokens + tokens

    def window(self) -> float:
        rate = self.window_tokens / self.window_seconds
        self.window_seconds, self.window_tokens = 0.0, 0
        return rate

    def overall(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


def stop_requested(stop: StopFlag, d: Dist) -> bool:
    """Whether any rank got SIGTERM: every rank must agree to stop at the same step."""
    if d.world_size == 1:
        return stop.requested
    flag = torch.tensor(float(stop.requested), device=d.device)
    dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    return flag.item() > 0


@contextlib.contextmanager
def sigterm_stops(stop: StopFlag):
    """SIGTERM (a scheduler's preemption, torchrun stopping the group) sets `stop` while the run lasts (signals
    reach the main thread only: a run in another thread keeps the default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop.set)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- the loop ----------------------------------------------------------------------------------------------------

def check_train_inputs(cfg: TrainConfig) -> None:
    """What the ranks read first, checked where a run is launched, before torchrun (or Slurm) starts: a missing or
    corrupt file is then one line naming it, not every rank's failure and torchrun's report. The tokenizer, the
    packed files (against the tokenizer's sha256), the other inputs' presence, and the training state a resumed
    run would load. The stage (tasks/stages/training.py) and `astrai train` call it before either launcher."""
    if not Path(cfg.tokenizer).is_file():
        raise AstraiError(f"{cfg.tokenizer}: tokenizer file not found; run the tokenizer stage")
    if cfg.strategy == "grpo":  # JSONL prompts
        for path in filter(None, (cfg.train_data, cfg.val_data)):
            if not Path(path).is_file():
                raise AstraiError(f"{path}: GRPO prompts not found; run the chat_data stage")
    else:
        sha = sha256_file(cfg.tokenizer)
        mix = (cfg.two_stage.stage2_data or {}) if cfg.two_stage else {}
        for path in dict.fromkeys(filter(None, (cfg.train_data, cfg.val_data, *mix))):
            open_checked(path, sha, cfg.model.vocab_size).close()
    if cfg.strategy == "dpo" and not Path(cfg.dpo.reference_logps).is_file():
        raise AstraiError(f"{cfg.dpo.reference_logps}: reference log-probabilities not found; run the dpo_reference "
                          "stage")
    if cfg.init_from and not (Path(cfg.init_from) / "manifest.json").is_file():
        raise AstraiError(f"{cfg.init_from}: not a checkpoint (manifest.json missing); init_from needs a trained "
                          "model directory")
    if cfg.resume == "auto":
        with warnings.catch_warnings():  # rank 0 says which checkpoints it skips, and why
            warnings.simplefilter("ignore")
            ckpt = resumable_checkpoint(cfg)
        if ckpt is not None:
            load_train_state(ckpt / "train_state.pt", mmap=True)  # mapped: tensors are not read into memory

def train(cfg: TrainConfig, callbacks: list[Callback] | None = None) -> dict:
    """Train (resuming if cfg.resume == "auto" finds a checkpoint of this run); rank 0 writes the final checkpoint
    to cfg.out_dir. Returns the run summary (on every rank). `callbacks` replaces default_callbacks()."""
    t_start = time.time()
    d = init_distributed(cfg.backend, cfg.device, cfg.peer_timeout)
    print0 = functools.partial(print, flush=True) if d.is_main else (lambda *a, **k: None)
    callbacks = default_callbacks() if callbacks is None else callbacks
    t = build(cfg, d)
    run = RunState(max_steps=t.max_steps, is_main=d.is_main)
    checkpointer = Checkpointer(cfg, d, t.model, t.optimizer, t.scheduler, t.strategy, t.dp, callbacks, t.sharded)
    if (ckpt := checkpointer.resume(run)) is not None:
        print0(f"resuming from {ckpt} (step {run.step})")
    # metrics.jsonl + MLflow on rank 0, a no-op elsewhere; a resumed run keeps the lines up to its checkpoint.
    log = MetricLogger(cfg.logs, enabled=d.is_main,
                       resume_step=run.resumed_from)
    print0(t.describe)

    stop, speed, finite = StopFlag(), Throughput(), FiniteCheck(d.device)
    finished = run.step >= t.max_steps  # the run is complete (last step, or early stopping): the final save follows
    try:
        with sigterm_stops(stop), system_metrics(d.local_rank):
            emit(callbacks, "on_train_begin", run)
            log.log_params(cfg.used())
            emit(callbacks, "on_epoch_begin", run)
            while not finished and not run.stop:
                t0, lr, run.metrics = time.perf_counter(), t.scheduler.get_last_lr()[0], {}
                step = train_step(t, run, callbacks, cfg, finite)
                run.step += 1
                finished = run.step >= t.max_steps
                if stop_requested(stop, d) and not finished:
                    run.stop = "SIGTERM"  # finish this step, checkpoint, exit 0
                speed.add(time.perf_counter() - t0, step.tokens,
                          warm=run.step > (run.resumed_from or 0) + 1 or t.max_steps == 1)

                # Validation every eval_every steps and after the last; early stopping ends a complete run.
                if cfg.val_data and (due(run.step, cfg.eval_every) or finished):
                    finite.check()
                    finished = validate(t, run, cfg) or finished
                # Metrics every log_every steps, on the last step and on a stop; the train loss is the mean over
                # the step's units on all ranks.
                logs = due(run.step, cfg.log_every) or finished or run.stop
                if logs or due(run.step, cfg.checkpoint_every):  # where the host waits anyway: a step to report
                    finite.check()
                if logs:
                    run.train_loss = t.dp.all_reduce_sum(step.loss_sum.clone()).item() / step.units
                    run.metrics.update({"train/loss": run.train_loss, "train/lr": lr,
                                        "train/grad_norm": float(step.grad_norm),
                                        "train/tokens_per_sec": speed.window()})
                if run.metrics:
                    log.log(run.metrics, step=run.step)
                # A resumable checkpoint every checkpoint_every steps and when asked to stop.
                if not finished and (due(run.step, cfg.checkpoint_every) or run.stop):
                    if path := checkpointer.save(run):
                        print0(f"checkpoint {path}")
                emit(callbacks, "on_optimizer_step_end", run)
                if t.strategy.epoch != run.epoch:
                    emit(callbacks, "on_epoch_end", run)
                    run.epoch = t.strategy.epoch
                    emit(callbacks, "on_epoch_begin", run)
            emit(callbacks, "on_epoch_end", run)
            log.flush()  # the metrics still on their way to MLflow (metric_log.py: sent off the training step)

            if run.stop:
                print0(f"stopped at step {run.step}/{t.max_steps}: {run.stop}")
            run.summary = summarize(cfg, t, run, d, speed.overall(), time.time() - t_start)
            if finished:  # else interrupted: the resumable checkpoint is what the run leaves
                if (out := checkpointer.save_final(run, [log.path])) is not None:
                    log.log_artifact(out / "train_config.json")
                print0(f"saved {cfg.out_dir} | {run.summary['tokens_per_sec']:,.0f} tok/s | "
                           f"{run.summary['wall_seconds']:.1f} s")
            emit(callbacks, "on_train_end", run)
    except BaseException as e:
        with contextlib.suppress(Exception):  # the steps logged before the failure reach MLflow too, if it can
            log.flush()
        emit(callbacks, "on_error", run, e)
        raise
    teardown(t, d)
    return run.summary


def summarize(cfg: TrainConfig, t: Trainee, run: RunState, d: Dist, tokens_per_sec: float, seconds: float) -> dict:
    return {
        "strategy": cfg.strategy,
        "final_train_loss": run.train_loss,
        "final_val_loss": run.val_loss if cfg.val_data else None,
        "steps": run.step,
        "max_steps": t.max_steps,
        "tokens_seen": run.step * t.tokens_per_step if cfg.strategy == "seq" else None,
        "tokens_per_sec": tokens_per_sec,
        "n_params": t.n_params,
        "trainable_params": t.trainable,
        "wall_seconds": seconds,
        "world_size": d.world_size,
        "resumed_from_step": run.resumed_from,
        "stopped": run.stop,
    }


def teardown(t: Trainee, d: Dist) -> None:
    """Free the DDP wrapper (its reducer holds the process group) while the group is alive, then let every rank's
    gloo workers drain in a barrier, during which this thread does not hold the GIL: a gloo group destroyed while a
    worker still needs the GIL to free a finished operation's tensors deadlocks at exit (torch issue 56297)."""
    t.wrapped = None
    if d.world_size > 1:
        dist.barrier()
    cleanup()


def main(argv: list[str] | None = None) -> None:
    # First: what torchrun starts on each rank, with no astrai command above it when started by hand or by Slurm.
    # Rank 0's MLflow client (astrai_core/training/metric_log.py, imported there lazily) takes its retries from here.
    env.apply()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    parser.add_argument("--resume", choices=["auto", "never"], default=None,
                        help="auto: continue from the newest valid checkpoint of this run (default: the config's)")
    args = parser.parse_args(argv)
    cfg = None
    try:
        cfg = TrainConfig.model_validate_json(Path(args.config).read_text())
        if args.resume:
            cfg = cfg.model_copy(update={"resume": args.resume})
        train(cfg)
    except Exception as e:  # noqa: BLE001 - every rank's failure becomes the one line its launcher reports
        if not isinstance(e, AstraiError):
            traceback.print_exc()  # a bug: its traceback stays in the log, the line below says what failed
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        message = message if isinstance(e, AstraiError) else f"{type(e).__name__}: {message}"
        if not isinstance(e, AstraiError) and (why := disk_full(e)):  # the run's outputs, not a library's words
            message = f"{cfg.out_dir if cfg else args.config}: disk full while training ({why})"
        if (lost := lost_peers(e)) is not None:
            message = f"{lost}: {message}"
        report_error(message)
        # A failing rank leaves at once, its process group as it is: destroying a gloo group that DDP's reducer or
        # an unfinished collective still holds can hang the rank forever (torch issue 56297; in CI both ranks of a
        # non-finite step hung there and torchrun waited on them). torchrun stops the other ranks when one exits.
        sys.stdout.flush()
        os._exit(2)


if __name__ == "__main__":
    main()
