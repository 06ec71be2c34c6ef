"""What a run trains, laid out across ranks for its parallel mode: build() makes it, once per run.

    t = build(cfg, d)    # the strategy (data), the model (init_from, LoRA), its layout, the optimizer and schedule

The layouts (TrainConfig.parallel): ddp, every rank a replica and DDP averaging the gradients; fsdp, FSDP2 sharding
the weights, gradients and optimizer state per block; tp, tensor parallelism inside groups of tp_size ranks; fsdp+tp,
both. Optionally activation checkpointing (checkpoint_blocks) and torch.compile (wrap). The training step depends on
the layout in two places only: gradient sync across an accumulation window (grad_sync) and the gradient norm
(total_grad_norm).

Tensor parallelism: Megatron-style column/row splits and a 2-D mesh, on PyTorch's DTensor engine.

    mesh = build_mesh(world_size=4, tp_size=2, device_type="cpu")    # ("dp", "tp") = (2, 2)
    apply_tensor_parallel(model, mesh["tp"])                         # first: shards the weights across a TP group
    apply_fsdp(model, mesh["dp"])                                     # then (fsdp+tp): shards those across the dp dim

The plan, per decoder block (each TP rank holds 1/tp of the heads and of the MLP's hidden width):

    self_attn   input x made a replicated DTensor once (so backward all-reduces its gradient once, not once per
                projection); q/k/v (and the attention gate) column-parallel: each rank computes its own heads, and
                the per-rank head counts the attention's view() uses are set to n_heads / tp and n_kv_heads / tp;
                o_proj row-parallel: the partial outputs are summed by one all-reduce. QK-norm's weights (one
                head_dim vector shared by the heads) are replicated, applied to this rank's heads.
    mlp         gate/up column-parallel (relu2: up only), down row-parallel: one all-reduce forward, one backward.
    the rest    (embed_tokens, lm_head, every RMSNorm) replicated: each TP rank holds all of it and computes the
                same numbers. The default model ties lm_head to embed_tokens and has a small vocabulary (2048):
                sharding the vocabulary would split that one tensor two ways (rows of the embedding, columns of the
                logits) and need a vocabulary-parallel loss, for little memory. The replicated weights are still
                DTensors (Replicate), so that every parameter lives on the same mesh: torch's gradient-norm
                (total_grad_norm), clipping, fused AdamW and state-dict functions then treat the model as one.
                x0_scalars' 0-dim gains stay plain tensors: their gradients are whole on every rank, as they come
                from the replicated residual stream (tested in tests/test_tensor_parallel.py).

Because the activations between blocks are replicated (no sequence parallelism), the model's math is untouched:
the loss is computed on full logits exactly as on one rank. Every rank of one TP group must therefore be fed the
same batch; data parallelism happens across the "dp" mesh dimension only.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from astrai_core.checkpoint.checkpointer import load_initial_weights
from astrai_core.model.config import check_tensor_parallel
from astrai_core.model.lora import apply_lora, count_trainable
from astrai_core.model.transformer import Attention, Transformer
from astrai_core.runtime.device import DataGroup, Dist, uses_bf16
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import sha256_file
from astrai_core.training.config import TrainConfig, check_ranks
from astrai_core.training.optim import Chain, build_optimizer
from astrai_core.training.strategies import STRATEGIES, Strategy


@dataclass
class Trainee:
    """Everything the loop trains with: the bare model (`wrapped` is what forward calls: DDP and compile wrap it;
    FSDP and TP split it in place), its optimizer and schedule, the strategy (data and loss) and the data group."""

    model: Transformer
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer | Chain  # Chain: Muon and AdamW together (optim.name muon)
    scheduler: torch.optim.lr_scheduler.LRScheduler | Chain
    strategy: Strategy
    dp: DataGroup  # the data-parallel ranks (under TP: one per TP group)
    device: torch.device
    autocast: contextlib.AbstractContextManager  # every forward runs in it (weights and optimizer stay fp32)
    max_steps: int
    tokens_per_step: int
    sharded: bool  # FSDP or TP: the weights are DTensors
    n_params: int
    trainable: int
    describe: str  # one line: what trains where


def build(cfg: TrainConfig, d: Dist) -> Trainee:
    """Data, model, parallel layout and optimizer of a fresh run (a checkpoint is then loaded into them)."""
    bf16 = uses_bf16(cfg.dtype, d.device)
    autocast = torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=bf16)
    # Tensor parallelism: a ("dp", "tp") mesh; the ranks of one TP group share their batches, so the data is split
    # over the dp dimension only (without TP every rank is a data-parallel rank).
    mesh, dp = None, DataGroup(d.rank, d.world_size)
    if cfg.parallel in ("tp", "fsdp+tp"):
        try:
            check_ranks(cfg.parallel, cfg.tp_size, d.world_size)
        except ValueError as e:
            raise AstraiError(str(e)) from None
        mesh = build_mesh(d.world_size, cfg.tp_size, d.device.type)
        dp = DataGroup(mesh["dp"].get_local_rank(), mesh["dp"].size(), mesh["dp"].get_group())

    # Data (the strategy's): refuse files packed with another tokenizer or ids the model cannot embed.
    tok_sha = sha256_file(cfg.tokenizer)
    strategy = STRATEGIES[cfg.strategy](cfg, dp.rank, dp.size, d.device, tok_sha, autocast)
    per_step = dp.size * cfg.grad_accum * cfg.batch_size  # samples in one optimizer step
    max_steps = math.ceil(cfg.max_tokens / (per_step * cfg.seq_len)) if cfg.max_tokens else cfg.max_steps

    # Model: the same seed gives every rank the same initial weights (DDP also broadcasts rank 0's at wrap time).
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model).to(d.device)
    if cfg.init_from:
        load_initial_weights(model, cfg, tok_sha)
    strategy.setup(model)  # e.g. GRPO freezes its reference here
    if cfg.lora is not None:
        if cfg.parallel == "fsdp" and d.world_size > 1:
            raise AstraiError("lora with parallel 'fsdp' is not supported: use ddp (adapters are small)")
        apply_lora(model, cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout)
    n_params = model.num_params()
    if mesh is not None:  # every rank holds the same weights here (seed or init_from): each keeps its shards
        apply_tensor_parallel(model, mesh["tp"])
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)
    wrapped = wrap(model, cfg, d, mesh)
    if cfg.compile:  # the loss too: inductor fuses cross-entropy's pass over the logits (losses.token_loss_sum)
        strategy.loss = torch.compile(strategy.loss)
    trainable, _ = count_trainable(model)  # after wrap: FSDP's shards
    optimizer, scheduler = build_optimizer(model, cfg.optim, d.device, max_steps)
    layout = f"{cfg.parallel}, {dp.size} x tp {cfg.tp_size}" if mesh is not None else cfg.parallel
    describe = (f"{cfg.strategy}: training {trainable:,} of {n_params:,} parameters on {d.world_size} rank(s) "
                f"({d.device}, {'bf16' if bf16 else 'fp32'}, {layout}), {max_steps} steps of {per_step} samples")
    return Trainee(model, wrapped, optimizer, scheduler, strategy, dp, d.device, autocast, max_steps, per_step * cfg.seq_len,
                   sharded=mesh is not None or (cfg.parallel == "fsdp" and d.world_size > 1), n_params=n_params,
                   trainable=trainable, describe=describe)


def checkpoint_blocks(model: Transformer) -> None:
    """Activation checkpointing: each decoder block keeps only its input and recomputes the rest in backward
    (non-reentrant, so it composes with DDP, FSDP and torch.compile)."""
    for block in model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def compile_cache_dir(base: str) -> Path:
    """Where torch.compile keeps this machine's kernels: a folder of `base` per CPU instruction set. Inductor's
    cache does not tell code generated for AVX-512 from AVX2 code, and on a cluster `base` is shared by nodes
    that may differ (torch held to AVX2 with a cache of AVX-512 code computed wrong tokens: docs/measured.md)."""
    return Path(base).resolve() / torch.backends.cpu.get_cpu_capability().lower()


def wrap(raw_model: Transformer, cfg: TrainConfig, d: Dist, mesh: DeviceMesh | None) -> nn.Module:
    """What forward calls: the bare model compiled and/or wrapped for DDP, or sharded in place by FSDP2 (over the
    mesh's dp dimension with fsdp+tp; the TP split is already done). DDP cannot wrap TP's DTensor weights, and
    needs not: pure tp has no data parallelism."""
    if cfg.compile and cfg.compile_cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir(cfg.compile_cache_dir))  # kernels persist
    if mesh is not None:
        if cfg.parallel == "fsdp+tp":
            apply_fsdp(raw_model, mesh["dp"])
        return torch.compile(raw_model) if cfg.compile else raw_model
    if cfg.parallel == "fsdp" and d.world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for block in raw_model.layers:  # one all-gather per block, the embedding and head with the root
            fully_shard(block)
        fully_shard(raw_model)
        return torch.compile(raw_model) if cfg.compile else raw_model
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if d.world_size > 1:
        # A routed expert that got no tokens on this rank has no gradient: DDP must be told to expect that.
        model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None,
                    find_unused_parameters=bool(getattr(cfg.model, "n_experts", 0)))
    return model


def build_mesh(world_size: int, tp_size: int, device_type: str) -> DeviceMesh:
    """The ("dp", "tp") mesh: world_size / tp_size data-parallel groups of tp_size tensor-parallel ranks each.
    Ranks of one TP group are consecutive (rank = dp_index * tp_size + tp_index), so on GPUs a TP group stays
    inside one node, where its per-layer all-reduces are cheap. dp is 1 for pure TP."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tp_size ({tp_size}) must divide the number of ranks ({world_size})")
    return init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


