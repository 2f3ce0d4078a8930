"""The tiny Qwen2.5-VL's inputs and transformers' answers for them, for the image tests
(test_qwen_vl.py, test_images_compose.py): images of set sizes by seed, and transformers'
greedy tokens and prompt log-probabilities on the same processed inputs."""

from __future__ import annotations

import base64
import io

import torch
from PIL import Image
from vision_models import QWEN_VL_IMAGE_TOKENS, png

IMAGE_PAD = QWEN_VL_IMAGE_TOKENS["<|image_pad|>"]
MARK = "<|vision_start|><|image_pad|><|vision_end|>"
# Image sizes (pixels) by seed: wide, tall, square, and small enough for min_pixels.
SIZES = {0: (90, 40), 1: (40, 110), 2: (70, 70), 3: (20, 20)}


def encoded(seed: int) -> bytes:
    return png(seed, SIZES[seed])


def images(*seeds: int) -> list[Image.Image]:
    return [Image.open(io.BytesIO(encoded(seed))) for seed in seeds]


def hf_inputs(model_dir: str, ids: list[int], seeds: list[int]) -> dict:
    from transformers import AutoImageProcessor

    processed = AutoImageProcessor.from_pretrained(model_dir)(
        images=[image.convert("RGB") for image in images(*seeds)], return_tensors="pt"
    )
    prompt = torch.tensor([ids])
    return {
        "input_ids": prompt,
        "pixel_values": processed["pixel_values"],
        "image_grid_thw": processed["image_grid_thw"],
        "mm_token_type_ids": (prompt == IMAGE_PAD).int(),
    }


def hf_answer(model, model_dir: str, ids: list[int], seeds: list[int], n: int, mrope=True):
    """transformers' greedy tokens and each prompt token's log-probability after the first,
    for the prompt ids and images (without `mrope`: every token at its index instead)."""
    inputs = hf_inputs(model_dir, ids, seeds)
    if not mrope:
        del inputs["mm_token_type_ids"]
    model.model.rope_deltas = None  # (transformers keeps the last prompt's here)
    tokens = []
    with torch.inference_mode():
        out = model(**inputs, use_cache=True)
        scores = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
        prompt_logprobs = scores.gather(1, inputs["input_ids"][0, 1:, None])[:, 0]
        for _ in range(n):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return tokens, prompt_logprobs


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(seed)).decode()
