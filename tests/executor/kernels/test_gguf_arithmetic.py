"""Which arithmetic a GGUF matmul runs (executor/weights/gguf_arithmetic.py): the default `gguf`
takes integer dots per type and call size where the measured table says they are faster on
the CPU at hand, `gguf-float` never, `gguf-int8` wherever a type has them; and the
`--quantization` values a model cannot use are refused at start, naming why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_files import random_blocks, write_llama_gguf

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels.gguf_arithmetic import (
    ALL_ROWS,
    BF16_GEMM_MIN_ROWS,
    BLOCK_GEMM_MIN_ROWS,
    FASTEST_INTEGER_ROWS,
    INT8_MAX_ROWS,
    INTEGER_TYPES,
    SIXTEEN_BIT,
    bf16_gemm_rows,
    cpu_has_amx_bf16,
    integer_rows,
)
from zllm.executor.layers.linear.gguf import GGUFLinear, GGUFSplitLinear

K_QUANTS = [int(T.Q2_K), int(T.Q3_K), int(T.Q4_K), int(T.Q6_K)]


def tiny_llm(path: str, **kwargs) -> LLM:
    return LLM(path, kv_cache_memory_bytes=16 << 20, max_num_seqs=4, **kwargs)


def test_the_table_names_only_types_with_an_integer_path_on_each_isa() -> None:
    assert set(FASTEST_INTEGER_ROWS) == set(cpu_kernels.CPU_ISA_CHOICES) - {"auto"}
    for isa, table in FASTEST_INTEGER_ROWS.items():
        assert set(table) <= INTEGER_TYPES, isa
        assert all(rows >= 1 for rows in table.values()), isa
        # The K-quants' integer path is the one the default takes on every CPU (at one row
        # it is 2-4x the float kernel's speed on both instruction sets).
        assert all(table[t] >= 1 for t in K_QUANTS), isa
    # Measured where the integer path is level or behind at one row: the float kernel.
    for t in (T.Q4_0, T.Q4_1, T.Q8_0):
        assert all(int(t) not in table for table in FASTEST_INTEGER_ROWS.values())


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
def test_each_name_chooses_its_rows(isa: str) -> None:
    q4k, q6k, q8, f16 = int(T.Q4_K), int(T.Q6_K), int(T.Q8_0), int(T.F16)
    for t in (q4k, q6k, q8, f16):
        assert integer_rows("gguf-float", [t], isa) == 0
    assert integer_rows("gguf-int8", [q4k, q6k], isa) == ALL_ROWS
    assert integer_rows("gguf-int8", [q8], isa) == INT8_MAX_ROWS
    assert integer_rows("gguf-int8", [q4k, q8], isa) == INT8_MAX_ROWS
    assert integer_rows("gguf-int8", [q4k, f16], isa) == 0  # 16-bit rows: float dots only
    table = FASTEST_INTEGER_ROWS[isa]
    assert integer_rows("gguf", [q4k], isa) == table[q4k]
    assert integer_rows("gguf", [q8], isa) == 0
    # A fused matmul takes one path for all its parts: the smallest of their limits.
    assert integer_rows("gguf", [q4k, q6k], isa) == min(table[q4k], table[q6k])
    assert integer_rows("gguf", [q4k, q8], isa) == 0


def test_modules_take_the_integer_path_up_to_their_rows() -> None:
    """Under the default a Q4_K matmul multiplies x rounded to int8 up to its table's rows, and
    a Q8_0 one keeps the float kernel at every size; a split matmul of both takes the float
    kernel (its parts share one path)."""
    from gguf.quants import quantize

    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(16, 256, generator=gen) * 0.1).numpy()
    q4k = torch.from_numpy(random_blocks((16, 256), T.Q4_K, np.random.default_rng(3)))
    q8 = torch.from_numpy(quantize(w, T.Q8_0))
    k_layer = GGUFLinear(q4k, int(T.Q4_K), 256, None, "gguf")
    q8_layer = GGUFLinear(q8, int(T.Q8_0), 256, None, "gguf")
    split = GGUFSplitLinear([(q4k, int(T.Q4_K)), (q8, int(T.Q8_0))], 256, None, "gguf")
    limit = FASTEST_INTEGER_ROWS[cpu_kernels.cpu_isa()][int(T.Q4_K)]
    assert k_layer.int8_max_rows == limit and not q8_layer.int8_activations
    assert not split.int8_activations
    for rows in sorted({1, 3, min(limit, 40), min(limit + 1, 41)}):
        x = torch.randn(rows, 256, generator=gen)
        integer = rows <= limit
        kernel = cpu_kernels.gguf_linear_int8 if integer else cpu_kernels.gguf_linear
        assert torch.equal(k_layer(x), kernel(x, q4k, int(T.Q4_K))), rows
        assert torch.equal(q8_layer(x), cpu_kernels.gguf_linear(x, q8, int(T.Q8_0))), rows


def test_bf16_rows_take_bf16_gemms_from_8_rows_only_by_default_and_with_amx(
    monkeypatch,
) -> None:
    bf16, f16, q4k = int(T.BF16), int(T.F16), int(T.Q4_K)
    for method in ("gguf", SIXTEEN_BIT):
        assert bf16_gemm_rows(method, [bf16], amx=True) == BF16_GEMM_MIN_ROWS == 8
        assert bf16_gemm_rows(method, [bf16, bf16], amx=True) == 8
        assert bf16_gemm_rows(method, [bf16], amx=False) == 0  # emulated bf16: slower
        assert bf16_gemm_rows(method, [f16], amx=True) == 0  # F16 values do not fit bf16
        assert bf16_gemm_rows(method, [f16, q4k], amx=True) == 0  # one path for a fused one
    # Quantized blocks (dequantized to bf16 a panel at a time) from 64 rows, under `gguf` only.
    q8, iq4 = int(T.Q8_0), int(T.IQ4_XS)
    for types in ([q4k], [q8], [q4k, q8], [iq4], [bf16, q4k]):
        assert bf16_gemm_rows("gguf", types, amx=True) == BLOCK_GEMM_MIN_ROWS == 64, types
        assert bf16_gemm_rows("gguf", types, amx=False) == 0, types
        assert bf16_gemm_rows(SIXTEEN_BIT, types, amx=True) == 0, types
    assert bf16_gemm_rows("gguf", [int(T.F32)], amx=True) == 0  # exact fp32 rows
    for method in ("gguf-float", "gguf-int8", "none"):
        for types in ([bf16], [q4k], [q8]):  # the exact or integer sums asked for
            assert bf16_gemm_rows(method, types, amx=True) == 0
    # This CPU's answer: AMX as torch reports it, unless the instruction set is held below it.
    monkeypatch.delenv("ZLLM_CPU_ISA", raising=False)
    amx = cpu_kernels.cpu_isa() != "avx2" and torch.cpu._is_amx_tile_supported()
    assert cpu_has_amx_bf16() == amx
    assert bf16_gemm_rows(SIXTEEN_BIT, [bf16]) == (8 if amx else 0)
    previous = cpu_kernels.cpu_isa()
    try:
        cpu_kernels.set_cpu_isa("avx2")
        assert not cpu_has_amx_bf16() and bf16_gemm_rows(SIXTEEN_BIT, [bf16]) == 0
    finally:
        cpu_kernels.set_cpu_isa(previous)
    for held in ("avx2", "avx512vnni"):  # ZLLM_CPU_ISA names a set without AMX
        monkeypatch.setenv("ZLLM_CPU_ISA", held)
        assert not cpu_has_amx_bf16()


def test_modules_take_the_bf16_gemm_from_their_rows() -> None:
    """With the rule on (set here on any CPU: torch's bf16 GEMM runs everywhere, on AMX tiles
    where the CPU has them), a BF16 matmul's calls of 8+ rows are x rounded to bf16, fp32
    sums, the output rounded to bf16: within bf16's rounding of the float kernel's fp32 sums;
    calls under 8 rows are the float kernel's bits. A fused matmul of BF16 parts does the
    same per part."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(48, 256, generator=gen) * 0.05).to(torch.bfloat16)
    rows16 = w.view(torch.uint8).reshape(48, 512)
    bias = torch.randn(48, generator=gen)
    layer = GGUFLinear(rows16, int(T.BF16), 256, bias, "gguf-float")
    split = GGUFSplitLinear(
        [(rows16[:16], int(T.BF16)), (rows16[16:], int(T.BF16))], 256, bias, "gguf-float"
    )
    assert layer.bf16_gemm_rows == split.bf16_gemm_rows == 0  # gguf-float: never
    layer.bf16_gemm_rows = split.bf16_gemm_rows = BF16_GEMM_MIN_ROWS
    for rows in (1, 7, 8, 40):
        x = torch.randn(rows, 256, generator=gen)
        exact = cpu_kernels.gguf_linear(x, rows16, int(T.BF16)) + bias
        gemm = torch.nn.functional.linear(x.bfloat16(), w).float() + bias
        for module in (layer, split):
            y = module(x)
            if rows < BF16_GEMM_MIN_ROWS:
                assert torch.equal(y, exact), rows
            else:
                assert torch.equal(y, gemm), rows
                assert not torch.equal(y, exact)
                scale = (x.abs() @ w.float().abs().t()).max()
                assert (y - exact).abs().max() <= 2**-7 * scale, rows


