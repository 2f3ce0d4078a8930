"""The real default model (SmolLM2-135M-Instruct, GGUF Q4_1) against transformers.

transformers dequantizes the same GGUF file, so both run the same fp32 weights.
"""

from __future__ import annotations

import pytest
import torch
from parity import assert_greedy_parity, hf_greedy_batch

from zllm import LLM, SamplingParams
from zllm.executor.host.kv_cache import kv_bytes_per_token
from zllm.executor.layers.linear.gguf import GGUFEmbedding, GGUFLinear

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: I like apples.",
    "Hi",
    "The three laws of thermodynamics are the following. First,",
    "Write a haiku about the ocean. Use vivid imagery and keep the traditional form of "
    "five, seven and five syllables, and describe waves, salt, wind and the horizon at dusk.",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Name three colours of the rainbow."}],
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, kv_cache_memory_bytes=256 << 20)


def _token_prompts(llm):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    prompts += [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in CHATS]
    return prompts


# transformers' greedy answer per prompt: the batch, preemption and transformers-backend
# tests compare the same prompts with it, so it is computed once.
_HF_ANSWERS: dict[tuple[int, ...], list[int]] = {}


def _check(hf_model, prompts, outputs, label):
    missing = [p for p in prompts if tuple(p) not in _HF_ANSWERS]
    if missing:
        answers = hf_greedy_batch(hf_model, missing, MAX_TOKENS)
        _HF_ANSWERS.update(zip(map(tuple, missing), answers, strict=True))
    for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
        theirs = _HF_ANSWERS[tuple(p)]
        top5 = [list(pos) for pos in out.outputs[0].logprobs]
        assert_greedy_parity(hf_model, p, out.outputs[0].token_ids, theirs, top5, f"{label}[{i}]")


def test_greedy_batch_matches_transformers(llm, hf_model):
    prompts = _token_prompts(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _check(hf_model, prompts, outputs, "smollm2-batch")
    # The chat answers are real text.
    assert "4" in outputs[len(PROMPTS)].outputs[0].text


def test_greedy_under_preemption_matches_transformers(smollm2_path, hf_model):
    # 24 blocks x 16 tokens for 10 requests of up to ~70 tokens: preemption is forced.
    small = LLM(smollm2_path, num_gpu_blocks_override=24, max_num_batched_tokens=128)
    prompts = _token_prompts(small)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outputs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert small.engine.heartbeat().load.num_preemptions > 0
    _check(hf_model, prompts, outputs, "smollm2-preempt")


def test_tokenizer_and_chat_template_from_gguf(llm):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(CHATS[0])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.encode("<|im_start|>", add_special_tokens=False)[0]


def test_prefix_cache_hit_on_real_model(llm):
    tok = llm.get_tokenizer()
    system = tok.encode("You are a careful assistant. " * 20)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = llm.generate(
        {"prompt_token_ids": system + tok.encode(" Question one?")}, params, use_tqdm=False
    )[0]
    steps_before = llm.engine.scheduler._step_id
    bm = llm.engine.block_manager
    hits_before = bm.prefix_cache_hits
    second = llm.generate(
        {"prompt_token_ids": system + tok.encode(" Question two!")}, params, use_tqdm=False
    )[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= len(system) - 16
    assert bm.prefix_cache_hits - hits_before == second.num_cached_tokens
    assert llm.engine.scheduler._step_id > steps_before


def test_kv_bytes_per_token_on_smollm2(llm):
    arch = llm.config.arch
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (30, 3, 64)
    assert kv_bytes_per_token(arch, torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080


def test_transformers_backend_on_the_real_model(smollm2_path, hf_model):
    """--model-impl transformers: transformers' LlamaForCausalLM, read from the GGUF by
    transformers, attending through zllm's paged cache; its matmuls, embedding and tied
    logits swapped for the GGUF kernel's modules over the file's Q4_1 / Q8_0 blocks (the
    default, as on zllm's code); the same greedy tokens."""
    llm = LLM(smollm2_path, model_impl="transformers", kv_cache_memory_bytes=256 << 20)
    assert llm.config.model_impl == "transformers"
    assert llm.model_runner.quantization == "gguf"
    hf = llm.model_runner.model.hf
    kernel = [m for m in hf.modules() if isinstance(m, GGUFLinear)]
    assert len(kernel) == 30 * 7 + 1  # every decoder matmul, and the logits
    assert isinstance(hf.model.embed_tokens, GGUFEmbedding)
    assert hf.lm_head.qweight is hf.model.embed_tokens.qweight  # tied: one set of blocks
    assert not [p for p in hf.parameters() if p.dim() >= 2]  # no fp32 matrix left
    # Every other prompt (a chat among them): transformers' modeling code steps one module at
    # a time here, about 8x zllm code's time per token; the batch test above runs them all.
    prompts = _token_prompts(llm)[1::2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _check(hf_model, prompts, outputs, "smollm2-transformers-backend")
