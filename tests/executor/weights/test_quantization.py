"""--quantization int8: a plain checkpoint's decoder matmuls rounded to Q8_0 blocks at load
(executor/weights/quantization.py), bit for bit as gguf-py quantizes them, and served by the
block kernel: greedy tokens equal transformers running the same rounded weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, dequantize, quantize
from parity import assert_greedy_parity, hf_greedy
from tiny_models import write_tiny_model

from zllm import LLM, SamplingParams
from zllm.executor.layers.linear.gguf import GGUFLinear
from zllm.executor.weights.blocks import decoder_matmul_targets
from zllm.executor.weights.quantization import q8_0_rows

Q8_0 = GGMLQuantizationType.Q8_0
PROMPTS = [[5, 17, 200, 33, 61, 90], [300, 2, 2, 48, 111, 7, 8, 9, 250, 13]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# DeepSeek-V2 with latent q, a dense first layer and a mixture with a shared expert.
ARCH_OPTIONS = {
    "deepseek_v2": dict(
        num_key_value_heads=None,  # (the config class makes it num_attention_heads)
        kv_lora_rank=32,
        q_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
    )
}


def test_q8_0_rows_are_gguf_pys_blocks() -> None:
    """Ties at .5 (rounded away from zero), an all-zero block and outliers included."""
    torch.manual_seed(0)
    weight = torch.randn(48, 128)
    weight[0, :32] = 0.0
    weight[1, :32] = torch.arange(32) - 15.5  # scaled codes fall on halves
    weight[2, 40] = 60.0
    rows = q8_0_rows(weight)
    expected = quantize(weight.numpy(), Q8_0)
    assert np.array_equal(rows.numpy(), expected)
    assert q8_0_rows(torch.randn(4, 48)) is None  # rows that are not whole blocks


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v2"])
def test_int8_answers_as_transformers_on_the_rounded_weights(tmp_path, arch) -> None:
    """Every decoder matmul the blocks serve (DeepSeek-V2's latent projections and shared
    experts included; its routed experts and kv_b_proj stay fp32) is a Q8_0 kernel module;
    transformers, given those weights dequantized from the same blocks, decodes the same
    greedy tokens."""
    path = write_tiny_model(tmp_path / arch, arch, **ARCH_OPTIONS.get(arch, {}))
    llm = LLM(str(path), quantization="int8")
    model = llm.model_runner.model
    rounded = set()
    for module, attr, names in decoder_matmul_targets(model):
        matmul = getattr(module, attr)
        assert type(matmul) is GGUFLinear and matmul.ggml_type == int(Q8_0), names
        rounded.update(names)
    ours = [o.outputs[0].token_ids for o in llm.generate(_inputs(), GREEDY, use_tqdm=False)]

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in rounded:
                rows = q8_0_rows(param.data)
                param.copy_(torch.from_numpy(dequantize(rows.numpy(), Q8_0)))
                rounded.discard(name)
    assert not rounded  # every served matrix found in transformers' model
    for prompt, got in zip(PROMPTS, ours, strict=True):
        theirs = hf_greedy(reference, prompt, GREEDY.max_tokens)
        assert_greedy_parity(reference, prompt, got, theirs, label=f"int8 {arch}")


def test_int8_composes_with_ranks_and_deterministic_mode(tmp_path) -> None:
    """Two tensor-parallel ranks (each rounds its part of the fp32 weights: o/down cut on
    block boundaries) and deterministic mode give one rank's tokens."""
    path = str(write_tiny_model(tmp_path / "llama"))
    one = LLM(path, quantization="int8")
    expected = [o.outputs[0].token_ids for o in one.generate(_inputs(), GREEDY, use_tqdm=False)]
    del one
    for options in ({"tensor_parallel_size": 2}, {"deterministic": True}):
        other = LLM(path, quantization="int8", **options)
        got = [o.outputs[0].token_ids for o in other.generate(_inputs(), GREEDY, use_tqdm=False)]
        del other
        assert got == expected, options


def _inputs() -> list[dict]:
    return [{"prompt_token_ids": p} for p in PROMPTS]
