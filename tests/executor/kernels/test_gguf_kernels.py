"""csrc/cpu/gguf_linear.cpp, gguf_lowbit.h, gguf_lattice.h: matmuls on GGUF blocks (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4; IQ1_S, IQ1_M, IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0, NVFP4), and the engine's use of them.

The kernel must multiply by the fp32 weights gguf.quants dequantizes (dequantization bit for
bit; the few-rows path applies each block's scale to its dot product, so its rounding differs),
for every type and row count (register tiles of 1-4 rows, 2 and 3 weight rows, remainders),
and the engine must pick it by default for a GGUF file on CPU without changing any greedy
output, holding no fp32 copy of what the blocks serve (the weights take the file's size).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize, quantize
from gguf_files import random_blocks
from parity import without_block_gemms
from resident_memory import resident_after_load

from zllm import LLM, SamplingParams
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels.gguf_arithmetic import ALL_ROWS, INT8_MAX_ROWS, cpu_has_amx_bf16
from zllm.executor.layers.linear.gguf import GGUFEmbedding, GGUFLinear, GGUFSplitLinear

T = GGMLQuantizationType
LOW_BIT = [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]  # csrc/cpu/gguf_lowbit.h
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, *LOW_BIT, T.F16, T.BF16]
# csrc/cpu/gguf_lattice.h: tested on their own (test_lattice_types_match_float64), not through
# every TYPES test: the suite's time.
LATTICE = [
    T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
    T.TQ1_0, T.TQ2_0, T.NVFP4,
]  # fmt: skip
SIXTEEN_BIT = (T.F16, T.BF16)  # plain 16-bit values, read in runs of 32
# What gguf_linear_int8 reads (the other low-bit types have no integer path: the float kernel).
NO_INT8_LOW_BIT = [t for t in LOW_BIT if t not in (T.Q2_K, T.Q3_K)]
INT8_TYPES = [t for t in TYPES if t not in SIXTEEN_BIT and t not in NO_INT8_LOW_BIT]


def test_the_types_are_the_ones_the_kernel_reads():
    assert sorted(cpu_kernels.SUPPORTED_GGML_TYPES) == sorted(int(t) for t in TYPES + LATTICE)
    assert all(cpu_kernels.SUPPORTED_GGML_TYPES[int(t)] == t.name for t in TYPES + LATTICE)
    assert cpu_kernels.INT8_GGML_TYPES == {int(t) for t in INT8_TYPES}


def _blocks(rows: int, blocks_per_row: int, ggml_type, seed: int):
    """(blocks [rows, bytes per row], gguf-py's fp32 dequantization [rows, K], K): quantized by
    gguf-py where it can (the 32-value types), else random blocks with sane fp16 scales."""
    cols = blocks_per_row * max(GGML_QUANT_SIZES[ggml_type][0], 32)
    rng = np.random.default_rng(seed)
    try:
        q = quantize(rng.standard_normal((rows, cols)).astype(np.float32), ggml_type)
    except NotImplementedError:  # K-quants: gguf-py only dequantizes them
        q = random_blocks((rows, cols), ggml_type, rng)
    q = q.view(np.uint8).reshape(rows, -1)  # F16/BF16 come back as 16-bit values
    ref = dequantize(q, ggml_type).reshape(rows, cols).astype(np.float32)
    assert np.isfinite(ref).all() and ref.std() > 0
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(ref), cols


@pytest.mark.parametrize("ggml_type", TYPES + LATTICE, ids=lambda t: t.name)
def test_dequantize_is_bit_exact(ggml_type):
    q, ref, cols = _blocks(37, 3, ggml_type, seed=1)
    assert torch.equal(cpu_kernels.gguf_dequantize(q, int(ggml_type), cols), ref)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 24, 33, 70, 150, 300])
def test_linear_matches_fp32_matmul(ggml_type, rows):
    # 37 output rows: panels of 3 (5-15 rows) and 12 (16 on) leave a remainder; K is 5 blocks.
    # From 16 rows: 16-row blocks, with a last block of 1-8 rows (17, 24) or 9-15 (33, 70);
    # 70 and 150 cross the K-quants' 64-row chunks (K = 1280), 300 the 256-row chunks at K = 160.
    q, ref, cols = _blocks(37, 5, ggml_type, seed=rows)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    out = cpu_kernels.gguf_linear(x, q, int(ggml_type))
    expected = (x.double() @ ref.double().T).float()
    assert out.shape == (rows, 37)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * max(scale, 1.0))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_linear_reads_strided_input_rows(ggml_type):
    """x may be a column slice of a wider tensor (rows ldx apart, ldx > K): every path (the
    few-rows kernel at 1-4 rows, the panel beyond) gives the bits the contiguous copy gives,
    with an odd block count (the last block has no pair)."""
    q, _, cols = _blocks(19, 3, ggml_type, seed=21)
    wide = torch.randn(40, cols + 40, generator=torch.Generator().manual_seed(21))
    for rows in [*range(1, 7), 17, 40]:  # few rows, dot-product tiles, outer-product tiles
        x = wide[:rows, 24 : 24 + cols]
        assert x.stride(0) == cols + 40
        out = cpu_kernels.gguf_linear(x, q, int(ggml_type))
        assert torch.equal(out, cpu_kernels.gguf_linear(x.contiguous(), q, int(ggml_type)))


# Row counts the few-rows kernel takes per type (csrc/cpu/gguf_linear.cpp, few_rows_kernel).
FEW_ROWS_MAX = {T.Q5_0: 2, T.Q5_1: 2, T.Q6_K: 2, T.Q2_K: 2, T.Q3_K: 2}


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_decode_sized_calls_take_the_few_rows_kernel(ggml_type):
    """The few-rows kernel computes each row alone, so a row's bits do not depend on how many
    rows share the call, up to the type's limit; the panel path beyond it rounds differently
    (so a dispatch that sent small calls to the panel would show here)."""
    q, _, cols = _blocks(23, 3, ggml_type, seed=31)
    limit = FEW_ROWS_MAX.get(ggml_type, 4)
    wide = (T.F16, T.BF16, T.Q4_0, T.Q8_0)
    if ggml_type in wide and cpu_kernels.cpu_isa() == "avx512vnni":
        limit = 8  # csrc/cpu/dense_rows.h takes 16-bit rows and 32-value blocks at 1-8 rows
    x = torch.randn(limit + 1, cols, generator=torch.Generator().manual_seed(31))
    alone = cpu_kernels.gguf_linear(x[:1], q, int(ggml_type))[0]
    for rows in range(2, limit + 1):
        assert torch.equal(cpu_kernels.gguf_linear(x[:rows], q, int(ggml_type))[0], alone)
    assert not torch.equal(cpu_kernels.gguf_linear(x[: limit + 1], q, int(ggml_type))[0], alone)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_panel_rows_do_not_depend_on_the_rows_beside_them(ggml_type):
    """From 16 rows each output is one lane's sum over K in order: a row's bits are the same
    whatever block, lane or chunk it lands in (batch sizes of a prefill or a large decode
    step), so a sequence's numbers do not change with what shares its step."""
    q, _, cols = _blocks(29, 3, ggml_type, seed=41)
    x = torch.randn(300, cols, generator=torch.Generator().manual_seed(41))
    full = cpu_kernels.gguf_linear(x, q, int(ggml_type))
    for start, rows in [(0, 16), (5, 17), (100, 40), (280, 20), (3, 297)]:
        part = cpu_kernels.gguf_linear(x[start : start + rows], q, int(ggml_type))
        assert torch.equal(part, full[start : start + rows]), (start, rows)


@pytest.mark.parametrize("rows", [1, 2, 6, 16, 17, 40])  # few-rows, dot tiles, outer tiles
def test_linear_into_writes_only_its_columns_of_a_wider_output(rows):
    """A fused matmul of parts in different types writes each part's columns in place."""
    q5, ref5, _ = _blocks(24, 8, T.Q5_0, seed=8)
    q6, ref6, _ = _blocks(16, 1, T.Q6_K, seed=9)
    q8, ref8, _ = _blocks(8, 8, T.Q8_0, seed=10)  # 1-2 rows: Q8_0's register path
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=generator)
    y = torch.full((rows, 58), float("nan"))
    cpu_kernels.gguf_linear_into(x, q5, int(T.Q5_0), y[:, 3:27])
    cpu_kernels.gguf_linear_into(x, q6, int(T.Q6_K), y[:, 27:43])
    cpu_kernels.gguf_linear_into(x, q8, int(T.Q8_0), y[:, 43:51])
    ref = torch.cat([ref5, ref6, ref8])
    torch.testing.assert_close(y[:, 3:51], x @ ref.T, rtol=1e-5, atol=1e-4)
    assert y[:, :3].isnan().all() and y[:, 51:].isnan().all()
    parts = [(q5, int(T.Q5_0)), (q6, int(T.Q6_K)), (q8, int(T.Q8_0))]
    layer = GGUFSplitLinear(parts, 256, torch.ones(48))
    x3 = torch.randn(2, rows, 256, generator=generator)
    torch.testing.assert_close(layer(x3), x3 @ ref.T + 1, rtol=1e-5, atol=1e-4)


