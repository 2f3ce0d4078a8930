"""Images compose with the engine's other features (issue 60), on the tiny random Qwen2.5-VL
of test_qwen_vl.py: tensor ranks (each holding the encoder), n-gram speculation, int8 weights
and batch-invariant mode answer as one plain rank does; an image prompt's blocks go to the
CPU tier and load back under its image's keys; a LoRA adapter on the language model answers
as PEFT's over transformers with the same images. What cannot compose is refused naming why."""

from __future__ import annotations

import pytest
import torch
from qwen_vl_reference import MARK, hf_answer, images
from vision_models import QWEN_VL_IMAGE_TOKENS, write_tiny_qwen_vl

from zllm import LLM, SamplingParams
from zllm.lora import LoRARequest

POOL = 64 << 20
IMAGE_TOKENS_FROM = min(QWEN_VL_IMAGE_TOKENS.values())  # (the text vocabulary below)
PROMPT = {
    "prompt": f"Describe {MARK} and then {MARK}, again and again and again and again",
    "multi_modal_data": {"image": images(0, 1)},
}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_path) -> str:
    path = tmp_path_factory.mktemp("qwen-vl-compose") / "model"
    return str(write_tiny_qwen_vl(path, smollm2_path))


def answer(llm: LLM, prompt=PROMPT, **kwargs) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and every prompt token's log-probability after the first."""
    out = llm.generate(prompt, GREEDY, use_tqdm=False, **kwargs)[0]
    ids = list(out.prompt_token_ids)
    logprobs = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    return list(out.outputs[0].token_ids), torch.tensor(logprobs)


@pytest.fixture(scope="module")
def reference(model_dir) -> tuple[list[int], torch.Tensor]:
    return answer(LLM(model_dir, kv_cache_memory_bytes=POOL))


def test_tensor_ranks_answer_as_one(model_dir, reference) -> None:
    tokens, logprobs = answer(LLM(model_dir, kv_cache_memory_bytes=POOL, tensor_parallel_size=2))
    assert tokens == reference[0]
    assert float((logprobs - reference[1]).abs().max()) < 1e-4


def test_ngram_speculation_answers_as_without(model_dir) -> None:
    """The answer biased towards the prompt's text tokens (a random model repeats nothing
    by itself), so n-gram proposals come and are verified: the same tokens and log-probs
    as plain decoding."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}  # fmt: skip
    plain = LLM(model_dir, kv_cache_memory_bytes=POOL)
    ids = plain.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    bias = {t: 30.0 for t in [t for t in ids if t < IMAGE_TOKENS_FROM][:10]}
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias=bias,
                            logprobs=1)  # fmt: skip
    expected = plain.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    del plain
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL, speculative_config=spec)
    got = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    for ours, theirs, token in zip(got.logprobs, expected.logprobs, got.token_ids, strict=True):
        assert ours[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
    assert llm.engine.heartbeat().spec.num_accepted_tokens > 0


def test_int8_weights_stay_close(model_dir, reference) -> None:
    """The language model's matmuls in Q8_0 blocks (the encoder keeps the model's dtype):
    every prompt log-probability moves, by little."""
    _, logprobs = answer(LLM(model_dir, kv_cache_memory_bytes=POOL, quantization="int8"))
    drift = float((logprobs - reference[1]).abs().max())
    assert 0 < drift < 0.05, drift


def test_batch_invariant_mode_with_images(model_dir) -> None:
    """--deterministic: the image prompt's log-probabilities are the same bits alone and in a
    batch beside other prompts (text, and other images)."""
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL, deterministic=True)
    alone = answer(llm)
    others = [
        {"prompt": f"{MARK} something else", "multi_modal_data": {"image": images(2)}},
        {"prompt": "plain text, a longer prompt than the others " * 3},
        {"prompt": f"two {MARK} {MARK}", "multi_modal_data": {"image": images(3, 2)}},
    ]
    outs = llm.generate([others[0], PROMPT, *others[1:]], GREEDY, use_tqdm=False)
    ids = list(outs[1].prompt_token_ids)
    batched = [e[t].logprob for e, t in zip(outs[1].prompt_logprobs[1:], ids[1:], strict=True)]
    assert list(outs[1].outputs[0].token_ids) == alone[0]
    assert torch.equal(torch.tensor(batched), alone[1])


def test_image_blocks_offload_and_load_back(model_dir, reference) -> None:
    """A pool of 24 blocks: later prompts push the image prompt's blocks to the CPU tier;
    asked again it loads them back (tier hits) and answers as before, while the same text
    with another image loads none of the blocks holding an image."""
    llm = LLM(model_dir, block_size=4, num_gpu_blocks_override=24, kv_offload_bytes=4 << 20)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate(PROMPT, plain, use_tqdm=False)[0]
    for i in range(3):
        llm.generate({"prompt": f"filler number {i} " * 12}, plain, use_tqdm=False)
    again = llm.generate(PROMPT, plain, use_tqdm=False)[0]
    assert llm.engine.heartbeat().kv_tiers.hits[0] > 0
    assert again.num_cached_tokens > 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == reference[0][:4]
    other = {**PROMPT, "multi_modal_data": {"image": images(0, 2)}}
    other_out = llm.generate(other, plain, use_tqdm=False)[0]
    assert other_out.num_cached_tokens < again.num_cached_tokens


def test_lora_on_the_language_model(model_dir, tmp_path) -> None:
    """A PEFT adapter of the language model's attention and MLP: greedy tokens and prompt
    log-probabilities as PEFT's over transformers with the same images, and not the base
    model's; an adapter of the vision encoder is refused naming the tensor."""
    peft = pytest.importorskip("peft")
    from transformers import Qwen2_5_VLForConditionalGeneration

    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir)
    torch.manual_seed(3)
    targets = r".*language_model.*\.(q_proj|v_proj|gate_proj|down_proj)"
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    adapted = peft.get_peft_model(base, config)
    adapted.save_pretrained(tmp_path / "adapter")
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("lang", 1, str(tmp_path / "adapter"))
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=lora)[0]
    ids = list(out.prompt_token_ids)
    expected, expected_logprobs = hf_answer(adapted.eval(), model_dir, ids, [0, 1], 12)
    assert list(out.outputs[0].token_ids) == expected
    ours = torch.tensor(
        [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    )
    assert float((ours - expected_logprobs).abs().max()) < 1e-4
    plain = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert list(plain.outputs[0].token_ids) != expected

    vision = peft.get_peft_model(
        Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir),
        peft.LoraConfig(r=4, target_modules=r".*visual.*\.qkv", init_lora_weights=False),
    )
    vision.save_pretrained(tmp_path / "vision-adapter")
    with pytest.raises(ValueError, match="adapts the vision encoder"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("vis", 2, str(tmp_path / "vision-adapter")))  # fmt: skip


