"""Tensor parallelism (Megatron-style column/row splits) and 2-D meshes, on PyTorch's DTensor engine.

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
                (train.total_grad_norm), clipping, fused AdamW and state-dict functions then treat the model as one.
                x0_scalars' 0-dim gains stay plain tensors: their gradients are whole on every rank, as they come
                from the replicated residual stream (tested in tests/test_tensor_parallel.py).

Because the activations between blocks are replicated (no sequence parallelism), the model's math is untouched:
the loss is computed on full logits exactly as on one rank. Every rank of one TP group must therefore be fed the
same batch; data parallelism happens across the "dp" mesh dimension only.

Checkpoints are either the single-rank files (full_state_dict gathers the shards, load_full_state_dict scatters a
single-rank state dict into a TP or FSDP+TP model) or, with checkpoint_format "sharded", torch.distributed.checkpoint
files that every rank writes its own shards to (save_sharded) and that load under any other layout (load_sharded).
"""

from __future__ import annotations

from typing import Any, Iterator

import contextlib
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from astrai_core.config import check_tensor_parallel
from astrai_core.model import Attention, Transformer


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


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain tensors (the single-rank checkpoint's), on every rank; rank0_only:
    on rank 0 only, in CPU memory, the other ranks get {} (what a checkpoint save needs, and no rank but the
    writer holds a full copy). Collective: every rank of the mesh must call it. On one rank (no parallelism) the
    tensors are the live weights: save or copy them."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a single-rank (full) state dict into a TP or FSDP+TP model: each rank keeps its own shards.
    Collective; every rank passes the same full state dict (a tied lm_head.weight included)."""
    # A copy of the mapping: set_model_state_dict replaces its values by this rank's shards (the caller's dict
    # would come back full of DTensors).
    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                              rank0_only: bool = False) -> dict[str, Any]:
    """The optimizer's state with full tensors, keyed by parameter name (not by position as
    optimizer.state_dict() is), so it loads into the same model under any parallelism, one rank included.
    rank0_only and the live tensors as full_state_dict. Collective."""
    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load full_optimizer_state_dict's output (from any parallelism) into this rank's optimizer, or a one-rank
    optimizer.state_dict() (keyed by position: what DDP checkpoints hold; `optimizer` must then list its
    parameters in the same order as the one that saved it, as the training loop builds it). Collective."""
    if all(isinstance(i, int) for group in state["param_groups"] for i in group["params"]):
        state = _keyed_by_name(model, optimizer, state)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _keyed_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """optimizer.state_dict()'s positions (the optimizer's parameters in group order) -> parameter names."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Write the model's and the optimizer's state as torch.distributed.checkpoint files in `path` (a directory):
    each rank writes the shards it holds (a DTensor's local part; a tensor every rank holds alike, once), so no
    rank ever holds the full state. The optimizer state is keyed by parameter name. Collective; on one process
    without a process group it writes one rank's files."""
    model_state, optim_state = get_state_dict(model, optimizer)
    with _one_process_is_fine():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Load save_sharded's files into this rank's model and optimizer, whatever the parallelism and number of
    ranks that wrote them: each rank reads the part of every tensor it holds now (DCP reshards by the tensors'
    global shapes and offsets). Collective."""
    model_state, optim_state = get_state_dict(model, optimizer)  # this rank's layout: what to read, and where
    state = {"model": model_state, "optimizer": optim_state}
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@contextlib.contextmanager
def _one_process_is_fine() -> Iterator[None]:
    """DCP warns at every save and load without a process group (a one-rank run), where that is expected."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
