"""Gemma 3 with images (issue 60): a tiny random Gemma3ForConditionalGeneration (its SigLIP
tower, projector and language model from transformers' config classes; the real Gemma 3
tokenizer) against transformers' forward on the same processed inputs: greedy tokens equal,
the first token's log-probabilities close, the image tokens' two-way attention included; its
tokens kept in one chunk under chunked prefill; the encoder cache and image-keyed prefix
blocks."""

from __future__ import annotations

import base64
import io
import time

import pytest
import torch
from PIL import Image
from vision_models import IMAGE_TOKEN, png, write_tiny_gemma3_vlm

from zllm import LLM, SamplingParams
from zllm.executor.models.vision.gemma3 import pixel_values

IMAGE_TOKEN_ID = 262144
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
PROMPT = "Describe <start_of_image> and then <start_of_image> in a few words"
POOL = 64 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, gemma3_path) -> str:
    path = tmp_path_factory.mktemp("gemma3-vlm") / "model"
    return str(write_tiny_gemma3_vlm(path, gemma3_gguf=gemma3_path))


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval()


def images(*seeds: int) -> list[Image.Image]:
    return [Image.open(io.BytesIO(png(seed, (40 + 8 * seed, 30)))) for seed in seeds]


def hf_answer(
    model, model_dir: str, ids: list[int], seeds: list[int], n: int, two_way: bool = True
):
    """transformers' greedy tokens, and the log-probability of each prompt token after the
    first, for the prompt ids and images; token_type_ids mark the image tokens (their two-way
    attention) unless not `two_way`."""
    pixels = pixel_values(model_dir, [png(seed, (40 + 8 * seed, 30)) for seed in seeds])
    prompt = torch.tensor([ids])
    types = (prompt == IMAGE_TOKEN_ID).long() if two_way else None
    tokens = []
    with torch.inference_mode():
        out = model(input_ids=prompt, pixel_values=pixels, token_type_ids=types, use_cache=True)
        scores = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
        prompt_logprobs = scores.gather(1, prompt[0, 1:, None])[:, 0]
        for _ in range(n):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return tokens, prompt_logprobs


def assert_answers_as_transformers(output, model, model_dir: str, seeds: list[int]) -> None:
    """Greedy tokens equal; every prompt token's log-probability within 1e-4 (those after
    an image token read its hidden state, which its two-way attention makes), where causal
    attention over the images would be off by far more."""
    ids = list(output.prompt_token_ids)
    assert ids.count(IMAGE_TOKEN_ID) == 4 * len(seeds)
    tokens, expected = hf_answer(model, model_dir, ids, seeds, GREEDY.max_tokens)
    assert list(output.outputs[0].token_ids) == tokens
    pairs = zip(output.prompt_logprobs[1:], ids[1:], strict=True)
    ours = torch.tensor([entry[t].logprob for entry, t in pairs])
    assert float((ours - expected).abs().max()) < 1e-4
    _, causal = hf_answer(model, model_dir, ids, seeds, 0, two_way=False)
    gap = float((ours - causal).abs().max())
    assert gap > 1e-2, gap


def test_prompts_with_images_answer_as_transformers(model_dir, reference) -> None:
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": images(0, 1)}}
    assert_answers_as_transformers(llm.generate(prompt, GREEDY, use_tqdm=False)[0], reference,
                                   model_dir, [0, 1])  # fmt: skip
    one = {"prompt": "<start_of_image> what is it", "multi_modal_data": {"image": images(2)}}
    assert_answers_as_transformers(llm.generate(one, GREEDY, use_tqdm=False)[0], reference,
                                   model_dir, [2])  # fmt: skip
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_pil", "image_pil": images(1)[0]},
        {"type": "text", "text": "with"},
        {"type": "image_pil", "image_pil": images(3)[0]},
    ]
    chat = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    assert_answers_as_transformers(chat, reference, model_dir, [1, 3])


def test_an_images_tokens_are_prefilled_in_one_chunk(model_dir, reference) -> None:
    """Eight tokens a step: the prompt's chunks end before an image rather than inside it."""
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL, max_num_batched_tokens=8, max_num_seqs=2)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": images(0, 1)}}
    assert_answers_as_transformers(llm.generate(prompt, GREEDY, use_tqdm=False)[0], reference,
                                   model_dir, [0, 1])  # fmt: skip


def test_the_encoder_cache_and_image_keyed_prefix_blocks(model_dir) -> None:
    """An image seen before is not encoded again; a block's key names the images in it: the
    same text with other images shares the blocks before the image and none after, with the
    same images it shares them all."""
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL, block_size=4)
    cache = llm.model_runner.host.images.cache
    text = "A preface every prompt shares, " * 3 + "<start_of_image>" + " and words after it" * 2

    def run(seed: int):
        prompt = {"prompt": text, "multi_modal_data": {"image": images(seed)}}
        # (no prompt logprobs: a request asking for them computes its whole prompt)
        plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return llm.generate(prompt, plain, use_tqdm=False)[0]

    first = run(0)
    assert (cache.misses, cache.hits) == (1, 0)
    image_start = list(first.prompt_token_ids).index(IMAGE_TOKEN_ID)
    again = run(0)
    assert again.num_cached_tokens > image_start + 4
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    other = run(1)
    assert 0 < other.num_cached_tokens <= image_start
    assert cache.misses == 2 and len(cache) == 2


