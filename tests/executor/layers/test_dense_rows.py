"""fp32 matmuls at decode-sized calls (csrc/cpu/dense_rows.h, executor/layers/linear/dense.py):
the AVX-512 kernel's results against torch's, each output independent of the rows beside it,
torch's matmul wherever the kernel does not run, and an fp32 model's modules using it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zllm import LLM, SamplingParams
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.layers.linear.dense import DENSE_MAX_ROWS, DenseRowsLinear


def kernel_runs() -> bool:
    """Whether dense_rows.h serves 1-8 rows here (AVX-512, not forced off by $ZLLM_CPU_ISA)."""
    return cpu_kernels.cpu_isa() == "avx512vnni"


@pytest.mark.parametrize("in_features", [576, 100, 16, 33])  # tails of 4, 1 and 0 lanes
def test_dense_linear_is_torch_s_product_row_by_row(in_features: int) -> None:
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(37, in_features, generator=gen)  # 37: short last weight-row tiles
    bias = torch.randn(37, generator=gen)
    x = torch.randn(DENSE_MAX_ROWS + 3, in_features, generator=gen)
    for rows in range(1, DENSE_MAX_ROWS + 4):
        for b in (None, bias):
            y = cpu_kernels.dense_linear(x[:rows], weight, b)
            torch.testing.assert_close(y, F.linear(x[:rows], weight, b), rtol=1e-5, atol=1e-5)
    if not kernel_runs():  # torch's matmul, exactly
        assert torch.equal(cpu_kernels.dense_linear(x[:5], weight), F.linear(x[:5], weight))
        return
    # Each output is one weight row against one x row: the same bits whatever the call's
    # size up to DENSE_MAX_ROWS (the batch-invariant mode's tiles rely on it).
    alone = torch.cat([cpu_kernels.dense_linear(x[i : i + 1], weight) for i in range(8)])
    assert torch.equal(cpu_kernels.dense_linear(x[:8], weight), alone)


def test_without_avx512_or_past_eight_rows_it_is_torch_s_matmul() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(40, 64, generator=gen), torch.randn(12, 64, generator=gen)
    assert torch.equal(cpu_kernels.dense_linear(x, weight), x @ weight.T)  # 12 rows: torch's
    before = cpu_kernels.cpu_isa()
    try:
        cpu_kernels.set_cpu_isa("avx2")
        assert torch.equal(cpu_kernels.dense_linear(x[:4], weight), x[:4] @ weight.T)
    finally:
        cpu_kernels.set_cpu_isa(before)
    # A weight that is not contiguous (a view) is torch's matmul too, not an error.
    wide = torch.randn(40, 128, generator=gen)
    view = wide[:, :64]
    assert torch.equal(cpu_kernels.dense_linear(x[:2], view), F.linear(x[:2], view))


def test_module_takes_the_kernel_for_few_rows_and_torch_beyond() -> None:
    gen = torch.Generator().manual_seed(2)
    module = nn.Linear(96, 48)
    with torch.no_grad():
        module.weight.copy_(torch.randn(48, 96, generator=gen))
    reference = F.linear
    module.__class__ = DenseRowsLinear
    with torch.no_grad():
        for shape in [(1, 96), (2, 4, 96), (DENSE_MAX_ROWS + 1, 96)]:
            x = torch.randn(*shape, generator=gen)
            flat = x.reshape(-1, 96)
            kernel = cpu_kernels.dense_linear(flat, module.weight, module.bias)
            expected = (
                kernel
                if flat.shape[0] <= DENSE_MAX_ROWS
                else reference(x, module.weight, module.bias)
            )
            assert torch.equal(module(x).reshape(-1, 48), expected.reshape(-1, 48)), shape


def test_an_fp32_model_s_matmuls_use_it_and_answer_as_before(tiny_llama_dir: str) -> None:
    """Where the CPU has AVX-512 the engine swaps every fp32 nn.Linear (the same Parameters),
    and its greedy tokens are transformers' (prefill through torch's matmul, decode steps of
    1-6 rows through the kernel)."""
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=8)
    kinds = {type(m) for m in llm.model_runner.model.modules() if isinstance(m, nn.Linear)}
    assert kinds == ({DenseRowsLinear} if kernel_runs() else {nn.Linear})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 77, 300, 12 * i + 1]} for i in range(6)]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=8, do_sample=False)
        assert out[0, ids.shape[1] :].tolist() == tokens
