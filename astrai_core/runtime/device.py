"""Where this process computes: its place in the job (Dist: rank, local rank, world size, device), the data-parallel
group whose ranks see different batches (DataGroup), and the device helpers every part asks (which device a setting
names, where a model's weights are, whether bf16 is native there). Setting the job up is training/distributed.py's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from astrai_core.runtime.errors import AstraiError


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class DataGroup:
    """The ranks that see different batches, and this rank's place among them: every rank under ddp and fsdp;
    under tp and fsdp+tp one per TP group (the mesh's "dp" dimension), since the ranks of a TP group compute one
    model on the same batch. Sums of data counts and losses run over these ranks, so TP copies never count twice."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None: every rank

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x


def resolve_device(name: str = "auto") -> torch.device:
    """The device a setting names: "auto" is the GPU when torch sees one, else the CPU; "cuda" without one is
    refused naming the setting's values (every stage, `astrai generate` and `astrai serve` ask here)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda") or (name == "cuda" and not torch.cuda.is_available()):
        raise AstraiError(f"device {name}: expected auto, cpu or cuda (and cuda needs a GPU build of torch and a GPU)")
    return torch.device(name)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model`'s weights are (the CPU for a model without any): what scoring and generation compute on."""
    return next(model.parameters(), torch.empty(0)).device


def bf16_native(device: torch.device) -> bool:
    """Whether `device` computes bf16 matmuls natively: a GPU that supports bf16, a CPU with AVX-512 BF16 or AMX.
    Elsewhere autocast emulates bf16 (measured on an AVX2-only EPYC: a 2048x256x768 matmul with its backward
    0.90 s in bf16 vs 0.18 s in fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def uses_bf16(dtype: str, device: torch.device) -> bool:
    """Whether a TrainConfig.dtype (fp32, bf16, or auto: bf16 where native) runs the forward in bf16 autocast."""
    return dtype == "bf16" or (dtype == "auto" and bf16_native(device))


# `astrai serve` and `astrai generate` --dtype auto: a model's weights in bf16 where bf16 is native and the model is
# big enough for its decode steps to wait on weights (reading them, multiplying them), not on per-operator dispatch.
# Measured on the AVX-512 BF16 kind (`python bench/weights_dtype.py --model SMOLLM2`, bench/weights_dtype_report.json:
# the engine alone, 1 thread, medians of 3 interleaved rounds, bf16's speed over fp32 at 1 / 4 / 16 / 64 rows): the
# demo's 0.66M parameters 0.55 / 0.74 / 0.82 / 0.83 (slower), 5.3M 1.37-1.58, 29.9M 1.11-2.25, SmolLM2's 134.5M
# 1.33-2.15. Below it, and wherever bf16 is emulated (~5x slower), the weights stay fp32.
BF16_FROM_PARAMETERS = 2_000_000
INFERENCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_dtype_choice(choice: str) -> None:
    """ValueError naming --dtype unless `choice` is auto, fp32 or bf16 (asked before a model loads)."""
    if choice != "auto" and choice not in INFERENCE_DTYPES:
        raise ValueError(f"--dtype {choice}: expected auto, fp32 or bf16")


def inference_dtype(choice: str, device: torch.device, parameters: int,
                    batch_invariant: bool = False) -> tuple[torch.dtype, str]:
    """(the dtype a model of `parameters` weights generates in on `device`, why) for --dtype `choice`: fp32, bf16,
    or auto (bf16 where native from BF16_FROM_PARAMETERS parameters, else fp32; fp32 for an engine that is
    `batch_invariant`, whose bit-identity needs it: engine/runner.py Runner). ValueError for anything else."""
    check_dtype_choice(choice)
    if batch_invariant:
        if choice == "bf16":
            raise ValueError("--dtype bf16 and --batch-invariant cannot be combined: batch invariance needs fp32 weights")
        return torch.float32, "--batch-invariant needs fp32"
    if choice in INFERENCE_DTYPES:
        return INFERENCE_DTYPES[choice], "--dtype"
    if not bf16_native(device):
        return torch.float32, f"auto: bf16 is not native on this {device.type}"
    if parameters < BF16_FROM_PARAMETERS:
        return torch.float32, f"auto: {parameters / 1e6:.2f}M parameters, bf16 pays from {BF16_FROM_PARAMETERS // 10**6}M"
    return torch.bfloat16, f"auto: bf16 is native here and the model has {parameters / 1e6:.1f}M parameters"
