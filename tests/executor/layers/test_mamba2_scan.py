"""Mamba-2's state arithmetic (executor/layers/mamba2_scan.py) against transformers' torch
implementations (granitemoehybrid's): a prompt cut anywhere and carried across the cut by its
recurrent state gives what one pass over the whole prompt gives, decode steps continue it as
transformers' one-token update does, and the CPU kernel's step equals the torch step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

from zllm.executor.kernels import cpu_state_ops
from zllm.executor.layers.causal_conv import conv_decode, conv_prefill
from zllm.executor.layers.mamba2_scan import chunked_scan, gated_group_norm, scan_step

GROUPS, HEADS, STATE, HEAD_DIM = 2, 4, 16, 8


def draw(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    """x [L, H, P], B and C [L, groups, N], dt > 0 [L, H], A < 0 and D [H]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, HEADS, HEAD_DIM, generator=gen)
    B = torch.randn(length, GROUPS, STATE, generator=gen)
    C = torch.randn(length, GROUPS, STATE, generator=gen)
    dt = F.softplus(torch.randn(length, HEADS, generator=gen))
    A = -torch.rand(HEADS, generator=gen) * 2 - 0.1
    D = torch.randn(HEADS, generator=gen)
    return x, B, C, dt, A, D


def reference(x, B, C, dt, A, D, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' chunked scan over the whole prompt from a zero state (its state is
    [H, head_dim, state]; ours [H, state, head_dim])."""
    out, final = hf.mamba2_chunk_scan(
        x[None], dt[None], A, B[None], C[None], chunk, D=D, return_final_states=True
    )
    return out[0], final[0].transpose(-1, -2)


@pytest.mark.parametrize("cut", [1, 7, 64, 100])
def test_chunked_scan_carries_across_a_cut(cut: int) -> None:
    length = 150
    x, B, C, dt, A, D = draw(length, seed=cut)
    expected, expected_state = reference(x, B, C, dt, A, D, chunk=32)
    state = torch.zeros(HEADS, STATE, HEAD_DIM)
    first, state = chunked_scan(x[:cut], B[:cut], C[:cut], dt[:cut], A, D, state, chunk=16)
    second, state = chunked_scan(x[cut:], B[cut:], C[cut:], dt[cut:], A, D, state, chunk=16)
    torch.testing.assert_close(torch.cat((first, second)), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-4)


def test_decode_steps_continue_a_prompt_as_transformers_update() -> None:
    x, B, C, dt, A, D = draw(40, seed=3)
    _, state = chunked_scan(
        x[:30], B[:30], C[:30], dt[:30], A, D, torch.zeros(HEADS, STATE, HEAD_DIM)
    )
    theirs = state.transpose(-1, -2).clone()[None]  # [1, H, head_dim, state]
    ours = state[None]
    for t in range(30, 40):
        out, ours = scan_step(x[t : t + 1], B[t : t + 1], C[t : t + 1], dt[t : t + 1], A, D, ours)
        # (dt given after softplus, without a bias; A and D expanded as its caller does)
        expected = hf.mamba2_selective_state_update(
            theirs,
            x[t : t + 1],
            dt[t : t + 1, :, None].expand(-1, -1, HEAD_DIM),
            A[:, None, None].expand(-1, HEAD_DIM, STATE),
            B[t : t + 1],
            C[t : t + 1],
            D[:, None].expand(-1, HEAD_DIM),
        )
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[0], theirs[0].transpose(-1, -2), rtol=1e-4, atol=1e-4)


def test_conv_with_bias_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(5)
    channels, kernel, length = 12, 4, 20
    x = torch.randn(length, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    bias = torch.randn(channels, generator=gen)
    conv = torch.nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)
    conv.weight.data, conv.bias.data = weight.unsqueeze(1), bias
    expected = F.silu(conv(x.t()[None])[0, :, :length]).t()
    window = torch.zeros(channels, kernel - 1)
    first, window = conv_prefill(x[:9], window, weight, bias)
    rows = [first]
    windows = window[None]
    for t in range(9, length):
        out, windows = conv_decode(x[t : t + 1], windows, weight, bias)
        rows.append(out)
    torch.testing.assert_close(torch.cat(rows), expected, rtol=1e-5, atol=1e-5)


def test_gated_group_norm_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(6)
    width, groups = 32, 4
    y, gate = torch.randn(5, width, generator=gen), torch.randn(5, width, generator=gen)
    norm = hf.GraniteMoeHybridRMSNormGated(width, group_size=width // groups, eps=1e-5)
    norm.weight.data = torch.randn(width, generator=gen)
    expected = norm(y, gate)
    torch.testing.assert_close(gated_group_norm(y, gate, norm.weight, groups, 1e-5), expected)


@pytest.mark.skipif(not cpu_state_ops.usable(torch.zeros(1)), reason="CPU kernels not built")
def test_cpu_kernels_equal_the_torch_step() -> None:
    """mamba2_decode_ and causal_conv_decode_ with a bias: scan_step's and conv_decode's
    outputs and new states, written in place into the rows' slots only."""
    x, B, C, dt, A, D = draw(3, seed=8)
    gen = torch.Generator().manual_seed(9)
    pool = torch.randn(5, HEADS, STATE, HEAD_DIM, generator=gen)
    slots = torch.tensor([4, 0, 2])
    expected, states = scan_step(x, B, C, dt, A, D, pool[slots].clone())
    untouched = pool[[1, 3]].clone()
    out = cpu_state_ops.mamba2_decode_(x, B, C, dt, A, D, pool, slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[slots], states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[[1, 3]], untouched)

    channels, kernel = 10, 4
    rows = torch.randn(3, channels, generator=gen)
    windows = torch.randn(5, channels, kernel - 1, generator=gen)
    weight, bias = (
        torch.randn(channels, kernel, generator=gen),
        torch.randn(channels, generator=gen),
    )
    expected, moved = conv_decode(rows, windows[slots].clone(), weight, bias)
    out = cpu_state_ops.causal_conv_decode_(rows, windows, slots, weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(windows[slots], moved)
