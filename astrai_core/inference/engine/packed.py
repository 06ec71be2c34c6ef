"""A served model's bf16 projections with their weights prepacked for oneDNN, once, instead of at every call.

`F.linear` on bf16 CPU tensors hands oneDNN a plain (out, in) weight, which it reorders into its blocked layout (the
AMX or AVX-512 BF16 kernels') inside every call; a decode step's few rows make that reorder a large share of each
projection. PackedLinear keeps the reordered copy and calls oneDNN's linear on it (what inductor's `freezing` does,
which torch 2.13 cannot combine with the engine's saved graphs). The same kernels run: the outputs are bit-identical
to `F.linear`'s (tests/test_engine.py). Measured on SmolLM2-135M's shapes, one thread: docs/serving.md.

Only for weights that no longer change (the serving engine's, EngineConfig.pack_weights): the packed copy is not
updated when the weight is. The copy doubles the projections' memory (the plain weight stays: the embedding shares
the head's, and checkpoints read it).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn

# each PackedLinear's packed weight by the data pointer of the weight it was packed from: the op below receives the
# plain weight (a graph input that torch.compile traces), and finds its packed copy here. Weak: an entry goes with
# its layer.
_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


@torch.library.custom_op("astrai::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ weight.T + bias through weight's packed copy (one PackedLinear made it)."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[weight.data_ptr()], bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(nn.Linear):
    """An nn.Linear (the same weight and bias tensors, the same names) whose forward uses a packed copy."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        # packed for 1 row (a batch-size hint to oneDNN), the decode steps' fewest; any number of rows runs on it
        self.packed = torch.ops.mkldnn._reorder_linear_weight(base.weight.detach(), 1)
        _PACKED[base.weight.data_ptr()] = self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


def can_pack(model: nn.Module) -> bool:
    """Whether this model's projections can be packed: bf16 weights on a CPU whose oneDNN has bf16 kernels."""
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module) -> int:
    """Replace every plain nn.Linear of `model` by a PackedLinear (a LoRA layer stays as it is); -> how many."""
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        model.set_submodule(name, PackedLinear(model.get_submodule(name)))
    return len(names)
