"""Weight quantization for CPU serving (`--quantization int8`), opt-in.

int8 weights, one scale per output channel, with activations quantized per call (dynamic
quantization): the matmul itself runs as int8 x int8 -> int32 in fbgemm, which on AVX2 CPUs
does several times the work per cycle of an fp32 FMA and reads a quarter of the bytes.
`reduce_range` keeps activations to 7 bits, as fbgemm needs on CPUs without VNNI so the
int16 pair sums of VPMADDUBSW cannot saturate.

fp32 stays the reference and the default: BENCHMARKS.md reports the greedy parity rate and
logprob drift of int8 against fp32.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_METHODS = ("int8",)


class Int8DynamicLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        out_features = w.shape[0]
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10).double()
        qweight = torch.quantize_per_channel(
            w, scales, torch.zeros(out_features, dtype=torch.long), 0, torch.qint8
        )
        b = None if bias is None else bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(qweight, b)
        self.in_features = w.shape[1]
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_model_(model: nn.Module, method: str) -> None:
    """Swap the decoder's qkv, output and gate/up matmuls for int8, in place.

    The down projection and the logits stay fp32: measured on SmolLM2 (BENCHMARKS.md), their
    inputs carry the outliers that per-tensor activation scales cannot hold, and quantizing
    them triples the logprob drift.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {QUANTIZATION_METHODS}")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _int8(attn.qkv_proj)
        attn.o_proj = _int8(attn.o_proj)
        mlp.gate_up_proj = _int8(mlp.gate_up_proj)


def _int8(linear: nn.Linear) -> Int8DynamicLinear:
    return Int8DynamicLinear(linear.weight, linear.bias)