def test_an_empty_sum_is_zero():
    """K = 0 (no input features): y is zeros, not a division by zero in the chunk sizes."""
    q = torch.empty(3, 0, dtype=torch.uint8)
    for rows in (1, 6, 16):
        y = cpu_kernels.gguf_linear(torch.empty(rows, 0), q, int(T.Q4_1))
        assert y.shape == (rows, 3) and not y.any()


# The float kernel has one code path on every CPU; the ISA switch (AVX-512 VNNI or AVX2)
# must not change what it computes. Both run here (as for the int8 K-quants below).
FLOAT_ISAS = ("avx2", "auto")


@pytest.mark.parametrize("ggml_type", LOW_BIT, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 1), (8, 2), (37, 5), (70, 3)], ids=str)
def test_low_bit_types_match_float64_on_both_isas(ggml_type, shape, restore_cpu_isa):
    """Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4: the kernel reads the blocks in place and computes
    x @ W^T within fp32 rounding of float64 over gguf-py's dequantization, for one output
    row and many, one block per row and several, batch 1 (decode) to 40 (the panels), with
    AVX2 forced and with the CPU's best; both give the same bits."""
    out_rows, blocks_per_row = shape
    q, ref, cols = _blocks(out_rows, blocks_per_row, ggml_type, seed=out_rows + blocks_per_row)
    for rows in (1, 2, 3, 4, 7, 16, 40):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        expected = x.double() @ ref.double().T
        outs = []
        for isa in FLOAT_ISAS:
            cpu_kernels.set_cpu_isa(isa)
            outs.append(cpu_kernels.gguf_linear(x, q, int(ggml_type)))
        assert torch.equal(outs[0], outs[1]), rows
        scale = expected.abs().max().item()
        torch.testing.assert_close(outs[0].double(), expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("ggml_type", LATTICE, ids=lambda t: t.name)
def test_lattice_types_match_float64(ggml_type, restore_cpu_isa):
    """IQ1-IQ3, TQ1_0, TQ2_0, NVFP4 read in place: x @ W^T within fp32 rounding of float64 over
    gguf-py's dequantization at 1-4 rows (the few-rows kernel: each row's bits the same alone
    or with others) and 9 (the panel, which rounds otherwise), one block per row and several,
    the same bits with AVX2 forced as with the CPU's best."""
    for out_rows, blocks_per_row in ((1, 1), (37, 3)):
        q, ref, cols = _blocks(out_rows, blocks_per_row, ggml_type, seed=out_rows)
        x = torch.randn(9, cols, generator=torch.Generator().manual_seed(blocks_per_row))
        expected = x.double() @ ref.double().T
        scale = expected.abs().max().item()
        alone = cpu_kernels.gguf_linear(x[:1], q, int(ggml_type))
        for rows in (1, 2, 3, 4, 9):
            outs = []
            for isa in FLOAT_ISAS:
                cpu_kernels.set_cpu_isa(isa)
                outs.append(cpu_kernels.gguf_linear(x[:rows], q, int(ggml_type)))
            assert torch.equal(outs[0], outs[1]), rows
            torch.testing.assert_close(
                outs[0].double(), expected[:rows], rtol=1e-5, atol=1e-5 * scale
            )
            if out_rows > 1:  # each row alone in the few-rows kernel; the panel rounds otherwise
                assert torch.equal(outs[0][:1], alone) == (rows <= 4), rows


def test_lattice_types_are_refused_until_gguf_py_hands_over_the_grids():
    """The grids come from gguf-py at load (executor/kernels/cpu.py); a library not given
    them refuses the lattice types with a message saying so, and reads the others."""
    code = (
        "import torch\n"
        "from zllm.executor.kernels import cpu as k\n"
        "k.hand_lattice_tables = lambda module: None\n"
        "x = torch.zeros(1, 256)\n"
        "print(k.gguf_linear(x, torch.zeros(1, 136, dtype=torch.uint8), 23).shape)\n"  # IQ4_XS
        "k.gguf_linear(x, torch.zeros(1, 66, dtype=torch.uint8), 16)\n"  # IQ2_XXS
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "torch.Size([1, 1])" in out.stdout
    assert "ggml type 16 needs its lattice grid, which set_lattice_tables" in out.stderr


def test_low_bit_types_have_no_integer_path():
    """gguf-int8 sends them to the float kernel (the modules never call the integer one,
    which refuses them)."""
    for ggml_type in NO_INT8_LOW_BIT + LATTICE:
        q, _, cols = _blocks(4, 1, ggml_type, seed=2)
        layer = GGUFLinear(q, int(ggml_type), cols, None, arithmetic="gguf-int8")
        assert not layer.int8_activations
        x = torch.randn(1, cols)
        assert torch.equal(layer(x), cpu_kernels.gguf_linear(x, q, int(ggml_type)))
        with pytest.raises(RuntimeError, match="has no integer path"):
            cpu_kernels.gguf_linear_int8(x, q, int(ggml_type))


# ---- gguf-int8: x rounded to int8 per 32 values, integer dot products (csrc/cpu/gguf_int8.h)


# Q2_K, Q3_K, Q4_K and Q6_K round x per 256 values (csrc/cpu/kquant_int8.h).
KQUANT = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q6_K)


def _int8_activations(x: np.ndarray, values: int = 32) -> np.ndarray:
    """x as the kernel rounds it: per `values` values, scale max|x| / 127, codes round-half-even
    of x * (127 / max|x|) in fp32; returned as scale * code in float64."""
    blocks = x.reshape(x.shape[0], -1, values)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    codes = np.rint(blocks * np.where(amax > 0, inverse, np.float32(0)))
    return (codes.astype(np.float64) * (amax / np.float32(127))).reshape(x.shape)


def _offset_values(ggml_type) -> int:
    """How many values share an offset: 16 for Q2_K, 32 for the others."""
    return 16 if ggml_type == T.Q2_K else 32


def _block_offsets(q: np.ndarray, ggml_type, rows: int, cols: int) -> np.ndarray:
    """The offset b of each group of _offset_values (value = a * code + b): Q4_1/Q5_1's m, the
    K-quants' -dmin * min; 0 for the others. [rows, cols / group]."""
    blocks = q.reshape(-1, GGML_QUANT_SIZES[ggml_type][1])
    if ggml_type == T.Q2_K:
        dmin = blocks[:, 82:84].copy().view(np.float16).astype(np.float32)
        b = -(dmin * (blocks[:, :16] >> 4).astype(np.float32))
        return b.reshape(rows, cols // 16).astype(np.float64)
    if ggml_type in (T.Q4_1, T.Q5_1):
        b = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    elif ggml_type in (T.Q4_K, T.Q5_K):
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        _, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        b = -(dmin * mins.astype(np.float32))
    else:
        return np.zeros((rows, cols // 32))
    return b.reshape(rows, cols // 32).astype(np.float64)


@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 70])
def test_int8_linear_computes_the_int8_formula(ggml_type, rows):
    """sum_k value_k x_k with value_k = a c_k + b: a * dx * sum c qx (integers) + b * sum x
    (x's exact block sums), against that formula in float64; and near the fp32 matmul."""
    q, ref, cols = _blocks(37, 5, ggml_type, seed=rows)  # 37 rows: panels of 4 + a remainder
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    out = cpu_kernels.gguf_linear_int8(x, q, int(ggml_type)).double().numpy()
    xd, w = x.double().numpy(), ref.double().numpy()
    x_int8 = _int8_activations(x.numpy(), 256 if ggml_type in KQUANT else 32)
    offsets = _block_offsets(q.numpy(), ggml_type, 37, cols)
    group = _offset_values(ggml_type)
    expected = x_int8 @ w.T + (xd - x_int8).reshape(rows, -1, group).sum(-1) @ offsets.T
    scale = np.abs(expected).max()
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5 * scale)
    exact = xd @ w.T
    assert np.abs(out - exact).max() < 0.05 * np.abs(exact).max()  # int8 rounding, ~1%
    y = torch.full((rows, 40), float("nan"))
    cpu_kernels.gguf_linear_int8(x, q, int(ggml_type), y[:, 2:39])  # into a column slice
    np.testing.assert_array_equal(y[:, 2:39].double().numpy(), out)
    assert y[:, :2].isnan().all() and y[:, 39:].isnan().all()


@pytest.mark.parametrize(
    "ggml_type", [T.Q4_0, T.Q8_0, T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name
)
def test_int8_linear_keeps_nan_and_tiny_blocks(ggml_type):
    """A NaN or infinity in x makes its rows' outputs NaN (as the float kernel's), not a
    finite number from saturated codes; a block of subnormals rounds to zero."""
    q, ref, cols = _blocks(6, 2, ggml_type, seed=13)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(13))
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, : 256 if ggml_type in KQUANT else 32] = 1e-39  # a block below FLT_MIN
    out = cpu_kernels.gguf_linear_int8(x, q, int(ggml_type))
    assert out[:2].isnan().all()
    torch.testing.assert_close(out[2], x[2] @ ref.T, rtol=0.05, atol=0.05)


# The K-quants above have an AVX-512 VNNI variant (csrc/cpu/kquant_int8.h), taken where the CPU has
# the features unless $ZLLM_CPU_ISA / set_cpu_isa forces AVX2: both paths run here.
ISAS = ("avx2", "auto")


@pytest.fixture
def restore_cpu_isa():
    before = cpu_kernels.cpu_isa()
    yield
    cpu_kernels.set_cpu_isa(before)


def _kquant_expected(q, ref, x, ggml_type) -> np.ndarray:
    """The int8 formula of test_int8_linear_computes_the_int8_formula, in float64."""
    rows, cols = x.shape
    x_int8 = _int8_activations(x.numpy(), 256)
    offsets = _block_offsets(q.numpy(), ggml_type, q.shape[0], cols)
    xd = x.double().numpy()
    group = _offset_values(ggml_type)
    return (
        x_int8 @ ref.double().numpy().T + (xd - x_int8).reshape(rows, -1, group).sum(-1) @ offsets.T
    )


@pytest.mark.parametrize("ggml_type", KQUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks_per_row", [1, 3, 5])
def test_kquant_int8_avx512_path_equals_the_avx2_path(ggml_type, blocks_per_row, restore_cpu_isa):
    """Same int32 sums per super-block in the same 8 lanes, the same float tail: the outputs
    are equal bit for bit, at every row count the modules send (1-16: passes of 1-8 rows),
    an odd number of super-blocks and of weight rows; both equal the formula."""
    q, ref, cols = _blocks(37, blocks_per_row, ggml_type, seed=20 + blocks_per_row)
    for rows in range(1, 17):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        x[0] *= 1e4  # one row's scale far from the others' (a scale per row and super-block)
        outs = []
        for isa in ISAS:
            cpu_kernels.set_cpu_isa(isa)
            outs.append(cpu_kernels.gguf_linear_int8(x, q, int(ggml_type)))
        assert torch.equal(outs[0], outs[1]), rows
        expected = _kquant_expected(q, ref, x, ggml_type)
        for r in range(rows):  # rows' magnitudes differ: each against its own scale
            np.testing.assert_allclose(
                outs[1][r].double().numpy(),
                expected[r],
                rtol=0,
                atol=1e-5 * np.abs(expected[r]).max(),
            )


@pytest.mark.parametrize("ggml_type", KQUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", ISAS)
def test_kquant_int8_rows_do_not_depend_on_the_call_size(ggml_type, isa, restore_cpu_isa):
    """A prefill-sized call (tiles of 16 weight rows that passes of 4 or 8 x rows meet in
    turn, x in blocks of 204 or 200 rows at K = 1,280) gives each row the bits it gets alone,
    on both paths."""
    cpu_kernels.set_cpu_isa(isa)
    q, _, cols = _blocks(37, 5, ggml_type, seed=31)
    x = torch.randn(211, cols, generator=torch.Generator().manual_seed(31))
    out = cpu_kernels.gguf_linear_int8(x, q, int(ggml_type))
    for r in (0, 3, 4, 5, 7, 8, 9, 199, 200, 203, 204, 207, 210):  # pass and block edges
        assert torch.equal(out[r], cpu_kernels.gguf_linear_int8(x[r : r + 1], q, int(ggml_type))[0])
    assert torch.equal(out[200:211], cpu_kernels.gguf_linear_int8(x[200:211], q, int(ggml_type)))


@pytest.mark.parametrize("ggml_type", KQUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", ISAS)
def test_kquant_int8_keeps_nan_and_tiny_blocks_on_both_paths(ggml_type, isa, restore_cpu_isa):
    """As test_int8_linear_keeps_nan_and_tiny_blocks, on each path, for every pass size."""
    cpu_kernels.set_cpu_isa(isa)
    q, ref, cols = _blocks(6, 3, ggml_type, seed=13)
    for rows in (3, 4, 7):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        x[0, 5] = float("nan")
        x[1, 300] = float("inf")  # the second super-block
        x[2, 256:512] = 1e-39  # a super-block below FLT_MIN: rounds to zero
        out = cpu_kernels.gguf_linear_int8(x, q, int(ggml_type))
        assert out[:2].isnan().all() and not out[2:].isnan().any()
        kept = x[2].clone()
        kept[256:512] = 0
        torch.testing.assert_close(out[2], kept @ ref.T, rtol=0.05, atol=0.05)


def test_the_avx512_path_is_taken_exactly_where_the_cpu_has_it(restore_cpu_isa):
    """auto picks avx512vnni iff Linux lists AVX-512 F, BW, VL and VNNI (the library asks CPUID
    itself: two readings that must agree); avx2 can always be forced, avx512vnni only there;
    $ZLLM_CPU_ISA sets the choice a process starts with, and a bad value is refused at load."""
    has = cpu_kernels.cpu_has_avx512_vnni()
    assert cpu_kernels.set_cpu_isa("auto") == cpu_kernels.cpu_isa()
    assert cpu_kernels.cpu_isa() == ("avx512vnni" if has else "avx2")
    assert cpu_kernels.set_cpu_isa("avx2") == cpu_kernels.cpu_isa() == "avx2"
    if has:
        assert cpu_kernels.set_cpu_isa("avx512vnni") == "avx512vnni"
    else:
        with pytest.raises(RuntimeError, match="avx512vnni"):
            cpu_kernels.set_cpu_isa("avx512vnni")
        assert cpu_kernels.cpu_isa() == "avx2"
    with pytest.raises(RuntimeError, match="expected auto"):
        cpu_kernels.set_cpu_isa("avx512")
    code = "from zllm.executor.kernels import cpu as k; print(k.cpu_isa())"
    for value, expected in (("avx2", "avx2"), ("auto", "avx512vnni" if has else "avx2")):
        env = {**os.environ, "ZLLM_CPU_ISA": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.split()[-1] == expected, out.stderr[-2000:]
    env = {**os.environ, "ZLLM_CPU_ISA": "sse2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "ZLLM_CPU_ISA='sse2'" in out.stderr


def test_gguf_int8_modules_take_the_integer_path_for_few_rows_or_k_quants():
    q, ref, _ = _blocks(12, 4, T.Q4_0, seed=11)
    q8, _, _ = _blocks(5, 4, T.Q8_0, seed=12)
    bias = torch.randn(12)
    layer = GGUFLinear(q, int(T.Q4_0), 128, bias, arithmetic="gguf-int8")
    split = GGUFSplitLinear([(q, int(T.Q4_0)), (q8, int(T.Q8_0))], 128, None, "gguf-int8")
    for rows in (1, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 128)
        kernel = cpu_kernels.gguf_linear_int8 if rows <= INT8_MAX_ROWS else cpu_kernels.gguf_linear
        assert torch.equal(layer(x), kernel(x, q, int(T.Q4_0)) + bias)
        both = torch.cat([kernel(x, q, int(T.Q4_0)), kernel(x, q8, int(T.Q8_0))], dim=1)
        assert torch.equal(split(x), both)
    # Q4_K / Q6_K matmuls take the integer path at every size (their super-block kernel
    # outruns the float one in prefills too).
    qk, _, _ = _blocks(6, 1, T.Q4_K, seed=14)
    kquant = GGUFLinear(qk, int(T.Q4_K), 256, None, arithmetic="gguf-int8")
    assert kquant.int8_max_rows == ALL_ROWS >= 1 << 20
    for rows in (1, 16, 17, 300):
        x = torch.randn(rows, 256)
        assert torch.equal(kquant(x), cpu_kernels.gguf_linear_int8(x, qk, int(T.Q4_K)))
    # 16-bit weights keep float dot products (the integer kernel reads quantized types).
    q16, _, _ = _blocks(7, 4, T.BF16, seed=13)
    sixteen = GGUFLinear(q16, int(T.BF16), 128, None, arithmetic="gguf-int8")
    mixed = GGUFSplitLinear([(q, int(T.Q4_0)), (q16, int(T.BF16))], 128, None, "gguf-int8")
    assert not sixteen.int8_activations and not mixed.int8_activations
    x = torch.randn(1, 128)
    assert torch.equal(sixteen(x), cpu_kernels.gguf_linear(x, q16, int(T.BF16)))


def test_gguf_int8_engine_prefills_as_gguf_and_decodes_with_integer_dots(smollm2_path):
    """Prompt logprobs (every position's logits: many rows per call) are the float kernel's,
    so they equal gguf-float's; one sequence's decode steps and its last-position logits
    take the integer path and stay within a small logprob drift while the tokens agree."""
    exact = LLM(smollm2_path, max_num_seqs=4, quantization="gguf-float")
    int8 = LLM(smollm2_path, max_num_seqs=4, quantization="gguf-int8")
    assert int8.model_runner.quantization == "gguf-int8"
    model = int8.model_runner.model
    assert model.layers[0].self_attn.qkv_proj.int8_activations
    assert (
        model.logits_proj.int8_activations
        and not exact.model_runner.model.logits_proj.int8_activations
    )
    text = "Mixing paint is simple once you know the rules. The three primary colors are"
    prompt = {"prompt_token_ids": exact.get_tokenizer().encode(text)}
    assert len(prompt["prompt_token_ids"]) > INT8_MAX_ROWS
    params = SamplingParams(
        temperature=0.0, max_tokens=8, logprobs=1, prompt_logprobs=1, ignore_eos=True
    )
    a = exact.generate([prompt], params, use_tqdm=False)[0]
    b = int8.generate([prompt], params, use_tqdm=False)[0]
    assert a.prompt_logprobs == b.prompt_logprobs
    ids_a, ids_b = a.outputs[0].token_ids, b.outputs[0].token_ids
    agree = next(
        (i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=True)) if x != y), len(ids_a)
    )
    assert agree >= 2
    # Measured here: at most 0.11 nats over these tokens (BENCHMARKS.md: the mode's drift
    # against fp32 reaches p99 ~0.6 on SmolLM2's prompts). Which token drifts most moves
    # with any change upstream of the rounding to int8 (a kernel's summation order, the
    # row ops), so the bound leaves ~2x room rather than pinning today's values.
    for i in range(agree):
        drift = abs(
            a.outputs[0].logprobs[i][ids_a[i]].logprob - b.outputs[0].logprobs[i][ids_a[i]].logprob
        )
        assert drift < 0.25, (i, drift)
    assert any(
        a.outputs[0].logprobs[i][ids_a[i]].logprob != b.outputs[0].logprobs[i][ids_a[i]].logprob
        for i in range(agree)
    )  # the decode steps did take the other arithmetic


def test_linear_reads_strided_rows_and_rejects_bad_input():
    q, ref, _ = _blocks(8, 2, T.Q4_1, seed=3)
    wide = torch.randn(3, 128)
    x = wide[:, :64]  # rows 128 floats apart
    torch.testing.assert_close(cpu_kernels.gguf_linear(x, q, 3), x @ ref.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="row bytes"):
        cpu_kernels.gguf_linear(torch.randn(2, 96), q, 3)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        cpu_kernels.gguf_linear(torch.randn(2, 64), q, int(T.Q8_1))  # no reader (nor gguf-py)
    with pytest.raises(RuntimeError, match="row bytes"):  # Q4_K blocks hold 256 values
        cpu_kernels.gguf_linear(torch.randn(2, 64), q, int(T.Q4_K))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_kernels.gguf_linear_into(torch.randn(2, 64), q, 3, torch.empty(8, 2).T)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_kernels.gguf_linear(torch.randn(2, 64, dtype=torch.float64), q, 3)


def test_gguf_linear_module_serves_any_row_count_from_blocks_alone():
    q, ref, _ = _blocks(16, 2, T.Q8_0, seed=4)
    bias = torch.randn(16)
    layer = GGUFLinear(q, 8, 64, bias)
    assert [name for name, _ in layer.named_buffers()] == [] and not hasattr(layer, "weight")
    for shape in [(1, 64), (4, 64), (300, 64), (2, 700, 64)]:  # prefill-sized, and 3-D
        x = torch.randn(*shape)
        torch.testing.assert_close(layer(x), x @ ref.T + bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gguf_embedding_rows_are_the_tables_rows_bit_for_bit(ggml_type):
    q, ref, cols = _blocks(50, 2, ggml_type, seed=5)
    table = GGUFEmbedding(q, int(ggml_type), cols)
    ids = torch.tensor([[3, 0, 49], [3, 7, 7]])
    assert torch.equal(table(ids), torch.nn.functional.embedding(ids, ref))


def test_smollm2_defaults_to_gguf_blocks_with_identical_greedy_outputs(smollm2_path):
    gguf = LLM(smollm2_path, max_num_seqs=8)
    fp32 = LLM(smollm2_path, max_num_seqs=8, quantization="none")
    assert gguf.model_runner.quantization == "gguf"
    assert fp32.model_runner.quantization == "none"
    model = gguf.model_runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, GGUFLinear)
    assert isinstance(model.layers[-1].mlp.down_proj, GGUFLinear)
    assert model.logits_proj is not None and model.logits_proj.ggml_type == 8  # Q8_0 embedding
    # The tied embedding: one set of blocks for the lookup and the logits, no fp32 table.
    assert isinstance(model.embed_rows, GGUFEmbedding)
    assert model.embed_rows.qweight is model.logits_proj.qweight
    assert model.embed_tokens.numel() == 0
    # The blocks were never dequantized at load; the kernel multiplies by exactly the fp32
    # engine's weights.
    ref = fp32.model_runner.model
    for ours, theirs in zip(model.layers, ref.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            linear, weight = ours.get_submodule(name), theirs.get_submodule(name).weight
            dequantized = cpu_kernels.gguf_dequantize(
                linear.qweight, linear.ggml_type, weight.shape[1]
            )
            assert torch.equal(dequantized, weight), name
    embedding = model.embed_rows
    table = cpu_kernels.gguf_dequantize(
        embedding.qweight, embedding.ggml_type, embedding.embedding_dim
    )
    assert torch.equal(table, ref.embed_tokens)
    # With AMX the default's prefills take bf16 GEMMs (the file's values rounded to bf16:
    # test_gguf_arithmetic.py); here the kernels' fp32 sums over the blocks, exactly.
    assert (without_block_gemms(gguf) > 0) == cpu_has_amx_bf16()
    rng = np.random.default_rng(7)
    # A 300-token prompt prefills in one 300-row call of the kernel's panel path.
    lengths = [5, 40, 300, 12, 70, 3]
    prompts = [{"prompt_token_ids": rng.integers(256, 49000, n).tolist()} for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    a = gguf.generate(prompts, params, use_tqdm=False)
    b = fp32.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_matrices_the_kernel_reads_are_never_dequantized_at_load(smollm2_path, monkeypatch):
    """Only the tensors no kernel reads (SmolLM2: its F32 norms) are dequantized to fp32."""
    from zllm.executor.weights import loader

    dequantized = []

    def recording(data, ggml_type):
        dequantized.append(GGMLQuantizationType(ggml_type))
        return real(data, ggml_type)

    real = loader.dequantize
    monkeypatch.setattr(loader, "dequantize", recording)
    llm = LLM(smollm2_path, max_num_seqs=4)
    assert llm.model_runner.quantization == "gguf"
    assert set(dequantized) == {GGMLQuantizationType.F32}
    assert len(dequantized) == 1 + 2 * llm.config.arch.num_layers  # final norm, 2 per layer
    # --quantization none dequantizes every matrix.
    dequantized.clear()
    LLM(smollm2_path, max_num_seqs=4, quantization="none")
    assert {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0} <= set(dequantized)


def test_gguf_quantization_refuses_a_non_gguf_model(tiny_llama_dir):
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(tiny_llama_dir, quantization="gguf")
    # Unset: a Hugging Face directory simply runs fp32.
    assert LLM(tiny_llama_dir).model_runner.quantization == "none"


def test_smollm2_weights_take_the_file_size_in_memory(smollm2_path):
    """After load the executor holds at most the GGUF file + the KV pool + 100 MiB more than
    before loading weights; fp32 weights (quantization none) do not fit that bound."""
    bound = os.path.getsize(smollm2_path) + (64 << 20) + (100 << 20)
    blocks = resident_after_load(smollm2_path, "gguf")
    fp32 = resident_after_load(smollm2_path, "none")
    grown = {m["method"]: m["after"] - m["before"] for m in (blocks, fp32)}
    print(f"resident growth at load: {grown}, bound {bound}")
    assert grown["gguf"] <= bound
    assert grown["none"] > bound
