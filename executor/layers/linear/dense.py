"""Dense matmul modules: `empty_linear` (the nn.Linear every model of ours builds, its weights
left for the load to fill), and fp32 matmuls at decode-sized calls through
csrc/cpu/dense_rows.h (DenseRowsLinear).

An fp32 checkpoint on CPU (`--quantization none`, the default for an fp32 directory) keeps
nn.Linear modules; torch's sgemm (MKL) takes 2-3x its one-row time at 4-8 rows, the rows of a
c=8 decode step, where the matrices' bytes alone should set the time. DenseRowsLinear is an
nn.Linear (the same weight Parameter, so LoRA, tensor-parallel cuts, sleep mode and the
weight loaders see no difference) whose calls of at most DENSE_MAX_ROWS rows take
cpu_kernels.dense_linear: the AVX-512 or AVX2 kernel (the same bits).
The fused decode stack (executor/graphs/fused_decode.py) calls the same function, so both
paths give a step the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.kernels import cpu as cpu_kernels

DENSE_MAX_ROWS = 8  # csrc/cpu/dense_rows.h serves 1-8 rows


def empty_linear(
    in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False
) -> nn.Linear:
    """A Linear with uninitialised weights: load_weights overwrites them anyway. Made on the
    meta device and given plain empty tensors (untouched pages), not through `skip_init`,
    whose `to_empty` runs torch's reference ops and imports torch.fx's symbolic shapes: half
    a second of a CPU engine's start-up."""
    linear = nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)
    linear.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
    if bias:
        linear.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))
    return linear


def dense_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear for fp32 on CPU: calls of at most DENSE_MAX_ROWS rows through
    csrc/cpu/dense_rows.h, larger ones torch's."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > DENSE_MAX_ROWS:
        return F.linear(x, weight, bias)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    y = cpu_kernels.dense_linear(flat, weight, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


class DenseRowsLinear(nn.Linear):
    """nn.Linear whose decode-sized calls take csrc/cpu/dense_rows.h (set by use_dense_rows_)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_rows_linear(x, self.weight, self.bias)


# The plain fp32 matmul modules (not subclasses with their own arithmetic): what the fused
# decode stack reads as a dense weight and --deterministic tiles.
DENSE_LINEAR_TYPES = (nn.Linear, DenseRowsLinear)


def use_dense_rows_(model: nn.Module) -> int:
    """Make every plain fp32 nn.Linear of the model a DenseRowsLinear, in place (the module
    object, its Parameters and hooks stay); returns how many. Only where the kernels run
    (without them, torch's matmul serves every size and nothing changes). Raises
    CpuKernelError where they cannot (no AVX2, no compiler)."""
    if not cpu_kernels.enabled():
        return 0
    cpu_kernels.load()  # (a CPU the kernels cannot serve raises here, not at the first call)
    swapped = 0
    if hasattr(model, "dense_logits"):  # a DecoderStack's logits over its fp32 embedding
        model.dense_logits = True
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is nn.Linear and weight is not None and weight.dtype == torch.float32:
            if weight.is_contiguous() and weight.device.type == "cpu":
                module.__class__ = DenseRowsLinear
                swapped += 1
    return swapped