GEMM_TYPES = [T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0, T.Q4_0, T.Q5_0, T.IQ4_XS, T.BF16]


@pytest.mark.parametrize("ggml_type", GEMM_TYPES, ids=lambda t: t.name)
def test_the_panel_gemm_is_the_bf16_product_of_the_files_values(ggml_type) -> None:
    """gguf_linear_bf16_into: x and the dequantized weights rounded to bf16, fp32 sums, the
    output rounded to bf16: within one bf16 rounding of the fp32 product of the rounded
    operands, at a row count of each kind (one, a panel's tail of 100 - 64 weight rows, many),
    into a column slice of a wider output; and a matrix of one panel, which two threads
    multiply whole."""
    gen = torch.Generator().manual_seed(int(ggml_type))
    for N in (100, 40):  # two panels, the second partial; one (fewer than the threads)
        _check_panel_gemm(ggml_type, N, 512, gen)


def _check_panel_gemm(ggml_type, N: int, K: int, gen: torch.Generator) -> None:
    if ggml_type == T.BF16:
        w = (torch.randn(N, K, generator=gen) * 0.05).to(torch.bfloat16)
        blocks = w.view(torch.uint8).reshape(N, 2 * K)
    elif ggml_type in (T.Q8_0, T.Q4_0, T.Q5_0):
        from gguf.quants import quantize

        w = (torch.randn(N, K, generator=gen) * 0.05).numpy()
        blocks = torch.from_numpy(quantize(w, ggml_type))
    else:
        rng = np.random.default_rng(int(ggml_type))
        blocks = torch.from_numpy(random_blocks((N, K), ggml_type, rng))
    values = cpu_kernels.gguf_dequantize(blocks, int(ggml_type), K)
    for rows in (1, 70, 130):
        x = torch.randn(rows, K, generator=gen)
        wide = torch.full((rows, N + 8), 7.0)
        cpu_kernels.gguf_linear_bf16_into(x.bfloat16(), blocks, int(ggml_type), wide[:, 4 : 4 + N])
        y = wide[:, 4 : 4 + N]
        assert torch.all(wide[:, :4] == 7.0) and torch.all(wide[:, 4 + N :] == 7.0)
        product = x.bfloat16().float() @ values.bfloat16().float().t()
        scale = (x.abs() @ values.abs().t()).max()
        assert (y - product).abs().max() <= 2**-8 * product.abs().max() + 1e-5 * scale, rows
        assert torch.equal(y, y.bfloat16().float())  # each output rounded to bf16
        exact = x @ values.t()
        assert (y - exact).abs().max() <= 2**-6 * scale, rows


