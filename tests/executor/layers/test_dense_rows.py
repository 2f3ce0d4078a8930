"""fp32 matmuls at decode-sized calls (csrc/cpu/dense_rows.h, executor/layers/linear/dense.py):
the kernel's results against torch's and, bit for bit, against its 16-lane sums computed
exactly here (so the AVX-512 and AVX2 variants give the same bits), each output independent of
the rows beside it, torch's matmul past 8 rows, and an fp32 model's modules using it."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zllm import LLM, SamplingParams
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.layers.linear.dense import DENSE_MAX_ROWS, DenseRowsLinear


@pytest.mark.parametrize("in_features", [576, 100, 16, 33])  # tails of 4, 1 and 0 lanes
def test_dense_linear_is_torch_s_product_row_by_row(in_features: int) -> None:
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(37, in_features, generator=gen)  # 37: short last weight-row tiles
    bias = torch.randn(37, generator=gen)
    x = torch.randn(DENSE_MAX_ROWS + 3, in_features, generator=gen)
    for rows in range(1, DENSE_MAX_ROWS + 4):
        for b in (None, bias):
            y = cpu_kernels.dense_linear(x[:rows], weight, b)
            # (two orders of 576 fp32 products: ~1e-5 apart at worst)
            torch.testing.assert_close(y, F.linear(x[:rows], weight, b), rtol=1e-5, atol=1e-4)
    # Each output is one weight row against one x row: the same bits whatever the call's
    # size up to DENSE_MAX_ROWS (the batch-invariant mode's tiles rely on it).
    alone = torch.cat([cpu_kernels.dense_linear(x[i : i + 1], weight) for i in range(8)])
    assert torch.equal(cpu_kernels.dense_linear(x[:8], weight), alone)


def _fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c rounded once to fp32 (to nearest, ties to even), as an FMA instruction."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))  # within one fp32 step of the exact value
    candidates = [
        np.nextafter(near, np.float32(-np.inf)),
        near,
        np.nextafter(near, np.float32(np.inf)),
    ]
    return min(
        candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.int32)) & 1)
    )


def sixteen_lane_dot(x: np.ndarray, w: np.ndarray) -> np.float32:
    """The kernel's sum of x . w: lane l of 16 takes the fused multiply-adds of values l, l + 16,
    ... (zeros past the end), then the lanes are added as _mm512_reduce_add_ps adds them
    (16 -> 8: high + low, 8 -> 4, then (0 + 2) + (1 + 3))."""
    lanes = [np.float32(0.0)] * 16
    for k0 in range(0, len(x), 16):
        for lane in range(16):
            if k0 + lane < len(x):
                lanes[lane] = _fma32(x[k0 + lane], w[k0 + lane], lanes[lane])
    t3 = [lanes[8 + i] + lanes[i] for i in range(8)]
    t6 = [t3[4 + i] + t3[i] for i in range(4)]
    return (t6[0] + t6[2]) + (t6[1] + t6[3])


@pytest.mark.parametrize("in_features", [40, 16])  # a tail of 8 values, none
def test_every_isa_gives_the_sixteen_lane_sums_bit_for_bit(in_features: int) -> None:
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(9, in_features, generator=gen)  # 9: short last weight-row tiles
    x = torch.randn(DENSE_MAX_ROWS, in_features, generator=gen)
    xs, ws = x.numpy(), weight.numpy()
    expected = torch.tensor([[sixteen_lane_dot(xr, wr) for wr in ws] for xr in xs])
    before = cpu_kernels.cpu_isa()
    isas = ["avx2"] + (["avx512vnni"] if cpu_kernels.cpu_has_avx512_vnni() else [])
    try:
        for isa in isas:
            cpu_kernels.set_cpu_isa(isa)
            for rows in range(1, DENSE_MAX_ROWS + 1):
                got = cpu_kernels.dense_linear(x[:rows], weight)
                assert torch.equal(got, expected[:rows]), (isa, rows)
    finally:
        cpu_kernels.set_cpu_isa(before)


def test_past_eight_rows_or_a_view_it_is_torch_s_matmul() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(40, 64, generator=gen), torch.randn(12, 64, generator=gen)
    assert torch.equal(cpu_kernels.dense_linear(x, weight), x @ weight.T)  # 12 rows: torch's
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
    """The engine swaps every fp32 nn.Linear (the same Parameters) for the kernel's module
    and sends the logits' decode rows to the kernel, and its greedy tokens are transformers' (prefill through torch's matmul, decode steps of
    1-6 rows through the kernel)."""
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=8)
    kinds = {type(m) for m in llm.model_runner.model.modules() if isinstance(m, nn.Linear)}
    assert kinds == {DenseRowsLinear}
    model = llm.model_runner.model
    assert model.dense_logits  # the tied embedding's logits too: the kernel's bits to 8 rows
    weight = model.embed_tokens if model.lm_head is None else model.lm_head
    hidden = torch.randn(
        DENSE_MAX_ROWS + 4, weight.shape[1], generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        few = model.compute_logits(hidden[:3])
        assert torch.equal(few, cpu_kernels.dense_linear(hidden[:3], weight)[:, : few.shape[1]])
        many = model.compute_logits(hidden)
        assert torch.equal(many, F.linear(hidden, weight)[:, : many.shape[1]])
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
