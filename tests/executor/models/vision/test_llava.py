"""LLaVA with images on the transformers backend (issue 60): a tiny random
LlavaForConditionalGeneration (a Llama language model, CLIP's vision tower, its projector;
the SmolLM2 vocabulary with <image> added) runs with transformers' own modeling code, its
language model attending through zllm's paged cache and its vision tower through torch's SDPA.
Greedy tokens and every prompt log-probability equal transformers' forward on the same
processed inputs; the prompt's <image> expands as LlavaProcessor expands it; served through
the OpenAI client; a sparse Hub config reads as transformers reads it; what the backend
cannot run with images is refused naming why."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image
from vision_models import LLAVA_IMAGE_TOKEN, png, write_tiny_llava

from zllm import LLM, SamplingParams

IMAGE_TOKEN_ID = LLAVA_IMAGE_TOKEN[1]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
POOL = 64 << 20
SIZES = {0: (90, 40), 1: (40, 110), 2: (70, 70)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_path) -> str:
    return str(write_tiny_llava(tmp_path_factory.mktemp("llava") / "model", smollm2_path))


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(model_dir).eval()


def images(*seeds: int) -> list[Image.Image]:
    return [Image.open(io.BytesIO(png(seed, SIZES[seed]))) for seed in seeds]


def hf_answer(model, model_dir: str, ids: list[int], seeds: list[int], n: int):
    """transformers' greedy tokens and each prompt token's log-probability after the first."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model_dir)
    pixels = processor(images=[i.convert("RGB") for i in images(*seeds)], return_tensors="pt")
    prompt = torch.tensor([ids])
    tokens = []
    with torch.inference_mode():
        out = model(input_ids=prompt, pixel_values=pixels["pixel_values"], use_cache=True)
        scores = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
        prompt_logprobs = scores.gather(1, prompt[0, 1:, None])[:, 0]
        for _ in range(n):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return tokens, prompt_logprobs


def assert_answers_as_transformers(output, model, model_dir: str, seeds: list[int]) -> None:
    ids = list(output.prompt_token_ids)
    assert ids.count(IMAGE_TOKEN_ID) == 16 * len(seeds)
    tokens, expected = hf_answer(model, model_dir, ids, seeds, GREEDY.max_tokens)
    assert list(output.outputs[0].token_ids) == tokens
    pairs = zip(output.prompt_logprobs[1:], ids[1:], strict=True)
    ours = torch.tensor([entry[t].logprob for entry, t in pairs])
    assert float((ours - expected).abs().max()) < 1e-4


def test_prompts_with_images_answer_as_transformers(model_dir, reference) -> None:
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL)
    assert llm.config.model_impl == "transformers"
    prompt = {"prompt": "Look at <image> and <image> closely", "multi_modal_data": {"image": images(0, 1)}}  # fmt: skip
    assert_answers_as_transformers(llm.generate(prompt, GREEDY, use_tqdm=False)[0], reference,
                                   model_dir, [0, 1])  # fmt: skip
    parts = [
        {"type": "text", "text": "What is in"},
        {"type": "image_pil", "image_pil": images(2)[0]},
        {"type": "text", "text": "?"},
    ]
    chat = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    assert_answers_as_transformers(chat, reference, model_dir, [2])
    cache = llm.model_runner.host.images.cache
    assert (cache.misses, len(cache)) == (3, 3)


def test_a_level_2_sleep_reloads_the_encoder_with_the_language_model(model_dir) -> None:
    """transformers' encoder is part of the language model: after a level-2 sleep the image
    features come from the reloaded model (the old one is not kept alive through the
    encoder), and an image prompt answers as before."""
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL, enable_sleep_mode=True)
    prompt = {"prompt": "Look at <image> closely", "multi_modal_data": {"image": images(1)}}
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids
    host = llm.model_runner.host
    llm.sleep(level=2)
    assert host.images.encoder is None
    llm.wake_up()
    assert host.images.encoder.model is host.weights.model.hf
    assert llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids == before


def test_the_prompt_expands_as_llava_processor_does(model_dir) -> None:
    from transformers import AutoImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json")
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(model_dir), tokenizer=hf_tokenizer,
        patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL)
    prompt = "Look at <image> and <image> closely"
    ours = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images(0, 1)}},
                        SamplingParams(max_tokens=1), use_tqdm=False)[0]  # fmt: skip
    expected = processor(text=[prompt], images=images(0, 1), return_tensors="pt")["input_ids"][0]
    assert list(ours.prompt_token_ids) == expected.tolist()


def test_what_the_backend_cannot_run_with_images_is_refused(model_dir) -> None:
    with pytest.raises(ValueError, match="tensor-parallel-size 2: transformers' plan cuts"):
        LLM(model_dir, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline-parallel-size: the image features join"):
        LLM(model_dir, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="enable-lora: adapters of transformers' vision"):
        LLM(model_dir, enable_lora=True)
    with pytest.raises(ValueError, match="quantization int8: runs on zllm's own vision"):
        LLM(model_dir, quantization="int8")


def test_a_sparse_hub_config_reads_over_llamas_defaults(tmp_path) -> None:
    """The Hub's LLaVA 1.5 config.json (transformers 4.3x) states only what differs from
    LlamaConfig in its text_config: the KV cache layout zllm reads is transformers' own."""
    import json

    from transformers import LlavaConfig

    from zllm.model.arch import arch_of

    config = {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "image_token_index": 32000, "tie_word_embeddings": False, "vocab_size": 32064,
        "text_config": {"model_type": "llama", "max_position_embeddings": 4096,
                        "rms_norm_eps": 1e-05, "vocab_size": 32064},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "num_attention_heads": 16,
                          "image_size": 336, "patch_size": 14},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = arch_of(str(tmp_path), "transformers")
    text = LlavaConfig.from_pretrained(tmp_path).text_config
    assert arch.vision and not arch.tie_word_embeddings
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (
        text.num_hidden_layers, text.hidden_size, text.num_attention_heads,
        text.num_key_value_heads,
    )  # fmt: skip
    assert (arch.vocab_size, arch.max_position_embeddings) == (32064, 4096)


@pytest.mark.e2e
def test_served_images_answer_as_offline(model_dir, engine_pool, tmp_path) -> None:
    import openai

    llm = LLM(model_dir, kv_cache_memory_bytes=POOL)
    parts = [{"type": "text", "text": "Describe"}, {"type": "image_pil", "image_pil": images(1)[0]}]
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    offline = llm.chat([{"role": "user", "content": parts}], plain, use_tqdm=False)[0]
    del llm
    with engine_pool.serve(
        model_dir, tmp_path / "server.log", "--served-model-name", "llava"
    ) as server:
        url = "data:image/png;base64," + base64.b64encode(png(1, SIZES[1])).decode()
        content = [{"type": "text", "text": "Describe"},
                   {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        chat = client.chat.completions.create(
            model="llava", messages=[{"role": "user", "content": content}], max_tokens=6,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert chat.choices[0].message.content == offline.outputs[0].text
        assert chat.usage.prompt_tokens == len(offline.prompt_token_ids)