def test_the_panel_gemm_keeps_a_damaged_blocks_nan() -> None:
    """A block whose fp16 scale is NaN (a damaged file) gives NaN outputs, as the float
    kernel's do, not a number the rounding to bf16 made up."""
    from gguf.quants import quantize

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)).numpy()
    blocks = torch.from_numpy(quantize(w, T.Q8_0)).clone()
    blocks[3, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # d = fp16 NaN (0x7E00)
    x = torch.randn(2, 64)
    y = torch.empty(2, 8)
    cpu_kernels.gguf_linear_bf16_into(x.bfloat16(), blocks, int(T.Q8_0), y)
    assert torch.isnan(y[:, 3]).all() and not torch.isnan(y[:, [0, 1, 2, 4, 5, 6, 7]]).any()
    assert torch.isnan(cpu_kernels.gguf_linear(x, blocks, int(T.Q8_0))[:, 3]).all()


def test_modules_take_the_panel_gemm_from_64_rows() -> None:
    """With the rule on (set here on any CPU: torch's bf16 GEMM runs everywhere), a Q4_K
    matmul's calls of 64+ rows are the panel GEMM's bits, fewer rows keep the integer (or
    float) path; a fused matmul of Q4_K and Q6_K parts does the same per part."""
    rng = np.random.default_rng(9)
    q4k = torch.from_numpy(random_blocks((96, 256), T.Q4_K, rng))
    q6k = torch.from_numpy(random_blocks((32, 256), T.Q6_K, rng))
    layer = GGUFLinear(q4k, int(T.Q4_K), 256, None, "gguf")
    split = GGUFSplitLinear([(q4k, int(T.Q4_K)), (q6k, int(T.Q6_K))], 256, None, "gguf")
    layer.bf16_gemm_rows = split.bf16_gemm_rows = BLOCK_GEMM_MIN_ROWS
    gen = torch.Generator().manual_seed(9)
    for rows in (1, 63, 64, 90):
        x = torch.randn(rows, 256, generator=gen)
        gemm = torch.empty(rows, 128)
        cpu_kernels.gguf_linear_bf16_into(x.bfloat16(), q4k, int(T.Q4_K), gemm[:, :96])
        cpu_kernels.gguf_linear_bf16_into(x.bfloat16(), q6k, int(T.Q6_K), gemm[:, 96:])
        if rows >= BLOCK_GEMM_MIN_ROWS:
            assert torch.equal(layer(x), gemm[:, :96]) and torch.equal(split(x), gemm), rows
        else:
            assert not torch.equal(layer(x), gemm[:, :96]), rows
            integer = layer.int8_activations and rows <= layer.int8_max_rows
            kernel = cpu_kernels.gguf_linear_int8 if integer else cpu_kernels.gguf_linear
            assert torch.equal(layer(x), kernel(x, q4k, int(T.Q4_K))), rows


@pytest.fixture(scope="module")
def q4k_gguf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("arith") / "q4k.gguf"
    write_llama_gguf(path, lambda name: T.Q4_K)
    return str(path)


def test_the_default_for_a_gguf_file_is_the_fastest_arithmetic_on_this_cpu(q4k_gguf) -> None:
    """The engine picks `gguf` unasked; its K-quant matmuls decode with integer dots (llama.cpp's
    arithmetic), which differ from gguf-float's by a rounding of x, not by the tokens' order of
    likelihood on this model's first steps."""
    default = tiny_llm(q4k_gguf)
    exact = tiny_llm(q4k_gguf, quantization="gguf-float")
    assert default.model_runner.quantization == "gguf"
    assert exact.model_runner.quantization == "gguf-float"
    limit = FASTEST_INTEGER_ROWS[cpu_kernels.cpu_isa()][int(T.Q4_K)]
    qkv = default.model_runner.model.layers[0].self_attn.qkv_proj
    assert qkv.int8_activations and qkv.int8_max_rows == limit
    assert not exact.model_runner.model.layers[0].self_attn.qkv_proj.int8_activations
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 77, 300, 12, 9]}]
    a = default.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = exact.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    first = a.token_ids[0]
    assert first == b.token_ids[0]
    drift = abs(a.logprobs[0][first].logprob - b.logprobs[0][first].logprob)
    assert 0 < drift < 0.25  # the decode step did take the other arithmetic, and stayed close


