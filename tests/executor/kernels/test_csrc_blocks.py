"""The GPU's block-quantized matmuls (csrc/block_gemv.cu, executor/kernels/cuda_blocks.py),
built for the host by the kernel emulator (csrc/emu) and run on CPU tensors:

- every type a quantized checkpoint is laid out in (Q4_0, Q4_1, Q8_0, FP8_E4M3): the
  dequantizer gives the CPU kernel's weights bit for bit (every e4m3 byte included), the
  gemv of 1-8 rows equals float64 on them, into a column slice of a wider output too;
- a quantized checkpoint's whole model on the GPU path (here emulated: gpu_layout_'s 16-bit
  matrices as plain weights, the blocks through the kernels, decode-sized calls through the
  gemv and longer ones through the dequantizer and a GEMM) against the same model on the CPU
  kernels.

tests/test_cuda_quant.py runs the same on a GPU and through the engine."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from kernel_cases import FP8, MODEL_CASES, TYPES, blocks_of
from quant_checkpoints import CHECKPOINTS

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cuda_blocks
from zllm.executor.kernels.cuda import CudaKernelError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", TYPES)
def test_emulated_dequantizer_gives_the_cpu_kernels_weights(emu, kind, dtype):
    ggml_type = TYPES[kind]
    rows = blocks_of(ggml_type, 6, 96, seed=1)
    expected = cpu_kernels.gguf_dequantize(rows, ggml_type, 96)
    out = torch.full((6, 96), float("nan"), dtype=dtype)
    emu.run_launches(cuda_blocks.plan_block_dequant(rows, ggml_type, out))
    assert torch.equal(out, expected.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_emulated_gemv_matches_float64(emu, kind, dtype, rows):
    """Rows of x strided (a slice of a wider tensor); the output a column slice of a wider
    one (a fused matmul's part), its neighbours untouched; 70 output rows (not a multiple of
    a thread block's 4) of 1,088 columns (34 blocks: lanes 0 and 1 take two)."""
    ggml_type = TYPES[kind]
    out_features, in_features = 70, 1088
    qweight = blocks_of(ggml_type, out_features, in_features, seed=rows)
    weight = cpu_kernels.gguf_dequantize(qweight, ggml_type, in_features).double()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features + 16, generator=gen).to(dtype)[:, 8 : 8 + in_features]
    wide = torch.full((rows, out_features + 10), float("nan"), dtype=dtype)
    out = wide[:, 4 : 4 + out_features]
    emu.names.clear()
    emu.run_launches(cuda_blocks.plan_block_gemv(x, qweight, ggml_type, out))
    assert emu.names == [f"zllm_block_gemv<{cuda_blocks._DTYPE_TAG[dtype]}, {ggml_type}>"]
    expected = x.double() @ weight.T
    scale = expected.abs().max().item()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * scale)
    assert wide[:, :4].isnan().all() and wide[:, 4 + out_features :].isnan().all()


def test_layouts_the_kernels_do_not_read_are_refused():
    q4_0 = blocks_of(int(T.Q4_0), 4, 64, seed=0)
    x = torch.zeros(2, 64)
    out = torch.empty(2, 4)
    with pytest.raises(CudaKernelError, match="no GPU kernel"):
        cuda_blocks.plan_block_gemv(x, q4_0, int(T.Q4_K), out)
    with pytest.raises(CudaKernelError, match=r"uint8 \[rows, 36\]"):
        cuda_blocks.plan_block_gemv(x, q4_0[:, :30], int(T.Q4_0), out)
    with pytest.raises(CudaKernelError, match="at most 16"):
        cuda_blocks.plan_block_gemv(torch.zeros(17, 64), q4_0, int(T.Q4_0), torch.empty(17, 4))
    with pytest.raises(CudaKernelError, match="whole 32-value blocks"):
        cuda_blocks.plan_block_dequant(q4_0, int(T.Q4_0), torch.empty(4, 48))
    assert [t for t in cpu_kernels.KERNEL_TYPES if cuda_blocks.supported(t)] == [2, 3, 8, FP8]


