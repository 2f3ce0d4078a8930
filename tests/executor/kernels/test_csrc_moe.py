"""The GPU's mixture-of-experts kernel (csrc/moe_experts.cu, executor/kernels/cuda_moe.py),
built for the host by the kernel emulator (csrc/emu) and run on CPU tensors:

- the pairs grouped by expert on the device (torch ops, no host count);
- zllm_moe_gemv against a float64 reference, in fp32, fp16 and bf16, with biases, an expert
  with more pairs than one pass takes, outputs not a multiple of a block's rows; the experts
  no token chose hold NaN, so a read of them would show;
- MoEBlock's GPU path (the kernel for both projections, the activation, the combine in fp32)
  against its CPU path, for the Qwen-MoE rule and gpt-oss's (interleaved gate/up, biases);
  layouts the kernel does not read fall back to the per-expert matmuls.

tests/test_cuda_moe.py runs the same on a GPU, and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import moe_reference, random_moe

from zllm.executor.kernels import cuda_moe
from zllm.executor.kernels.cuda import CudaKernelError
from zllm.executor.layers.moe.router import GPT_OSS_RULE

# One unit in the last place of each type, relative.
ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def test_expert_groups_sort_pairs_by_expert_on_the_device():
    experts = torch.tensor([[3, 0], [3, 5], [0, 3], [5, 1]])
    groups = cuda_moe.expert_groups(experts, num_experts=7)
    pairs = experts.reshape(-1)
    assert groups.num_pairs == 8
    assert groups.order.tolist() == [1, 4, 7, 0, 2, 5, 3, 6]  # stable: pair order within e
    assert groups.offsets.tolist() == [0, 2, 3, 3, 6, 6, 8, 8]
    assert groups.expert_list[:4].tolist() == [0, 1, 3, 5]  # the chosen ones first, in order
    assert sorted(groups.expert_list.tolist()) == list(range(7))
    for e in range(7):
        members = groups.order[groups.offsets[e] : groups.offsets[e + 1]]
        assert (pairs[members] == e).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("pair_div", [3, 1], ids=["layer-input", "per-pair-rows"])
def test_emulated_moe_gemv_matches_float64(emu, dtype, with_bias, pair_div):
    gen = torch.Generator().manual_seed(31)
    num_experts, out_features, in_features, top_k, tokens = 6, 20, 64, 3, 4
    # Expert 2 gets 6 pairs (more than the kernel's 4 a pass); 4 and 5 none.
    experts = torch.tensor([[2, 2, 1], [2, 3, 1], [2, 1, 0], [3, 2, 2]])
    weight = torch.randn(num_experts, out_features, in_features, generator=gen).to(dtype)
    weight[4:] = float("nan")  # never chosen: reading them would poison an output
    bias = torch.randn(num_experts, out_features, generator=gen).to(dtype) if with_bias else None
    rows = tokens if pair_div == top_k else tokens * top_k
    # x's rows strided, as a slice of a wider tensor
    x = torch.randn(rows, in_features + 8, generator=gen).to(dtype)[:, :in_features]
    groups = cuda_moe.expert_groups(experts, num_experts)
    out = torch.full((tokens * top_k, out_features), float("nan"), dtype=dtype)
    emu.names.clear()
    emu.run_launches(cuda_moe.plan_moe_gemv(x, weight, bias, groups, pair_div, out))
    assert emu.names == [f"zllm_moe_gemv<{cuda_moe._DTYPE_TAG[dtype]}>"]
    expected = moe_reference(x, weight, bias, experts, pair_div)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=ULP[dtype], atol=ULP[dtype] * scale)


def test_moe_gemv_refuses_layouts_it_does_not_read():
    weight = torch.zeros(4, 8, 12, dtype=torch.bfloat16)  # 12 bf16 values: 24 bytes a row
    x = torch.zeros(2, 12, dtype=torch.bfloat16)
    groups = cuda_moe.expert_groups(torch.tensor([[0, 1], [1, 2]]), 4)
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    with pytest.raises(CudaKernelError, match="16-byte packs"):
        cuda_moe.plan_moe_gemv(x, weight, None, groups, 2, out)
    assert not cuda_moe.takes(x, weight)
    wide = torch.zeros(4, 8, 16, dtype=torch.bfloat16)
    assert cuda_moe.takes(torch.zeros(2, 16, dtype=torch.bfloat16), wide)
    assert not cuda_moe.takes(torch.zeros(2, 16, dtype=torch.float32), wide)  # dtypes differ
    x16 = torch.zeros(2, 16, dtype=torch.bfloat16)
    with pytest.raises(CudaKernelError, match="out must be"):
        cuda_moe.plan_moe_gemv(x16, wide, None, groups, 2, out[:, :7])
    with pytest.raises(CudaKernelError, match="do not read"):  # 4 pairs from 1 row of 2
        cuda_moe.plan_moe_gemv(x16[:1], wide, None, groups, 2, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["qwen", "gpt-oss"])
@pytest.mark.parametrize("tokens", [1, 9])
@torch.inference_mode()
def test_emulated_moe_block_equals_its_cpu_path(emu, monkeypatch, dtype, rule, tokens):
    """MoEBlock as it runs on a GPU (here emulated: both projections through the kernel,
    no host sync) against the same block on the per-expert matmuls."""
    block = random_moe(GPT_OSS_RULE if rule == "gpt-oss" else None, dtype)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = block(x)
    monkeypatch.setattr(cuda_moe, "usable", lambda x: True)
    monkeypatch.setattr(
        cuda_moe, "run_launches", lambda launches, device: emu.run_launches(launches)
    )
    emu.names.clear()
    on_gpu_path = block(x)
    assert [name.split("<")[0] for name in emu.names] == ["zllm_moe_gemv"] * 2
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(on_gpu_path, expected, rtol=tol, atol=tol)


@torch.inference_mode()
def test_moe_block_layouts_the_kernel_cannot_read_take_the_per_expert_path(monkeypatch):
    """An intermediate of 20 bf16 values (40 bytes a row) is not read in 16-byte packs: the
    block keeps the per-expert matmuls (and would refuse a CUDA graph capture by name)."""
    block = random_moe(None, torch.bfloat16, inter=20)
    x = torch.randn(2, 64).to(torch.bfloat16)
    expected = block(x)
    monkeypatch.setattr(cuda_moe, "usable", lambda x: True)
    launched = []
    monkeypatch.setattr(
        cuda_moe, "run_launches", lambda launches, device: launched.extend(launches)
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert torch.equal(block(x), expected)
    assert launched == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot capture this MoE layer"):
        block(x)
