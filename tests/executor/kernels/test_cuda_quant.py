"""Quantized checkpoints on a real GPU (csrc/block_gemv.cu); part of the GPU run
(`pytest tests/test_cuda*.py`). The same kernels and the model's GPU path run under the CPU
emulator in tests/test_csrc_blocks.py.

- the block gemv and dequantizer on the GPU against the CPU kernel's weights in float64;
- the kernels captured in a CUDA graph and replayed;
- tiny compressed-tensors, AWQ, GPTQ (act-order, 8-bit with zero points) and fp8
  checkpoints in the engine on the GPU: greedy tokens as their references' (transformers,
  or the dequantized weights), as on CPU
  (tests/test_quantized_checkpoints.py);
- sleep level 1 moves the blocks to pinned host memory and back: the same outputs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install zllm[cuda]", allow_module_level=True)

from kernel_cases import MODEL_CASES, TYPES, blocks_of  # noqa: E402
from parity import assert_greedy_parity, hf_greedy  # noqa: E402
from quant_checkpoints import CHECKPOINTS, reference_of  # noqa: E402

from zllm import LLM, SamplingParams  # noqa: E402
from zllm.executor.kernels import cpu as cpu_kernels  # noqa: E402
from zllm.executor.kernels import cuda_blocks  # noqa: E402
from zllm.executor.layers.linear.gguf import DENSE, GGUFLinear  # noqa: E402

DEVICE = torch.device("cuda")
PROMPTS = [[5, 17, 200, 33, 61, 90], [300, 2, 2, 48, 111, 7, 8, 9, 250, 13], [401, 66]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("rows", [1, 16, 32, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", TYPES)
def test_block_linear_on_the_gpu(kind, dtype, rows):
    """1 and 16 rows through one gemv launch, 32 through two, 33 through the dequantizer
    and cuBLAS."""
    ggml_type = TYPES[kind]
    qweight = blocks_of(ggml_type, 4096, 2048, seed=rows)
    weight = cpu_kernels.gguf_dequantize(qweight, ggml_type, 2048).double()
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(rows)).to(dtype)
    out = torch.empty(rows, 4096, dtype=dtype, device=DEVICE)
    cuda_blocks.linear_into(x.to(DEVICE), qweight.to(DEVICE), ggml_type, out)
    expected = x.double() @ weight.T
    err = ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"
    dequantized = cuda_blocks.dequantize(qweight.to(DEVICE), ggml_type, 2048, torch.float32)
    assert torch.equal(dequantized.cpu(), weight.float())


def test_block_linear_replays_in_a_cuda_graph():
    """Decode-sized calls (1, 16 and 32 rows: one and two gemv launches) captured and
    replayed with new inputs equal eager calls; 40 rows (dequantized) too."""
    ggml_type = TYPES["Q4_0"]
    qweight = blocks_of(ggml_type, 1024, 512, seed=3).to(DEVICE)
    for rows in (1, 16, 32, 40):
        static_x = torch.zeros(rows, 512, dtype=torch.bfloat16, device=DEVICE)
        static_out = torch.empty(rows, 1024, dtype=torch.bfloat16, device=DEVICE)
        cuda_blocks.linear_into(static_x, qweight, ggml_type, static_out)  # compile first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cuda_blocks.linear_into(static_x, qweight, ggml_type, static_out)
        static_x.copy_(torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)))
        graph.replay()
        eager = torch.empty_like(static_out)
        cuda_blocks.linear_into(static_x, qweight, ggml_type, eager)
        assert torch.equal(static_out, eager)


@pytest.mark.parametrize("case", MODEL_CASES)
def test_quantized_checkpoint_on_the_gpu_answers_as_its_reference(tmp_path_factory, case):
    path = CHECKPOINTS[case](tmp_path_factory.mktemp(case))
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20)
    host = llm.executor.runner.host
    # (head_dim 32: the torch attention backend, so no decode graphs; the blocks' kernels in
    # a graph: test_block_linear_replays_in_a_cuda_graph)
    held = [m for m in host.weights.model.modules() if isinstance(m, GGUFLinear)]
    assert held and all(m.qweight.is_cuda for m in held)
    if case != "gptq-8bit-asym":  # (16-bit rows: plain weights)
        assert any(m.ggml_type != DENSE for m in held)
    ref = reference_of(case, path)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ours = list(out.outputs[0].token_ids)
        assert_greedy_parity(ref, prompt, ours, hf_greedy(ref, prompt, len(ours)), label=case)


def test_sleep_level_1_moves_the_blocks_and_wakes_to_the_same_outputs(tmp_path):
    path = CHECKPOINTS["ct-w4a16"](tmp_path / "w4a16")
    llm = LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
              enable_sleep_mode=True)  # fmt: skip
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    before = [o.outputs[0].token_ids for o in llm.generate(inputs, GREEDY, use_tqdm=False)]
    held = [
        m for m in llm.executor.runner.host.weights.model.modules() if isinstance(m, GGUFLinear)
    ]
    llm.sleep(level=1)
    assert all(m.qweight.device.type == "cpu" and m.qweight.is_pinned() for m in held)
    llm.wake_up()
    assert all(m.qweight.is_cuda for m in held)
    after = [o.outputs[0].token_ids for o in llm.generate(inputs, GREEDY, use_tqdm=False)]
    assert after == before