@pytest.mark.parametrize("rows", [20, 33])
def test_emulated_linear_into_takes_gemv_passes_then_the_dequantizer(emu, monkeypatch, rows):
    """20 rows: two gemv launches (16 + 4); 33 (past GEMV_MAX_ROWS): the dequantizer and a
    GEMM."""
    ggml_type = TYPES["Q8_0"]
    qweight = blocks_of(ggml_type, 24, 256, seed=4)
    weight = cpu_kernels.gguf_dequantize(qweight, ggml_type, 256).double()
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(
        cuda_blocks, "run_launches", lambda launches, device: emu.run_launches(launches)
    )
    emu.names.clear()
    out = cuda_blocks.linear_into(x, qweight, ggml_type, torch.empty(rows, 24))
    kinds = [name.split("<")[0] for name in emu.names]
    assert kinds == (["zllm_block_gemv"] * 2 if rows == 20 else ["zllm_block_dequant"])
    torch.testing.assert_close(out.double(), x.double() @ weight.T, rtol=1e-5, atol=1e-4)


# ---- a quantized checkpoint's model on the GPU path, emulated -----------------------------------
def forward_logits(model, layout, lens: list[int], vocab: int) -> torch.Tensor:
    arch = model.arch
    caches = [
        torch.zeros(2, 16, 16, arch.num_kv_heads, arch.head_dim) for _ in range(arch.num_layers)
    ]
    tables = [[1 + i * 2, 2 + i * 2] for i in range(len(lens))]
    slots = [t[p // 16] * 16 + p % 16 for t, n in zip(tables, lens, strict=True) for p in range(n)]
    meta = layout.attention.build_metadata(lens, lens, tables, slots, 16, "cpu")
    ids = torch.randint(0, vocab, (sum(lens),), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(n) for n in lens])
    return model.compute_logits(model(ids, positions, caches, meta))


@pytest.mark.parametrize("case", MODEL_CASES)
@torch.inference_mode()
def test_emulated_gpu_path_of_a_quantized_model_equals_its_cpu_path(
    emu, monkeypatch, tmp_path_factory, case
):
    from zllm.config.engine_args import EngineArgs
    from zllm.executor.host.layout import RankLayout
    from zllm.executor.host.model_weights import ModelWeights
    from zllm.executor.layers.linear import gguf as gguf_modules

    path = CHECKPOINTS[case](tmp_path_factory.mktemp(case))
    config = EngineArgs(model=str(path), kv_cache_memory_bytes=16 << 20).create_engine_config()
    layout = RankLayout.of(config)
    model = ModelWeights(layout).model
    vocab = config.arch.vocab_size
    shapes = {"decode": [1, 1, 1], "prefill": [30, 5]}  # 3 rows (gemv), 35 (dequant + GEMM)
    expected = {k: forward_logits(model, layout, lens, vocab) for k, lens in shapes.items()}
    assert gguf_modules.gpu_layout_(model, torch.float32) > 0
    assert model.embed_rows.ggml_type == gguf_modules.DENSE  # 16-bit rows: a plain weight
    monkeypatch.setattr(gguf_modules, "on_gpu", lambda x: True)
    monkeypatch.setattr(
        cuda_blocks, "run_launches", lambda launches, device: emu.run_launches(launches)
    )
    for kind, lens in shapes.items():
        emu.names.clear()
        got = forward_logits(model, layout, lens, vocab)
        ran = {name.split("<")[0] for name in emu.names}
        if case != "gptq-8bit-asym":  # (its matrices are all 16-bit rows)
            assert ran == {"zllm_block_gemv" if kind == "decode" else "zllm_block_dequant"}
        torch.testing.assert_close(got, expected[kind], rtol=1e-4, atol=1e-4)