def test_deterministic_runs_take_the_float_kernel(q4k_gguf) -> None:
    """--deterministic needs a row's result not to depend on the call's size, which the
    default's per-size choice breaks: it gets gguf-float, and an explicit gguf is refused."""
    llm = tiny_llm(q4k_gguf, deterministic=True)
    assert llm.model_runner.quantization == "gguf-float"
    for method in ("gguf", "gguf-int8"):
        with pytest.raises(ValueError, match=f"cannot use {method} .*use gguf-float"):
            EngineArgs(q4k_gguf, deterministic=True, quantization=method).create_engine_config()


def test_a_gguf_name_on_a_directory_is_refused_at_start(tiny_llama_dir) -> None:
    for method in ("gguf", "gguf-float", "gguf-int8"):
        with pytest.raises(
            ValueError,
            match=f"--quantization {method} reads a GGUF file's blocks; .* is not a GGUF file",
        ):
            EngineArgs(tiny_llama_dir, quantization=method).create_engine_config()


def test_gguf_int8_on_a_file_without_integer_types_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f16.gguf"
    write_llama_gguf(path, lambda name: T.F16)
    with pytest.raises(
        ValueError, match=r"gguf-int8 has no integer path .*\(F16\); use gguf or gguf-float"
    ):
        tiny_llm(str(path), quantization="gguf-int8")
    assert tiny_llm(str(path)).model_runner.quantization == "gguf"  # served, float dots