class _Replicated(ParallelStyle):
    """Every parameter of the module a Replicate DTensor; tensor inputs enter as replicated DTensors and the output
    leaves as a plain tensor, so the modules around it see what they saw before."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def enter(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def leave(_module: nn.Module, output: torch.Tensor, _mesh: DeviceMesh) -> torch.Tensor:
            return output.to_local() if isinstance(output, DTensor) else output

        # No partition_fn: distribute_module replicates every parameter.
        return distribute_module(module, device_mesh, input_fn=enter, output_fn=leave)


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> Transformer:
    """Split `model` in place across the ranks of tp_mesh (a 1-D mesh) as the module docstring describes.
    Every rank must hold the same weights before (the same seed, or the same checkpoint loaded). Apply before
    FSDP, activation checkpointing and torch.compile. ValueError if the model cannot be split (see
    check_tensor_parallel)."""
    assert not isinstance(model.embed_tokens.weight, DTensor), "the model is already parallelized"
    tp = tp_mesh.size()
    check_tensor_parallel(model.cfg, tp, lora=any(".lora_" in name for name, _ in model.named_parameters()))
    replicated = _Replicated()
    for block in model.layers:
        attn: Attention = block.self_attn
        # Attention(x, cos, sin, cache, layer, mask), called positionally by Block: only x is made a DTensor.
        plan: dict[str, ParallelStyle] = {
            "self_attn": PrepareModuleInput(input_layouts=(Replicate(), None, None, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None, None, None)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
            "input_layernorm": replicated,
            "post_attention_layernorm": replicated,
        }
        if block.mlp.gate_proj is not None:  # SwiGLU (relu2 has no gate)
            plan["mlp.gate_proj"] = ColwiseParallel()
        if attn.gate_proj is not None:  # the gate multiplies the attention output channel by channel: split alike
            plan["self_attn.gate_proj"] = ColwiseParallel()
        if attn.q_norm is not None:
            # One RMSNorm weight of head_dim shared by all heads, applied to (B, T, heads, head_dim) with this
            # rank's heads only: the input is sharded on dim 2, so the weight's gradient (a sum over heads) is
            # partial per rank and summed across the group, which a replicated input would get wrong.
            plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        # The column-parallel projections now return this rank's heads only: the view()s must expect that many.
        attn.n_heads //= tp
        attn.n_kv_heads //= tp
    parallelize_module(model, tp_mesh, {"embed_tokens": replicated, "norm": replicated, "lm_head": replicated})
    if model.cfg.tie_embeddings:  # each module got its own DTensor copy above: share one again
        model.lm_head.weight = model.embed_tokens.weight
    return model


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh) -> Transformer:
    """FSDP2 over the data-parallel mesh dimension, after apply_tensor_parallel (torch's documented order): each
    block is one all-gather, the embedding, final norm and head go with the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def grad_sync(model: nn.Module, raw_model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Context for one backward: gradient reduction across ranks on (last micro-step) or off (the earlier ones)."""
    if isinstance(model, DDP) and not enabled:
        return model.no_sync()
    if hasattr(raw_model, "set_requires_gradient_sync"):  # FSDP2 (the root module, sharded in place)
        raw_model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def total_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor over the shards
