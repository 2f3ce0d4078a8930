"""The GPU's state-layer decode kernels (csrc/state_layers.cu, executor/kernels/
cuda_state_ops.py), built for the host by the kernel emulator (csrc/emu) and run on CPU
tensors against the torch steps they replace (causal_conv.conv_decode, gated_delta_rule
recurrent_step, mamba2_scan.scan_step): each row's slot updated in place, the other slots
untouched. The layers then take them in a step (cuda_state_ops' calls, the gated norm after the rule)
with the launches run by the emulator, answering as the torch path; tests/executor/kernels/
test_cuda_state.py runs them on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_cases import CASES

from zllm import LLM, SamplingParams
from zllm.executor.kernels import cpu_state_ops
from zllm.executor.kernels import cuda_state_ops as cs
from zllm.executor.kernels.cuda import CudaKernelError
from zllm.executor.layers.causal_conv import conv_decode
from zllm.executor.layers.gated_delta_rule import recurrent_step
from zllm.executor.layers.mamba2_scan import scan_step

SLOTS = torch.tensor([4, 0, 2])  # rows' slots of a pool of 5; 1 and 3 must stay as they are


def untouched(pool: torch.Tensor) -> torch.Tensor:
    return pool[[1, 3]].clone()


@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_emulated_conv_step_equals_torch(emu, with_bias) -> None:
    gen = torch.Generator().manual_seed(1)
    channels, kernel = 200, 4  # (more channels than a thread block's 128)
    x = torch.randn(3, channels, generator=gen)
    pool = torch.randn(5, channels, kernel - 1, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    expected, moved = conv_decode(x, pool[SLOTS].clone(), weight, bias)
    before = untouched(pool)
    out = torch.empty_like(x)
    emu.run_launches(cs.plan_causal_conv_decode(x, pool, SLOTS, weight, bias, out))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[SLOTS], moved)
    torch.testing.assert_close(pool[[1, 3]], before)


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_emulated_gated_delta_step_equals_torch(emu, tiled) -> None:
    gen = torch.Generator().manual_seed(2)
    key_heads, heads, key_dim, value_dim = 2, 4, 16, 8
    q = torch.randn(3, key_heads, key_dim, generator=gen)
    k = torch.randn(3, key_heads, key_dim, generator=gen)
    v = torch.randn(3, heads, value_dim, generator=gen)
    g = -F.softplus(torch.randn(3, heads, generator=gen))
    beta = torch.rand(3, heads, generator=gen)
    pool = torch.randn(5, heads, key_dim, value_dim, generator=gen)
    expected, states = recurrent_step(q, k, v, g, beta, pool[SLOTS].clone(), tiled)
    before = untouched(pool)
    # (the kernel reads q and k as the rule does: normalised, q scaled; the wrapper does it)
    qn = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * key_dim**-0.5
    kn = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    out = torch.empty_like(v)
    emu.run_launches(cs.plan_gated_delta_decode(qn, kn, v, g, beta, pool, SLOTS, tiled, out))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[SLOTS], states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[[1, 3]], before)


def test_emulated_mamba2_step_equals_torch(emu) -> None:
    gen = torch.Generator().manual_seed(3)
    groups, heads, state_size, head_dim = 2, 4, 16, 8
    x = torch.randn(3, heads, head_dim, generator=gen)
    B = torch.randn(3, groups, state_size, generator=gen)
    C = torch.randn(3, groups, state_size, generator=gen)
    dt = F.softplus(torch.randn(3, heads, generator=gen))
    A, D = -torch.rand(heads, generator=gen) - 0.1, torch.randn(heads, generator=gen)
    pool = torch.randn(5, heads, state_size, head_dim, generator=gen)
    expected, states = scan_step(x, B, C, dt, A, D, pool[SLOTS].clone())
    before = untouched(pool)
    out = torch.empty_like(x)
    emu.run_launches(cs.plan_mamba2_decode(x, B, C, dt, A, D, pool, SLOTS, out))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[SLOTS], states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[[1, 3]], before)


def test_the_planners_refuse_what_the_kernels_do_not_read() -> None:
    x = torch.zeros(3, 8)
    with pytest.raises(CudaKernelError, match="slots must be"):
        cs.plan_causal_conv_decode(x, torch.zeros(5, 8, 3), SLOTS.int(), torch.zeros(8, 4), None, x)
    with pytest.raises(CudaKernelError, match="fp32"):
        cs.plan_causal_conv_decode(
            x.half(), torch.zeros(5, 8, 3), SLOTS, torch.zeros(8, 4), None, x
        )
    with pytest.raises(CudaKernelError, match="state must be"):
        cs.plan_mamba2_decode(
            torch.zeros(3, 4, 8), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), torch.zeros(3, 4),
            torch.zeros(4), torch.zeros(4), torch.zeros(5, 4, 8, 16), SLOTS, torch.zeros(3, 4, 8),
        )  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_next", "granite_hybrid"])
def test_the_layers_on_the_emulated_kernels_answer_as_on_torch(emu, family, tmp_path, monkeypatch) -> None:  # fmt: skip
    """A tiny hybrid's state layers with their decode rows on cuda_state_ops (the emulator
    running its launches on the CPU tensors), in steps mixing chunks and decodes: the torch
    path's answers."""
    directory = str(CASES[family].write(tmp_path / family))
    prompts = [[(7 * i + 3 * j) % 390 + 5 for j in range(n)] for i, n in enumerate([1, 9, 70])]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def answers() -> list[list[int]]:
        llm = LLM(directory, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=16)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    monkeypatch.setattr(cpu_state_ops, "usable", lambda x: False)
    on_torch = answers()
    launched = []
    monkeypatch.setattr(cs, "usable", lambda x: True)
    monkeypatch.setattr(cs, "run_launches", lambda launches, device: (launched.extend(launches), emu.run_launches(launches)))  # fmt: skip
    assert answers() == on_torch
    rule = "zllm_gated_delta_decode" if family == "qwen3_next" else "zllm_mamba2_decode"
    assert {launch.name for launch in launched} == {"zllm_causal_conv_decode", rule}