def test_what_does_not_compose_is_refused(model_dir, tmp_path, gemma3_path) -> None:
    from vision_models import write_tiny_gemma3_vlm

    with pytest.raises(ValueError, match="pipeline-parallel-size: the image features join"):
        LLM(model_dir, pipeline_parallel_size=2)
    draft = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="method draft_model: the draft would read"):
        LLM(model_dir, speculative_config=draft)
    gemma = str(write_tiny_gemma3_vlm(tmp_path / "gemma", gemma3_gguf=gemma3_path))
    with pytest.raises(ValueError, match="deterministic: batch-invariant attention is causal"):
        LLM(gemma, deterministic=True)


@pytest.mark.e2e
def test_a_prefill_decode_pair_answers_with_images(model_dir, tmp_path) -> None:
    """Disaggregated: the consumer loads the producer's blocks, the ones holding images
    included (their keys name the images on both sides), answers as the producer does, and
    never runs its encoder (the images sit in whole blocks it loaded)."""
    import openai
    from disagg_pairs import free_port, remote_hits, served_pair
    from qwen_vl_reference import data_url
    from servers import metric, wait_until

    content = [
        {"type": "image_url", "image_url": {"url": data_url(0)}},
        {"type": "image_url", "image_url": {"url": data_url(1)}},
        {"type": "text", "text": "Describe both pictures in a few words, then compare them."},
    ]
    messages = [{"role": "user", "content": content}]
    with served_pair(model_dir, tmp_path, free_port()) as (prefill, decode, proxy):
        reference = openai.OpenAI(base_url=prefill.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=model_dir, messages=messages, max_tokens=8, temperature=0)
        expected = reference.chat.completions.create(**kw)
        pair = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        answer = pair.chat.completions.create(**kw)
        assert answer.choices[0].message.content == expected.choices[0].message.content
        loadable = (expected.usage.prompt_tokens - 1) // 16 * 16
        assert loadable >= 32  # (the images: the first 25 tokens)
        assert wait_until(lambda: remote_hits(decode) == loadable, 30), remote_hits(decode)

        def image_entries() -> float | None:
            try:
                text = decode.get("/metrics").text
                return metric(text, "zllm:cache_entries", 'cache="image_encoder"')
            except AssertionError:  # (no heartbeat has reported the encoder's cache yet)
                return None

        assert wait_until(lambda: image_entries() is not None, 30)
        assert image_entries() == 0
