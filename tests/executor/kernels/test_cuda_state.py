"""A hybrid model's state layers on a real GPU: csrc/state_layers.cu's decode steps against the
torch steps they replace, and the tiny Qwen3-Next and Granite 4.0-H of tests/family_cases.py
on the GPU (fp32, no CUDA graphs: the families lack them) answering as on the CPU; part of the
GPU run (benchmarks/gpu_figures.sh tests). The same kernels run under the CPU emulator in
test_csrc_state.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install zllm[cuda]", allow_module_level=True)

from family_cases import CASES  # noqa: E402

from zllm import LLM, SamplingParams  # noqa: E402
from zllm.executor.kernels import cuda_state_ops as cs  # noqa: E402
from zllm.executor.layers.causal_conv import conv_decode  # noqa: E402
from zllm.executor.layers.gated_delta_rule import recurrent_step  # noqa: E402
from zllm.executor.layers.mamba2_scan import scan_step  # noqa: E402

DEVICE = torch.device("cuda")
SLOTS = torch.tensor([4, 0, 2], device=DEVICE)


def test_the_three_steps_equal_torch_on_the_device() -> None:
    gen = torch.Generator().manual_seed(4)

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    x, pool, weight, bias = draw(3, 160), draw(5, 160, 3), draw(160, 4), draw(160)
    expected, moved = conv_decode(x, pool[SLOTS].clone(), weight, bias)
    torch.testing.assert_close(cs.causal_conv_decode_(x, pool, SLOTS, weight, bias), expected)
    torch.testing.assert_close(pool[SLOTS], moved)

    q, k, v = draw(3, 2, 128), draw(3, 2, 128), draw(3, 4, 128)
    g, beta = -F.softplus(draw(3, 4)), torch.sigmoid(draw(3, 4))
    pool = draw(5, 4, 128, 128)
    expected, states = recurrent_step(q, k, v, g, beta, pool[SLOTS].clone())
    out = cs.gated_delta_decode_(q, k, v, g, beta, pool, SLOTS, False)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[SLOTS], states, rtol=1e-4, atol=1e-4)

    x, B, C = draw(3, 8, 64), draw(3, 2, 128), draw(3, 2, 128)
    dt, A, D = F.softplus(draw(3, 8)), -torch.rand(8, device=DEVICE) - 0.1, draw(8)
    pool = draw(5, 8, 128, 64)
    expected, states = scan_step(x, B, C, dt, A, D, pool[SLOTS].clone())
    out = cs.mamba2_decode_(x, B, C, dt, A, D, pool, SLOTS)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[SLOTS], states, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_next", "granite_hybrid"])
def test_a_tiny_hybrid_answers_on_the_gpu_as_on_the_cpu(family, tmp_path) -> None:
    directory = str(CASES[family].write(tmp_path / family))
    prompts = [[(7 * i + 3 * j) % 390 + 5 for j in range(n)] for i, n in enumerate([1, 9, 70])]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def answers(**kwargs) -> list[list[int]]:
        llm = LLM(directory, dtype="float32", **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    cpu = answers(device="cpu", kv_cache_memory_bytes=16 << 20)
    gpu = answers(device="cuda", kv_cache_memory_bytes=64 << 20)
    assert gpu == cpu
