"""Qwen2.5-VL with images (issue 60): a tiny random Qwen2_5_VLForConditionalGeneration (its
window-attention vision encoder, merger and Qwen2 language model from transformers' config
classes; the SmolLM2 vocabulary with Qwen's image tokens added) against transformers on the
same processed inputs: greedy tokens equal, every prompt token's log-probability close, the
M-RoPE positions included; images of other sizes take other token counts (dynamic
resolution), counted the same in the tokenizer workers and on /tokenize; image tokens split
across chunks; served on the OpenAI, Anthropic and Responses APIs."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_vl_reference import (
    IMAGE_PAD,
    MARK,
    SIZES,
    data_url,
    hf_answer,
    hf_inputs,
    images,
)
from vision_models import QWEN_VL_IMAGE_TOKENS, write_tiny_qwen_vl

from zllm import LLM, SamplingParams
from zllm.executor.models.vision.mrope import request_positions
from zllm.model.image_tokens import ImageGrid
from zllm.protocol import ImageData, PlacedImage

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
POOL = 64 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_path) -> str:
    path = tmp_path_factory.mktemp("qwen-vl") / "model"
    return str(write_tiny_qwen_vl(path, smollm2_path))


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()


def assert_answers_as_transformers(output, model, model_dir: str, seeds: list[int]) -> None:
    """Greedy tokens equal; every prompt token's log-probability within 1e-4 (in practice
    within 1e-5), where the tokens at their plain indices (no M-RoPE) are off by more than
    5e-4 (this random model's answers are near uniform over its 49K tokens)."""
    ids = list(output.prompt_token_ids)
    grid = ImageGrid.of_model(model_dir)
    assert ids.count(IMAGE_PAD) == sum(grid.tokens(*SIZES[s]) for s in seeds)
    tokens, expected = hf_answer(model, model_dir, ids, seeds, GREEDY.max_tokens)
    assert list(output.outputs[0].token_ids) == tokens
    pairs = zip(output.prompt_logprobs[1:], ids[1:], strict=True)
    ours = torch.tensor([entry[t].logprob for entry, t in pairs])
    assert float((ours - expected).abs().max()) < 1e-4
    _, plain = hf_answer(model, model_dir, ids, seeds, 0, mrope=False)
    assert float((ours - plain).abs().max()) > 5e-4


def test_mrope_positions_match_transformers(model_dir, reference) -> None:
    """request_positions over a prompt and over any cut of it: transformers' get_rope_index,
    and the tokens after the prompt shifted by its rope delta."""
    grid = ImageGrid.of_model(model_dir)
    for seeds in ([0], [1, 2], [3, 0, 1]):
        ids = [5, 6]
        placed = []
        for seed in seeds:
            count = grid.tokens(*SIZES[seed])
            image = ImageData(b"", *SIZES[seed], str(seed))
            placed.append(PlacedImage(image, len(ids) + 1, count))
            ids += [QWEN_VL_IMAGE_TOKENS["<|vision_start|>"], *[IMAGE_PAD] * count, 7, 8]
        inputs = hf_inputs(model_dir, ids, seeds)
        expected, delta = reference.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
        ours = request_positions(placed, grid, 0, len(ids) + 3)
        assert np.array_equal(ours[:, : len(ids)], expected[:, 0].numpy())
        after = np.arange(len(ids), len(ids) + 3) + int(delta)
        assert np.array_equal(ours[:, len(ids) :], np.stack([after] * 3))
        for cut in (3, len(ids) // 2, len(ids) - 1):
            assert np.array_equal(
                request_positions(placed, grid, cut, len(ids)), ours[:, cut : len(ids)]
            )


def test_prompts_with_images_answer_as_transformers(model_dir, reference) -> None:
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL)
    prompt = {"prompt": f"Describe {MARK} and then {MARK} briefly", "multi_modal_data": {"image": images(0, 1)}}  # fmt: skip
    assert_answers_as_transformers(llm.generate(prompt, GREEDY, use_tqdm=False)[0], reference,
                                   model_dir, [0, 1])  # fmt: skip
    one = {"prompt": f"{MARK} what is it", "multi_modal_data": {"image": images(2)}}
    assert_answers_as_transformers(llm.generate(one, GREEDY, use_tqdm=False)[0], reference,
                                   model_dir, [2])  # fmt: skip
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_pil", "image_pil": images(1)[0]},
        {"type": "image_pil", "image_pil": images(3)[0]},
        {"type": "text", "text": "with"},
        {"type": "image_pil", "image_pil": images(0)[0]},
    ]
    chat = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    assert_answers_as_transformers(chat, reference, model_dir, [1, 3, 0])


def test_image_tokens_split_across_chunks(model_dir, reference) -> None:
    """Five tokens a step: the chunks end inside the images (their attention is causal, as
    text's), and the answer is transformers' still."""
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL, max_num_batched_tokens=5, max_num_seqs=2)
    # The encoder may start one image of the most tokens (max_pixels) in a step, even here.
    assert llm.config.scheduler.max_num_encoder_tokens == 16
    assert ImageGrid.of_model(model_dir).tokens(*SIZES[0]) > 5  # (so no chunk holds it whole)
    prompt = {"prompt": f"See {MARK} and {MARK}.", "multi_modal_data": {"image": images(2, 0)}}
    assert_answers_as_transformers(llm.generate(prompt, GREEDY, use_tqdm=False)[0], reference,
                                   model_dir, [2, 0])  # fmt: skip


