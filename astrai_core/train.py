"""The training loop: next-token prediction on packed tokens, DDP across ranks, one checkpoint at the end.

Run it alone (cfg.json is a TrainConfig as JSON):

    python -m astrai_core.train --config cfg.json                                        # one process
    torchrun --standalone --nproc_per_node=2 -m astrai_core.train --config cfg.json      # 2 ranks, one machine
    torchrun --nnodes=2 --node_rank=0 --rdzv_endpoint=HOST:29500 --nproc_per_node=8 \\
        -m astrai_core.train --config cfg.json                                           # on each of 2 nodes

Batches are drawn from random windows of the token stream, seeded by (seed, step, micro-step) only: rank r
takes slice r of one global draw, so the run does not depend on how the global batch is split across ranks
(2 ranks x batch B trains exactly like 1 rank x batch 2B), and resuming needs only the step number.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from astrai_core.checkpoint import save_checkpoint
from astrai_core.config import OptimConfig, TrainConfig
from astrai_core.data import PackedTokens
from astrai_core.distributed import cleanup, init_distributed
from astrai_core.errors import AstraiError
from astrai_core.io import sha256_file
from astrai_core.model import Transformer, cross_entropy_loss
from astrai_core.tracking import MetricLogger

IN_MEMORY_TOKENS = 1 << 28  # below this (512 MB as uint16) read the token file into RAM once: no disk reads per batch
VAL_SEED_OFFSET = 10**9  # validation batches are seeded (seed, 10**9, i): never equal to a training step's seed


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to optim.lr at warmup_steps, then cosine
    decay to optim.min_lr at max_steps (nanoGPT's schedule)."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / (optim.warmup_steps + 1)
    if step >= max_steps:
        return optim.min_lr
    progress = (step - optim.warmup_steps) / (max_steps - optim.warmup_steps)  # 0 -> 1
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def open_tokens(path: str, tokenizer_sha256: str, vocab_size: int, seq_len: int):
    """The token ids of a packed file, checked against the tokenizer and the model: a numpy array if small,
    else the on-disk h5py dataset (both slice the same way)."""
    data = PackedTokens(path, expected_tokenizer_sha256=tokenizer_sha256)
    if data.vocab_size > vocab_size:
        raise AstraiError(f"{path}: token vocabulary {data.vocab_size} exceeds model.vocab_size {vocab_size}")
    if data.n_tokens < seq_len + 1:
        raise AstraiError(f"{path}: {data.n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return data.tokens[:] if data.n_tokens < IN_MEMORY_TOKENS else data.tokens


def get_batch(tokens, seed: list[int], seq_len: int, batch_size: int, rank: int, world_size: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a global batch of world_size * batch_size random windows: (x, y), each (B, seq_len)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=world_size * batch_size, endpoint=True)
    mine = starts[rank * batch_size : (rank + 1) * batch_size]
    windows = torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in mine]).astype(np.int64))
    if device.type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def all_reduce_mean(x: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)  # gloo has no AVG
        x = x / world_size
    return x


def train(cfg: TrainConfig) -> dict:
    """Train, write the checkpoint to cfg.out_dir (rank 0), return the run summary (on every rank)."""
    t_start = time.time()
    d = init_distributed(cfg.backend, cfg.device)
    log = MetricLogger(Path(cfg.out_dir).with_name(Path(cfg.out_dir).name + ".logs"), enabled=d.is_main)
    print0 = print if d.is_main else (lambda *a, **k: None)
    log.log_params(cfg.model_dump())

    # Data: refuse tokens packed with another tokenizer or ids the model cannot embed.
    tok_sha = sha256_file(cfg.tokenizer)
    train_tokens = open_tokens(cfg.train_data, tok_sha, cfg.model.vocab_size, cfg.seq_len)
    val_tokens = open_tokens(cfg.val_data, tok_sha, cfg.model.vocab_size, cfg.seq_len) if cfg.val_data else None

    # Model: the same seed gives every rank the same initial weights (DDP also broadcasts rank 0's at wrap time).
    torch.manual_seed(cfg.seed)
    raw_model = Transformer(cfg.model).to(d.device)
    n_params = raw_model.num_params()
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if d.world_size > 1:
        model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    autocast = torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")

    # Optimizer: weight decay on matrices (and the embedding) only, not on norm gains.
    params = list(raw_model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  fused=d.device.type == "cuda")
    # LambdaLR scales optim.lr by the factor; it counts optimizer steps from 0, as lr_at does.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg.optim, cfg.max_steps) / cfg.optim.lr
    )

    @torch.no_grad()
    def evaluate() -> float:
        """Mean loss over cfg.eval_batches fixed validation batches, averaged over ranks."""
        model.eval()
        losses = []
        for i in range(cfg.eval_batches):
            x, y = get_batch(val_tokens, [cfg.seed, VAL_SEED_OFFSET, i], cfg.seq_len, cfg.batch_size,
                             d.rank, d.world_size, d.device)
            with autocast:
                losses.append(cross_entropy_loss(model(x), y))
        model.train()
        return all_reduce_mean(torch.stack(losses).mean(), d.world_size).item()

    tokens_per_step = d.world_size * cfg.batch_size * cfg.grad_accum * cfg.seq_len
    print0(f"training {n_params:,} parameters on {d.world_size} rank(s) ({d.device}, {cfg.dtype}), "
           f"{cfg.max_steps} steps of {tokens_per_step:,} tokens", flush=True)
    train_loss = val_loss = float("nan")
    timed_seconds, timed_tokens = 0.0, 0  # throughput excludes step 0 (compilation, allocator warm-up) and eval
    interval_seconds, interval_tokens = 0.0, 0
    bar = tqdm(total=cfg.max_steps, disable=not (d.is_main and sys.stderr.isatty()), dynamic_ncols=True)
    for step in range(cfg.max_steps):
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        loss_sum = torch.zeros((), device=d.device)
        for micro in range(cfg.grad_accum):
            x, y = get_batch(train_tokens, [cfg.seed, step, micro], cfg.seq_len, cfg.batch_size,
                             d.rank, d.world_size, d.device)
            # Gradients are all-reduced only on the last micro-step; the earlier ones just accumulate locally.
            last = micro == cfg.grad_accum - 1
            sync = contextlib.nullcontext() if last or d.world_size == 1 else model.no_sync()
            with sync:
                with autocast:
                    loss = cross_entropy_loss(model(x), y) / cfg.grad_accum
                loss.backward()
            loss_sum += loss.detach()
        if cfg.optim.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        # Stop before the update can spread NaNs into the weights. The norm is taken after the all-reduce, so it is
        # the same on every rank (and a non-finite loss on one rank makes it non-finite everywhere).
        if not math.isfinite(grad_norm.item()) or not math.isfinite(loss_sum.item()):
            raise RuntimeError(f"step {step + 1}: non-finite loss ({loss_sum.item()}) or gradient norm "
                               f"({grad_norm.item()}); lower optim.lr, raise optim.warmup_steps or use fp32")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if step > 0 or cfg.max_steps == 1:
            timed_seconds, timed_tokens = timed_seconds + dt, timed_tokens + tokens_per_step
        interval_seconds, interval_tokens = interval_seconds + dt, interval_tokens + tokens_per_step
        bar.update(1)

        done = step + 1
        last_step = done == cfg.max_steps
        metrics = {}
        if done % cfg.log_every == 0 or last_step:
            train_loss = all_reduce_mean(loss_sum, d.world_size).item()
            metrics = {"train/loss": train_loss, "train/lr": lr, "train/grad_norm": grad_norm.item(),
                       "train/tokens_per_sec": interval_tokens / interval_seconds}
            interval_seconds, interval_tokens = 0.0, 0
        if val_tokens is not None and ((cfg.eval_every > 0 and done % cfg.eval_every == 0) or last_step):
            val_loss = evaluate()
            metrics["val/loss"] = val_loss
        if metrics:
            log.log(metrics, step=done)
            msg = " | ".join([f"step {done}/{cfg.max_steps}"] + [
                f"{k} {v:,.0f}" if k.endswith("per_sec") else f"{k} {v:.4g}" for k, v in metrics.items()])
            bar.write(msg) if not bar.disable else print0(msg, flush=True)
    bar.close()

    summary = {
        "final_train_loss": train_loss,
        "final_val_loss": val_loss if val_tokens is not None else None,
        "steps": cfg.max_steps,
        "tokens_seen": cfg.max_steps * tokens_per_step,
        "tokens_per_sec": timed_tokens / timed_seconds if timed_seconds else float("nan"),
        "n_params": n_params,
        "wall_seconds": time.time() - t_start,
        "world_size": d.world_size,
    }
    if d.is_main:
        # Replicas are identical, so rank 0's weights and optimizer state are the model's. The batch sampler is
        # stateless (seeded by step), so `step` is its whole position.
        train_state = {"step": cfg.max_steps, "tokens_seen": summary["tokens_seen"],
                       "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                       "torch_rng": torch.get_rng_state()}
        save_checkpoint(cfg.out_dir, raw_model, cfg.model, cfg.tokenizer, extra=summary, train_config=cfg,
                        train_state=train_state, files=[log.path])
        log.log_artifact(Path(cfg.out_dir) / "train_config.json")
        print0(f"saved {cfg.out_dir} | {summary['tokens_per_sec']:,.0f} tok/s | {summary['wall_seconds']:.1f} s",
               flush=True)
    cleanup()
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig.model_validate_json(Path(args.config).read_text())
        train(cfg)
    except AstraiError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