def test_images_compose_with_cache_salt_and_sleep(model_dir) -> None:
    """A `cache_salt` keeps even the same images' blocks apart (the salts chain); a level-2
    sleep drops the weights and the image encoder with its cache, and after waking (both
    loaded again) an image prompt answers as before."""
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL, block_size=4, enable_sleep_mode=True)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    text = "<start_of_image> " + "and some words after it " * 3

    def run(salt: str | None = None):
        prompt = {"prompt": text, "multi_modal_data": {"image": images(0)}}
        if salt is not None:
            prompt["cache_salt"] = salt
        return llm.generate(prompt, plain, use_tqdm=False)[0]

    first = run("alice")
    assert run("bob").num_cached_tokens == 0
    assert run("alice").num_cached_tokens > 0
    images_owner = llm.model_runner.host.images
    assert len(images_owner.cache) == 1
    llm.sleep(level=2)
    assert images_owner.encoder is None and len(images_owner.cache) == 0
    llm.wake_up()
    assert images_owner.encoder is not None
    assert list(run("carol").outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert images_owner.cache.misses == 2  # encoded again after the sleep


def test_an_image_without_its_marker_is_refused(model_dir) -> None:
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL)
    with pytest.raises(ValueError, match="holds 0 image marker.* for 1 image"):
        llm.generate({"prompt": "no marker", "multi_modal_data": {"image": images(0)}})
    assert IMAGE_TOKEN in llm.tokenizer.backend.get_vocab()
    with pytest.raises(ValueError, match="pipeline-parallel-size: the image features join"):
        LLM(model_dir, pipeline_parallel_size=2)


# ---------------------------------------------------------------------------------------------
# Served: the three APIs


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed, (40 + 8 * seed, 30))).decode()


@pytest.mark.e2e
def test_served_images_answer_as_offline_on_every_api(model_dir, engine_pool, tmp_path) -> None:
    """The OpenAI client's image_url parts (data URLs), the Anthropic client's base64 image
    blocks and a Responses input_image: the offline engine's tokens for the same
    conversation, the image tokens counted in usage and by /tokenize."""
    import anthropic
    import openai

    llm = LLM(model_dir, kv_cache_memory_bytes=POOL)
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_pil", "image_pil": images(1)[0]},
        {"type": "text", "text": "with"},
        {"type": "image_pil", "image_pil": images(3)[0]},
    ]
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    offline = llm.chat([{"role": "user", "content": parts}], plain, use_tqdm=False)[0]
    expected, prompt_len = offline.outputs[0].text, len(offline.prompt_token_ids)
    del llm

    # (An engine of its own: /metrics' image encoder entries are counted from none.)
    log = tmp_path / "server.log"
    with engine_pool.serve(model_dir, log, "--served-model-name", "g3", shared=False) as server:
        urls = [data_url(1), data_url(3)]
        content = [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": urls[0]}},
            {"type": "text", "text": "with"},
            {"type": "image_url", "image_url": {"url": urls[1]}},
        ]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        chat = client.chat.completions.create(
            model="g3", messages=[{"role": "user", "content": content}], max_tokens=6,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert chat.choices[0].message.content == expected
        assert chat.usage.prompt_tokens == prompt_len

        blocks = [
            {"type": "text", "text": "Compare"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": urls[0].split(",", 1)[1]}},
            {"type": "text", "text": "with"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": urls[1].split(",", 1)[1]}},
        ]  # fmt: skip
        messages = anthropic.Anthropic(base_url=server.url, api_key="none").messages.create(
            model="g3", max_tokens=6, messages=[{"role": "user", "content": blocks}],
            extra_body={"ignore_eos": True, "temperature": 0.0},
        )  # fmt: skip
        assert messages.content[0].text == expected
        usage = messages.usage  # (the same images: a prefix-cache hit, counted apart)
        assert usage.input_tokens + usage.cache_read_input_tokens == prompt_len

        inputs = [
            {"type": "input_text", "text": "Compare"},
            {"type": "input_image", "image_url": urls[0]},
            {"type": "input_text", "text": "with"},
            {"type": "input_image", "image_url": urls[1]},
        ]
        response = client.responses.create(
            model="g3", input=[{"role": "user", "content": inputs}], max_output_tokens=6,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert response.output_text == expected

        counted = server.post(
            "/tokenize", {"model": "g3", "messages": [{"role": "user", "content": content}]}
        )
        assert counted.json()["count"] == prompt_len
        bad = server.post("/v1/chat/completions", {"model": "g3", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(1)[:60]}}]}]})  # fmt: skip
        assert bad.status_code == 400 and "messages[0].content[0]" in bad.text
        assert server.healthy()
        # Two images, each encoded once, on /metrics (the stats follow the steps: poll).
        entries = 'zllm:cache_entries{cache="image_encoder",'
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            metrics = server.get("/metrics").text
            lines = [line for line in metrics.splitlines() if line.startswith(entries)]
            if lines and float(lines[0].split()[-1]) == 2.0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"no image_encoder entries of 2 on /metrics: {lines}")
        assert 'cache_capacity{cache="image_encoder_bytes"' in metrics