def test_the_encoder_cache_and_image_keyed_prefix_blocks(model_dir) -> None:
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL, block_size=4)
    cache = llm.model_runner.host.images.cache
    text = "A preface every prompt shares, " * 3 + MARK + " and words after it" * 2
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run(seed: int):
        prompt = {"prompt": text, "multi_modal_data": {"image": images(seed)}}
        return llm.generate(prompt, plain, use_tqdm=False)[0]

    first = run(2)
    image_start = list(first.prompt_token_ids).index(IMAGE_PAD)
    again = run(2)
    assert (cache.misses, cache.hits) == (1, 0)  # (the second run took every block cached)
    assert again.num_cached_tokens > image_start + 4
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    other = run(1)
    assert 0 < other.num_cached_tokens <= image_start
    assert cache.misses == 2 and len(cache) == 2


def test_bad_images_and_options_are_refused(model_dir) -> None:
    llm = LLM(model_dir, kv_cache_memory_bytes=POOL)
    with pytest.raises(ValueError, match="holds 0 image marker.* for 1 image"):
        llm.generate({"prompt": "no marker", "multi_modal_data": {"image": images(0)}})
    thin = Image.new("RGB", (402, 2))
    with pytest.raises(ValueError, match="402x2 pixels: its sides may differ by at most 200x"):
        llm.generate({"prompt": MARK, "multi_modal_data": {"image": [thin]}})
    ok = llm.generate({"prompt": f"{MARK} after", "multi_modal_data": {"image": images(3)}},
                      SamplingParams(max_tokens=2), use_tqdm=False)  # fmt: skip
    assert len(ok[0].outputs[0].token_ids) == 2
    # A GPU is no longer refused (tests/test_cuda_vision.py runs it there: the image masks
    # on the torch attention backend).
    from zllm.config.engine_args import EngineArgs

    assert EngineArgs(model=model_dir, device="cuda").create_engine_config().arch.vision


@pytest.mark.e2e
def test_served_images_answer_as_offline(model_dir, engine_pool, tmp_path) -> None:
    """The OpenAI client's image_url parts, the Anthropic client's base64 image blocks and a
    Responses input_image: the offline engine's tokens for the same conversation;
    /tokenize counts each image's tokens from its size; an image the processor refuses is
    a 400 naming it, and the server goes on."""
    import anthropic
    import openai

    llm = LLM(model_dir, kv_cache_memory_bytes=POOL)
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_pil", "image_pil": images(0)[0]},
        {"type": "text", "text": "with"},
        {"type": "image_pil", "image_pil": images(1)[0]},
    ]
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    offline = llm.chat([{"role": "user", "content": parts}], plain, use_tqdm=False)[0]
    expected, prompt_len = offline.outputs[0].text, len(offline.prompt_token_ids)
    del llm

    with engine_pool.serve(
        model_dir, tmp_path / "server.log", "--served-model-name", "qvl"
    ) as server:
        content = [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": data_url(0)}},
            {"type": "text", "text": "with"},
            {"type": "image_url", "image_url": {"url": data_url(1)}},
        ]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        chat = client.chat.completions.create(
            model="qvl", messages=[{"role": "user", "content": content}], max_tokens=6,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert chat.choices[0].message.content == expected
        assert chat.usage.prompt_tokens == prompt_len

        blocks = [
            {"type": "text", "text": "Compare"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": data_url(0).split(",", 1)[1]}},
            {"type": "text", "text": "with"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": data_url(1).split(",", 1)[1]}},
        ]  # fmt: skip
        messages = anthropic.Anthropic(base_url=server.url, api_key="none").messages.create(
            model="qvl", max_tokens=6, messages=[{"role": "user", "content": blocks}],
            extra_body={"ignore_eos": True, "temperature": 0.0},
        )  # fmt: skip
        assert messages.content[0].text == expected

        inputs = [
            {"type": "input_text", "text": "Compare"},
            {"type": "input_image", "image_url": data_url(0)},
            {"type": "input_text", "text": "with"},
            {"type": "input_image", "image_url": data_url(1)},
        ]
        response = client.responses.create(
            model="qvl", input=[{"role": "user", "content": inputs}], max_output_tokens=6,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert response.output_text == expected

        counted = server.post(
            "/tokenize", {"model": "qvl", "messages": [{"role": "user", "content": content}]}
        )
        assert counted.json()["count"] == prompt_len
        thin = io.BytesIO()
        Image.new("RGB", (402, 2)).save(thin, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(thin.getvalue()).decode()
        bad = server.post("/v1/chat/completions", {"model": "qvl", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})  # fmt: skip
        assert bad.status_code == 400 and "402x2" in bad.text, bad.text
        assert server.healthy()
