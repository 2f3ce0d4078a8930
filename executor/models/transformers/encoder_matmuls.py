"""An encoder's matmuls on CPU through oneDNN, bias and GELU inside the GEMM.

transformers' BERT-family layers (BERT, RoBERTa, XLM-R, ModernBERT) run nn.Linear and then
the activation as separate passes: torch's addmm first copies the bias into the output, then
multiplies, and GELU reads and writes the 4x-wide intermediate once more. On a MiniLM those
two extra passes over memory are a sixth of the forward. Here each of the layers' nn.Linear
becomes a PackedLinear: its weight reordered once into oneDNN's blocked layout, the bias
(and, for the intermediate matmul followed by exact GELU, the activation) applied by the GEMM
as it writes each tile. The weight is the same fp32 values (no copy is kept beside it), and
the products are the same sums in oneDNN's order (within 1e-5 of torch's).

Only where nothing else wraps or cuts the matmuls (executor/host/model_weights.py decides): fp32 on CPU,
no quantization, one rank, no LoRA, not --deterministic (whose tiles are torch's matmuls).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def onednn_available() -> bool:
    """torch built with oneDNN and its fused linear op (a CPU build's; inductor uses it)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """y = act(x W^T + b) in one oneDNN call; `gelu`: exact (erf) GELU after the bias."""

    def __init__(self, linear: nn.Linear, gelu: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.register_buffer("packed_weight", weight, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)
        self.gelu = gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ("none": erf GELU; oneDNN's "tanh" would be the approximation.)
        op, algorithm = ("gelu", "none") if self.gelu else ("none", "")
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, op, [], algorithm
        )

    def extra_repr(self) -> str:
        act = ", gelu" if self.gelu else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{act}"


def pack_encoder_matmuls_(layers: nn.Module) -> int:
    """Every nn.Linear under `layers` (an encoder's layer stack) becomes a PackedLinear; one
    whose module then applies exact GELU (BERT's `intermediate_act_fn`) takes it into the
    GEMM. Returns the count. A float32 CPU model only (the caller checks)."""
    from transformers.activations import GELUActivation

    packed = 0
    for module in list(layers.modules()):
        act = getattr(module, "intermediate_act_fn", None)
        dense = getattr(module, "dense", None)
        exact_gelu = type(act) is GELUActivation and act.act is nn.functional.gelu
        if exact_gelu and type(dense) is nn.Linear:
            module.dense = PackedLinear(dense, gelu=True)
            module.intermediate_act_fn = nn.Identity()
            packed += 1
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child))
                packed += 1
    return packed
