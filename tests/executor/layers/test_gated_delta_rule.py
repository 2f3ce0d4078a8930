"""Gated DeltaNet's state arithmetic (executor/layers/gated_delta_rule.py) against transformers'
torch implementations (qwen3_next's): a prompt cut anywhere and carried across the cut by its
conv window and recurrent state gives what one pass over the whole prompt gives, and decode
steps continue it as transformers' one-token recurrence does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from zllm.executor.layers.causal_conv import conv_decode, conv_prefill
from zllm.executor.layers.gated_delta_rule import chunked_prefill, recurrent_step

KEY_HEADS, HEADS, KEY_DIM, VALUE_DIM, CHANNELS, KERNEL = 2, 4, 16, 8, 24, 4


def draw(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k [L, key_heads, key_dim], v [L, heads, value_dim], g <= 0 and beta in (0, 1) [L, heads]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, KEY_HEADS, KEY_DIM, generator=gen)
    k = torch.randn(length, KEY_HEADS, KEY_DIM, generator=gen)
    v = torch.randn(length, HEADS, VALUE_DIM, generator=gen)
    g = -F.softplus(torch.randn(length, HEADS, generator=gen))
    beta = torch.rand(length, HEADS, generator=gen)
    return q, k, v, g, beta


def reference(q, k, v, g, beta, state=None, recurrent=False):
    """transformers' rule over one sequence (batch of one): (out [L, H, dv], final state)."""
    rule = hf.torch_recurrent_gated_delta_rule if recurrent else hf.torch_chunk_gated_delta_rule
    out, final = rule(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], final[0]


@pytest.mark.parametrize("length, cut", [(150, 70), (64, 64), (9, 1), (130, 128)])
def test_a_prompt_cut_anywhere_equals_one_pass(length: int, cut: int) -> None:
    q, k, v, g, beta = draw(length, seed=length)
    expected, expected_state = reference(q, k, v, g, beta)
    zero = torch.zeros(HEADS, KEY_DIM, VALUE_DIM)
    first, state = chunked_prefill(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], zero)
    outs = [first]
    if cut < length:
        rest, state = chunked_prefill(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], state)
        outs.append(rest)
    torch.testing.assert_close(torch.cat(outs), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=2e-5, rtol=1e-4)


def test_decode_steps_continue_a_prompt_as_transformers_recurrence() -> None:
    """Three sequences at different states stepped as one batch: each equals transformers'
    one-token recurrence from its own state."""
    prompts = [draw(n, seed=n) for n in (20, 33, 5)]
    states = torch.stack([reference(*p)[1] for p in prompts])
    step = draw(3, seed=99)  # one new token for each of the three sequences
    out, new_states = recurrent_step(*step, states)
    for i in range(3):
        token = [x[i : i + 1] for x in step]
        expected, expected_state = reference(*token, state=states[i], recurrent=True)
        torch.testing.assert_close(out[i], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new_states[i], expected_state, atol=1e-5, rtol=1e-5)


def test_the_conv_window_carries_a_prompt_across_chunks_and_decodes() -> None:
    """conv_prefill over a prompt in two chunks, then conv_decode for two tokens, equals
    transformers' causal conv over the whole sequence (zero-padded on the left, SiLU)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(23, CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, KERNEL, generator=gen)
    expected = hf.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    window = torch.zeros(CHANNELS, KERNEL - 1)
    first, window = conv_prefill(x[:10], window, weight)
    second, window = conv_prefill(x[10:21], window, weight)
    outs = [first, second]
    windows = window[None]
    for t in (21, 22):
        out, windows = conv_decode(x[t : t + 1], windows, weight)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(windows[0], x[20:23].t())  # the last kernel - 1 inputs


@pytest.mark.parametrize("tiled", [False, True])
def test_the_cpu_kernel_steps_the_slots_in_place_as_the_torch_rule(tiled: bool) -> None:
    """csrc/cpu/state_layers.cpp: three decode rows in slots 4, 0 and 2 of a pool of five;
    outputs and new states as recurrent_step's (key heads shared grouped or tiled), the other
    slots untouched."""
    from zllm.executor.kernels import cpu_state_ops

    q, k, v, g, beta = draw(3, seed=11)
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(5, HEADS, KEY_DIM, VALUE_DIM, generator=gen) * 0.1
    before = pool.clone()
    slots = torch.tensor([4, 0, 2])
    expected, expected_states = recurrent_step(q, k, v, g, beta, before[slots], tiled)
    out = cpu_state_ops.gated_delta_decode_(q, k, v, g, beta, pool, slots, tiled)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], expected_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_the_cpu_kernels_fuse_the_gated_norm_and_step_the_conv_windows() -> None:
    """gated_delta_decode_ with the gate and the norm's weight: the torch rule's output
    through gated_rms_norm; causal_conv_decode_: conv_decode's output and windows, in the
    rows' slots of a pool of windows."""
    from zllm.executor.kernels import cpu_state_ops
    from zllm.executor.layers.gated_delta_rule import gated_rms_norm

    q, k, v, g, beta = draw(2, seed=21)
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(3, HEADS, KEY_DIM, VALUE_DIM, generator=gen) * 0.1
    slots = torch.tensor([2, 0])
    gate = torch.randn(2, HEADS, VALUE_DIM, generator=gen)
    weight = torch.rand(VALUE_DIM, generator=gen) + 0.5
    out, _ = recurrent_step(q, k, v, g, beta, pool[slots].clone())
    expected = gated_rms_norm(out, gate, weight, 1e-6)
    fused = cpu_state_ops.gated_delta_decode_(q, k, v, g, beta, pool, slots, False, gate, weight, 1e-6)  # fmt: skip
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)

    x = torch.randn(2, CHANNELS, generator=gen)
    conv_weight = torch.randn(CHANNELS, KERNEL, generator=gen)
    windows = torch.randn(3, CHANNELS, KERNEL - 1, generator=gen)
    expected, moved = conv_decode(x, windows[slots].clone(), conv_weight)
    out = cpu_state_ops.causal_conv_decode_(x, windows, slots, conv_weight)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(windows[slots], moved)
