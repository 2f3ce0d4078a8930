"""Image placeholders expanded in the tokenizer workers (zllm/media/placeholders.py) as the
model's transformers processor expands them: Gemma 3's on its real tokenizer (the 270M
package's, plus the <image_soft_token> the vision checkpoints' tokenizers add)."""

from __future__ import annotations

import os

import pytest
from vision_models import IMAGE_TOKEN, gemma3_vlm_tokenizer

from zllm.media.placeholders import image_spans
from zllm.model.families import gemma3, qwen2_5_vl
from zllm.text.tokenizer import load_tokenizer

CONFIG = {"mm_tokens_per_image": 4, "boi_token_index": 255999, "eoi_token_index": 256000,
          "image_token_index": 262144}  # fmt: skip
PROMPTS = [
    "Look <start_of_image> and <start_of_image>!",
    "<start_of_image>What is this?",
    "Two lines\n<start_of_image>\nend",
]


@pytest.fixture(scope="module")
def tokenizers(gemma3_path):
    """zllm's Gemma 3 tokenizer and transformers' Gemma3Processor over the same vocabulary,
    each with the image token added."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    ours = gemma3_vlm_tokenizer(gemma3_path)
    folder, name = os.path.split(gemma3_path)
    hf = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    hf.boi_token, hf.eoi_token, hf.image_token = "<start_of_image>", "<end_of_image>", IMAGE_TOKEN
    hf.boi_token_id = hf.convert_tokens_to_ids("<start_of_image>")
    hf.image_token_id = hf.convert_tokens_to_ids(IMAGE_TOKEN)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(), tokenizer=hf, image_seq_length=4
    )
    return ours, processor


def test_gemma3_prompts_tokenize_as_its_processor_writes_them(tokenizers) -> None:
    from PIL import Image

    ours, processor = tokenizers
    placeholders = gemma3.placeholders("", CONFIG, ours.backend.id_to_token)
    assert placeholders.image_token_id == ours.backend.token_to_id(IMAGE_TOKEN) == 262144
    image = Image.new("RGB", (8, 8))
    for prompt in PROMPTS:
        count = prompt.count("<start_of_image>")
        expected = processor(text=[prompt], images=[[image] * count])
        ids = ours.encode(placeholders.expand(prompt, [4] * count), add_special_tokens=True)
        assert ids == list(expected["input_ids"][0]), prompt
        image_types = [i for i, t in enumerate(expected["token_type_ids"][0]) if t == 1]
        spans = image_spans(ids, placeholders.image_token_id)
        assert [i for start, n in spans for i in range(start, start + n)] == image_types
        assert [n for _, n in spans] == [4] * count


def test_markers_and_images_must_agree(tokenizers, gemma3_path) -> None:
    ours, _ = tokenizers
    placeholders = gemma3.placeholders("", CONFIG, ours.backend.id_to_token)
    with pytest.raises(ValueError, match="holds 1 image marker.* for 2 image"):
        placeholders.expand("one <start_of_image>", [4, 4])
    text_only = load_tokenizer(gemma3_path)  # the 270M tokenizer as shipped: no image token
    with pytest.raises(ValueError, match="no token 262144 .*image_token_index"):
        gemma3.placeholders("", CONFIG, text_only.backend.id_to_token)


def test_qwen_vl_counts_each_image_as_its_processor_grids_it(smollm2_path) -> None:
    """Qwen2.5-VL's image tokens follow the image's size: ours (zllm/model/image_tokens.py, no
    torch) are Qwen2VLImageProcessor's grid over merge^2 for sizes across its resize rules
    (scaled up to min_pixels, down to max_pixels, rounded half to even), and the marker
    expands in place. (Qwen2_5_VLProcessor itself needs torchvision for its video half;
    its image expansion is this count of <|image_pad|>.)"""
    import random

    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil
    from vision_models import QWEN_VL_IMAGE_TOKENS, QWEN_VL_PIXELS, qwen_vl_tokenizer

    from zllm.model.image_tokens import ImageGrid

    processor = Qwen2VLImageProcessorPil(**QWEN_VL_PIXELS)
    grid = ImageGrid(**QWEN_VL_PIXELS)
    tokenizer = qwen_vl_tokenizer(smollm2_path)
    config = {"image_token_id": QWEN_VL_IMAGE_TOKENS["<|image_pad|>"]}
    placeholders = qwen2_5_vl.placeholders(config, grid, tokenizer.backend.id_to_token)
    rng = random.Random(0)
    sizes = [(14, 14), (42, 42), (70, 70), (98, 42), (500, 30), (30, 900), (1000, 1000)]
    sizes += [(rng.randint(8, 600), rng.randint(8, 600)) for _ in range(12)]
    for width, height in sizes:
        t, h, w = processor(images=[Image.new("RGB", (width, height))])["image_grid_thw"][0]
        assert placeholders.count(width, height) == t * h * w // 4, (width, height)
    mark = "<|vision_start|><|image_pad|><|vision_end|>"
    text = placeholders.expand(f"a {mark} b {mark}", [3, 2])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert [n for _, n in image_spans(ids, placeholders.image_token_id)] == [3, 2]
    with pytest.raises(ValueError, match="image_token_id"):
        qwen2_5_vl.placeholders({"image_token_id": 10**6}, grid, tokenizer.backend.id_to_token)
