"""Image placeholders expanded in the tokenizer workers (zllm/media/placeholders.py) as the
model's transformers processor expands them: Gemma 3's on its real tokenizer (the 270M
package's, plus the <image_soft_token> the vision checkpoints' tokenizers add)."""

from __future__ import annotations

import os

import pytest
from vision_models import IMAGE_TOKEN, gemma3_vlm_tokenizer

from zllm.media.placeholders import gemma3_placeholders, image_spans
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
    placeholders = gemma3_placeholders(CONFIG, ours.backend.id_to_token)
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
    placeholders = gemma3_placeholders(CONFIG, ours.backend.id_to_token)
    with pytest.raises(ValueError, match="holds 1 image marker.* for 2 image"):
        placeholders.expand("one <start_of_image>", [4, 4])
    text_only = load_tokenizer(gemma3_path)  # the 270M tokenizer as shipped: no image token
    with pytest.raises(ValueError, match="no token 262144 .*image_token_index"):
        gemma3_placeholders(CONFIG, text_only.backend.id_to_token)
