"""The mixture-of-experts kernel (csrc/moe_experts.cu) on a real GPU; part of the GPU run
(`pytest tests/test_cuda*.py`). The same kernel runs under the CPU emulator in
tests/test_csrc_moe.py.

- zllm_moe_gemv at Qwen3-30B-A3B's layer shape (128 experts, 8 a token) for a decode step's
  batch sizes, against float64;
- MoEBlock's kernel path against its per-expert matmuls on the GPU, and inside a CUDA graph
  (replayed with new tokens and new routes) against eager;
- a tiny Qwen3-MoE in the engine on the GPU, its decode steps replaying CUDA graphs: greedy
  tokens equal transformers'."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install zllm[cuda]", allow_module_level=True)

from gpu_parity import counting_replays  # noqa: E402
from kernel_cases import moe_reference, random_moe  # noqa: E402

from zllm.executor.kernels import cuda_moe  # noqa: E402
from zllm.executor.layers.moe.router import GPT_OSS_RULE  # noqa: E402

DEVICE = torch.device("cuda")


@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_gemv_at_a_real_layer_shape(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    weight = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.02).to(DEVICE, dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    experts = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]
    )
    experts = experts.to(DEVICE)
    groups = cuda_moe.expert_groups(experts, num_experts)
    out = cuda_moe.moe_gemv(x, weight, None, groups, top_k)
    expected = moe_reference(x.cpu(), weight.cpu(), None, experts.cpu(), top_k)
    err = ((out.double().cpu() - expected).abs().max() / expected.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"


@pytest.mark.parametrize("rule", ["qwen", "gpt-oss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_moe_block_kernel_path_equals_per_expert_matmuls(dtype, rule, monkeypatch):
    block = random_moe(GPT_OSS_RULE if rule == "gpt-oss" else None, dtype).to(DEVICE)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    assert cuda_moe.usable(x)
    ours = block(x)
    monkeypatch.setattr(cuda_moe, "ENABLED", False)
    theirs = block(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)


@torch.inference_mode()
def test_moe_block_replays_in_a_cuda_graph():
    """Captured once, replayed with other tokens (other experts chosen): each replay equals
    the eager kernel path."""
    block = random_moe(None, torch.bfloat16, experts=16, top_k=4).to(DEVICE)
    static_x = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEVICE)
    block(static_x)  # warm-up: compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x)
    for seed in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        static_x.copy_(x)
        graph.replay()
        torch.testing.assert_close(static_out, block(static_x), rtol=0, atol=0)


def test_tiny_qwen3_moe_replays_graphs_and_equals_transformers(tmp_path):
    import transformers
    from parity import assert_greedy_parity, hf_greedy
    from tiny_models import write_tiny_model

    from zllm import LLM, SamplingParams

    path = write_tiny_model(
        tmp_path / "qwen3-moe", "qwen3_moe", head_dim=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True,
    )  # fmt: skip
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20)
    runner = llm.executor.runner.host.decode.graph_runner
    assert runner is not None, "MoE decode steps should replay CUDA graphs"
    replays = counting_replays(runner)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ours = out.outputs[0].token_ids
        assert_greedy_parity(hf, prompt, ours, hf_greedy(hf, prompt, len(ours)), label=f"moe[{i}]")
    assert replays[0] >= 10, f"{replays[0]} decode steps replayed a graph"
