"""Tiny random vision-language models for the image tests (issue 60), built from
transformers' config classes of the real architectures and saved as Hugging Face
directories with their image processor's config."""

from __future__ import annotations

import io
import random
from pathlib import Path

import torch

# Gemma 3: a 56-pixel image in 14-pixel patches (a 4x4 grid) pooled to 4 tokens.
GEMMA3_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=56,
    patch_size=14,
)
GEMMA3_TEXT = dict(
    vocab_size=262208,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    sliding_window=16,
    max_position_embeddings=512,
)


IMAGE_TOKEN = "<image_soft_token>"
# Gemma 3's chat template in the part that matters here: turns, and an image part as the
# <start_of_image> marker the processor expands (the 270M package's template has no images).
GEMMA3_VLM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma3_vlm_tokenizer(gemma3_gguf: str):
    """zllm's Gemma 3 tokenizer (the 270M package's vocabulary) with the <image_soft_token> a
    vision checkpoint's tokenizer adds (id 262144)."""
    from tokenizers import AddedToken

    from zllm.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gemma3_gguf)
    tokenizer.backend.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True)])
    return tokenizer


def write_gemma3_vlm_tokenizer(path: Path, gemma3_gguf: str) -> None:
    """gemma3_vlm_tokenizer as tokenizer.json, and its config (the chat template above)."""
    import json

    gemma3_vlm_tokenizer(gemma3_gguf).backend.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<bos>",
        "eos_token": "<end_of_turn>",
        "chat_template": GEMMA3_VLM_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_tiny_gemma3_vlm(
    path: Path, seed: int = 0, tokens_per_image: int = 4, gemma3_gguf: str | None = None
) -> Path:
    """Gemma3ForConditionalGeneration with random weights (the projector's drawn wider than
    transformers' zero init, so images move the answer) and Gemma3ImageProcessor's config;
    with `gemma3_gguf`, the Gemma 3 tokenizer too (write_gemma3_vlm_tokenizer)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    torch.manual_seed(seed)
    config = Gemma3Config(
        text_config=GEMMA3_TEXT,
        vision_config=GEMMA3_VISION,
        mm_tokens_per_image=tokens_per_image,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    size = GEMMA3_VISION["image_size"]
    Gemma3ImageProcessorPil(size={"height": size, "width": size}).save_pretrained(path)
    if gemma3_gguf is not None:
        write_gemma3_vlm_tokenizer(path, gemma3_gguf)
    return path


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    """A PNG of random pixels."""
    from PIL import Image

    pixels = random.Random(seed).randbytes(size[0] * size[1] * 3)
    buffer = io.BytesIO()
    Image.frombytes("RGB", size, pixels).save(buffer, format="PNG")
    return buffer.getvalue()
