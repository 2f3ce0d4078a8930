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


# Qwen2.5-VL: 14-pixel patches merged 2x2 into tokens, windows of 2x2 tokens (56 pixels) in
# the encoder's windowed blocks; images resized to at most 16 tokens (max_pixels).
QWEN_VL_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    window_size=56,
    fullatt_block_indexes=[1],
)
QWEN_VL_TEXT = dict(
    vocab_size=49280,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
    bos_token_id=1,
    eos_token_id=2,
)
QWEN_VL_PIXELS = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
# The SmolLM2 vocabulary (49152 tokens) with Qwen2.5-VL's three image tokens after it.
QWEN_VL_IMAGE_TOKENS = {"<|vision_start|>": 49152, "<|image_pad|>": 49153, "<|vision_end|>": 49154}
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_vl_tokenizer(smollm2_gguf: str):
    """zllm's SmolLM2 tokenizer with Qwen2.5-VL's image tokens added (QWEN_VL_IMAGE_TOKENS)."""
    from tokenizers import AddedToken

    from zllm.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_gguf)
    tokenizer.backend.add_special_tokens(
        [AddedToken(text, special=True) for text in QWEN_VL_IMAGE_TOKENS]
    )
    for text, token_id in QWEN_VL_IMAGE_TOKENS.items():
        assert tokenizer.backend.token_to_id(text) == token_id, text
    return tokenizer


def write_tiny_qwen_vl(
    path: Path, smollm2_gguf: str, seed: int = 0, text: dict | None = None
) -> Path:
    """Qwen2_5_VLForConditionalGeneration with random weights (the merger's drawn wider than
    transformers' init, so images move the answer), Qwen2VLImageProcessor's config, and the
    tokenizer of qwen_vl_tokenizer with a Qwen-style chat template. `text`: the language
    model's config instead of QWEN_VL_TEXT (the merger's output width follows it)."""
    import json

    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    torch.manual_seed(seed)
    ids = QWEN_VL_IMAGE_TOKENS
    text = QWEN_VL_TEXT if text is None else text
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(QWEN_VL_VISION, out_hidden_size=text["hidden_size"]),
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        video_token_id=49155,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "merger" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(**QWEN_VL_PIXELS).save_pretrained(path)
    qwen_vl_tokenizer(smollm2_gguf).backend.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": QWEN_VL_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


# LLaVA (the transformers backend): CLIP's tower over 56-pixel crops in 14-pixel patches, its
# class token dropped ("default" strategy): 16 tokens an image.
LLAVA_IMAGE_TOKEN = ("<image>", 49152)
LLAVA_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def write_tiny_llava(path: Path, smollm2_gguf: str, seed: int = 0) -> Path:
    """LlavaForConditionalGeneration (a Llama language model, CLIP's vision tower) with random
    weights, CLIPImageProcessor's config and LlavaProcessor's (processor_config.json), and the
    SmolLM2 tokenizer with <image> added."""
    import json

    from tokenizers import AddedToken
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration

    from zllm.text.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    text = {k: v for k, v in QWEN_VL_TEXT.items() if k != "rope_parameters"}
    config = LlavaConfig(
        text_config={**text, "model_type": "llama"},
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
        ),  # fmt: skip
        image_token_id=LLAVA_IMAGE_TOKEN[1],
        vision_feature_layer=-1,
    )
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    CLIPImageProcessorPil(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
    ).save_pretrained(path)
    processor = {"processor_class": "LlavaProcessor", "patch_size": 14, "image_token": "<image>",
                 "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}  # fmt: skip
    (path / "processor_config.json").write_text(json.dumps(processor))
    tokenizer = load_tokenizer(smollm2_gguf)
    tokenizer.backend.add_special_tokens([AddedToken(LLAVA_IMAGE_TOKEN[0], special=True)])
    assert tokenizer.backend.token_to_id(LLAVA_IMAGE_TOKEN[0]) == LLAVA_IMAGE_TOKEN[1]
    tokenizer.backend.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": LLAVA_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path
