"""bf16 and fp16 checkpoints stay 16-bit in memory on CPU (issue 37).

Their matrices are kept as the checkpoint stores them and widened to fp32 in registers inside
the CPU kernel (csrc/cpu/gguf_linear.cpp's F16/BF16 formats): the same fp32 values the
fp32-in-memory path multiplies (both widen exactly), summed in the kernel's order. So the
logits equal that path's to fp32 rounding, and the greedy tokens equal it and transformers'.
Where the CPU has AMX, a bf16 checkpoint's calls of 8+ rows (prefills, batches) take bf16 GEMMs
instead (executor/kernels/gguf_arithmetic.py): close to the float kernel's numbers, tested
below with the rule switched on or off in a loaded engine, whatever this CPU has.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers
from parity import assert_greedy_parity, hf_greedy, set_bf16_gemm_rows
from tiny_models import randomize_norms_and_biases, tiny_gemma3_overrides, write_tiny_model

from zllm import LLM, SamplingParams
from zllm.executor.kernels import gguf_arithmetic
from zllm.executor.kernels.gguf_arithmetic import BF16_GEMM_MIN_ROWS, cpu_has_amx_bf16
from zllm.executor.layers.linear.gguf import GGUFEmbedding, GGUFLinear
from zllm.executor.weights.quantization import SIXTEEN_BIT

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
TYPE_OF = {torch.bfloat16: 30, torch.float16: 1}  # ggml ids of BF16, F16


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # 3 tokens (decode-sized matmuls from the start) to 40 (the panel path in prefill)
    return [[rng.randrange(3, 300) for _ in range(rng.choice((3, 9, 40)))] for _ in range(n)]


def build(tmp_path: Path, arch: str, dtype: torch.dtype, **overrides) -> str:
    path = write_tiny_model(tmp_path / f"{arch}-{dtype}", arch=arch, dtype=dtype, **overrides)
    if arch == "gemma3_text":  # its norms, drawn (randomize_norms_and_biases)
        randomize_norms_and_biases(path)
    return str(path)


CASES = {
    "llama-bf16": ("llama", torch.bfloat16, {}),
    "llama-fp16-untied": ("llama", torch.float16, {"tie_word_embeddings": False}),
    "qwen2-bf16-bias": ("qwen2", torch.bfloat16, {}),
    "phi3-bf16-fused": ("phi3", torch.bfloat16, {}),  # qkv_proj, gate_up_proj stored fused
    "gemma3-bf16": (
        "gemma3_text",
        torch.bfloat16,
        {k: v for k, v in tiny_gemma3_overrides(16).items() if k != "arch"},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sixteen_bit_weights_stay_sixteen_bit_and_compute_the_fp32_paths_numbers(
    tmp_path: Path, case: str
) -> None:
    arch, dtype, overrides = CASES[case]
    path = build(tmp_path, arch, dtype, **overrides)
    ours = LLM(path, kv_cache_memory_bytes=8 << 20)
    fp32 = LLM(path, kv_cache_memory_bytes=8 << 20, quantization="none")
    assert ours.model_runner.quantization == SIXTEEN_BIT
    # The float kernel at every size here (with AMX, bf16 prefills: the next test).
    had_gemm = set_bf16_gemm_rows(ours, 0)
    assert bool(had_gemm) == (dtype == torch.bfloat16 and cpu_has_amx_bf16())
    assert fp32.model_runner.quantization == "none"
    model = ours.model_runner.model
    for layer in model.layers:  # every matrix as 16-bit rows, no fp32 copy
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(linear, GGUFLinear) and linear.ggml_type == TYPE_OF[dtype]
            assert linear.qweight.dtype == torch.uint8
    assert isinstance(model.embed_rows, GGUFEmbedding)
    assert model.embed_tokens.numel() == 0
    # The matrices take exactly half their fp32 bytes (a tied embedding's rows serve the
    # logits too: one copy).
    rows = {
        m.qweight.data_ptr(): m.qweight.nbytes for m in model.modules() if hasattr(m, "qweight")
    }
    matrices = [p for p in fp32.model_runner.model.parameters() if p.dim() == 2]
    assert 2 * sum(rows.values()) == sum(p.nbytes for p in matrices)

    batch = [{"prompt_token_ids": p} for p in prompts(6)]
    a = ours.generate(batch, GREEDY, use_tqdm=False)
    b = fp32.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # The same values summed in another order: logprobs equal to fp32 rounding.
    for x, y in zip(a, b, strict=True):
        for pos_x, pos_y in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            for token, lp in pos_x.items():
                assert abs(lp.logprob - pos_y[token].logprob) < 1e-4

    # And against transformers on the checkpoint's weights in fp32.
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, (p, out) in enumerate(zip(prompts(6), a, strict=True)):
        theirs = hf_greedy(hf, p, GREEDY.max_tokens)
        top5 = [list(pos) for pos in out.outputs[0].logprobs]
        assert_greedy_parity(hf, p, out.outputs[0].token_ids, theirs, top5, f"{case}[{i}]")


@pytest.mark.parametrize("case", ["llama-bf16", "gemma3-bf16"])
def test_bf16_prefill_gemms_stay_close_to_the_float_kernels_numbers(
    tmp_path: Path, case: str
) -> None:
    """The AMX rule (switched on here on any CPU: torch's bf16 GEMM runs everywhere): prompts
    of 8+ tokens go through bf16 GEMMs (x and the outputs rounded to bf16, fp32 sums), and
    the next token's log-probabilities stay within bf16's rounding of the float kernel's."""
    arch, dtype, overrides = CASES[case]
    path = build(tmp_path, arch, dtype, **overrides)
    gemm = LLM(path, kv_cache_memory_bytes=8 << 20)
    exact = LLM(path, kv_cache_memory_bytes=8 << 20)
    assert set_bf16_gemm_rows(gemm, BF16_GEMM_MIN_ROWS) in (0, 9 if arch == "llama" else 13)
    set_bf16_gemm_rows(exact, 0)
    rng = random.Random(3)
    batch = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]} for n in (16, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    drifts = []
    outputs = [llm.generate(batch, params, use_tqdm=False) for llm in (gemm, exact)]
    for a, b in zip(*outputs, strict=True):
        a_top, b_top = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        first = b.outputs[0].token_ids[0]
        assert first in a_top  # the exact path's choice is among the GEMM path's top 5
        drifts.append(abs(a_top[first].logprob - b_top[first].logprob))
        if a.outputs[0].token_ids[0] != first:  # a flip only between near-tied tokens
            assert abs(b_top[first].logprob - a_top[first].logprob) < 0.08
    assert max(drifts) < 0.08  # measured: 0.029 at most (llama), 0.001 (Gemma 3)
    assert max(drifts) > 0  # the GEMM did run: the numbers moved


def test_deterministic_runs_keep_the_float_kernels_sums(tmp_path: Path, monkeypatch) -> None:
    """--deterministic tiles every matmul in 8-row calls (batch_invariant.py), which would all
    reach the bf16 GEMM's row limit: its matmuls keep the float kernel (the CPU answers AMX
    here, whatever it has)."""
    monkeypatch.setattr(gguf_arithmetic, "cpu_has_amx_bf16", lambda: True)
    path = build(tmp_path, "llama", torch.bfloat16)
    default = LLM(path, kv_cache_memory_bytes=8 << 20)
    assert set_bf16_gemm_rows(default, BF16_GEMM_MIN_ROWS) == 9  # every BF16 matmul had it
    llm = LLM(path, kv_cache_memory_bytes=8 << 20, deterministic=True)
    assert llm.model_runner.quantization == SIXTEEN_BIT
    assert set_bf16_gemm_rows(llm, 0) == 0
    tiled = [m for m in llm.model_runner.model.modules() if type(m).__name__ == "Tiled"]
    assert tiled and all(getattr(m.inner, "bf16_gemm_rows", 0) == 0 for m in tiled)


def test_fp32_checkpoints_and_quantization_none_keep_fp32_matmuls(tmp_path: Path) -> None:
    fp32_dir = build(tmp_path, "llama", torch.float32)
    assert LLM(fp32_dir, kv_cache_memory_bytes=8 << 20).model_runner.quantization == "none"
    # An explicit --quantization gguf still means a GGUF file's blocks.
    bf16_dir = build(tmp_path, "llama", torch.bfloat16)
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(bf16_dir, quantization="gguf")


def test_sixteen_bit_weights_over_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    """Each rank keeps its part of every 16-bit matrix (rows, or columns on any boundary)."""
    path = build(tmp_path, "llama", torch.bfloat16)
    one = LLM(path, kv_cache_memory_bytes=8 << 20)
    two = LLM(path, kv_cache_memory_bytes=8 << 20, tensor_parallel_size=2)
    batch = [{"prompt_token_ids": p} for p in prompts(4, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = one.generate(batch, params, use_tqdm=False)
    b = two.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    two.executor.close()  # its rank process stops now, not when the LLM is collected
