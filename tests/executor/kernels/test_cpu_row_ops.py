"""The CPU row-wise ops (csrc/cpu/row_ops.h through executor/kernels/cpu_layer_ops.py) against torch's
formulas: the modules and the fused decode step both run them, so tests that compare those
two paths cannot see a mistake here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cpu_layer_ops
from zllm.executor.layers.rope import apply_rope

pytestmark = pytest.mark.skipif(
    not cpu_kernels.cpu_supports_kernels(), reason="the CPU kernels need AVX2/FMA/F16C"
)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("width", [1, 13, 64, 1536])  # vector body, scalar tail, both
def test_gated_activations_match_torch(activation, width) -> None:
    gen = torch.Generator().manual_seed(width)
    gate_up = torch.randn(5, 2 * width, generator=gen) * 4
    # Extremes: exp's clamp, tanh's saturation, and non-finite values passing through.
    extremes = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 100.0, -100.0, 1e4, -1e4])
    gate_up[0, : min(width, extremes.numel())] = extremes[:width]
    out = cpu_layer_ops.gated_act(gate_up, activation)
    # Against float64: torch's fp32 GELU loses its small negative outputs to 1 + tanh's
    # cancellation (gelu(-5) comes out 0), which the sigmoid form keeps.
    gate, up = gate_up.double().split(width, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(out.double(), act * up, rtol=2e-6, atol=1e-6)
    # A NaN gate stays NaN (the vector path and the scalar tail alike), never a number.
    poisoned = gate_up.clone()
    poisoned[:, 0] = poisoned[:, width - 1] = float("nan")
    got = cpu_layer_ops.gated_act(poisoned, activation)
    assert torch.isnan(got[:, 0]).all() and torch.isnan(got[:, width - 1]).all()


def test_a_strided_gate_up_is_read_as_it_lies() -> None:
    wide = torch.randn(4, 40)
    gate_up = wide[:, :32]  # rows 40 floats apart
    out = cpu_layer_ops.gated_act(gate_up, "silu")
    gate, up = gate_up.double().split(16, dim=-1)
    torch.testing.assert_close(out.double(), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rotary_half", [8, 4])  # whole head_dim 16, a partial rotary factor
def test_rope_in_place_is_apply_rope_bit_for_bit(rotary_half) -> None:
    """On a strided view of the fused qkv output, as the attention layers pass it."""
    gen = torch.Generator().manual_seed(0)
    tokens, heads, head_dim = 6, 5, 16
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    table = torch.randn(32, 2 * rotary_half, generator=gen)
    positions = torch.tensor([0, 3, 31, 7, 7, 12])
    cos, sin = table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    expected = apply_rope(qk.clone(), cos, sin)
    untouched = qkv[:, heads * head_dim :].clone()
    rotated = cpu_layer_ops.rope_(qk, cos, sin)
    assert rotated is qk and torch.equal(qk, expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


def test_rms_norm_over_strided_heads_with_and_without_residual() -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 7 * 8, generator=gen) * 5
    heads = qkv[:, : 4 * 8].view(3, 4, 8)  # per-head norms (Qwen 3, Gemma 3)
    weight = torch.randn(8, generator=gen)
    out, same = cpu_layer_ops.rms_norm(heads, None, weight, 1e-6)
    assert same is heads
    ref = weight * (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    x, residual = torch.randn(9, 100, generator=gen), torch.randn(9, 100, generator=gen)
    weight = torch.randn(100, generator=gen)
    out, summed = cpu_layer_ops.rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    ref = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_layouts_the_ops_do_not_read_fall_back_to_torch() -> None:
    assert cpu_layer_ops.gated_act(torch.zeros(2, 8), "gelu") is None  # erf GELU
    assert cpu_layer_ops.gated_act(torch.zeros(2, 8).t(), "silu") is None
    assert cpu_layer_ops.rms_norm(torch.zeros(4, 6).t(), None, torch.ones(4), 1e-6) is None
