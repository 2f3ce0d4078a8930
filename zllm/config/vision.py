"""What a vision-language model (ModelArchConfig.vision: Gemma 3 with its SigLIP encoder and
Qwen2.5-VL with its window-attention encoder in zllm's code, LLaVA in transformers') runs
with, and the engine options it refuses at start, each naming why. No torch here.

Its images are encoded on each executor rank (executor/models/vision/) and their features
replace the placeholder tokens' embeddings. Gemma 3's image tokens attend to each other both
ways, so each image is prefilled in one step (core/request.py chunk_end keeps it in one
chunk); Qwen2.5-VL's are causal, placed by M-RoPE positions; LLaVA's are causal. With zllm's
models, tensor ranks (each holding the encoder), n-gram speculation, int8 weights, LoRA on
the language model, KV tiers and disaggregation run with images
(tests/test_images_compose.py). The options below do not, and are refused before any
process starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from zllm.config.engine import EngineConfig
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import ImageRules, Trait
from zllm.model.registry import code_family, family_of


def _image_rules(arch: ModelArchConfig) -> ImageRules:
    rules = family_of(arch).images
    if rules is None:  # (a vision model on a family without image rules: refused below)
        raise ValueError(f"{arch.architecture}: no image rules on the transformers backend")
    return rules


def tokens_per_image(model_path: str, arch: ModelArchConfig) -> int:
    """The tokens of one image that one step must compute together: where the family's image
    tokens attend to each other both ways (Gemma 3's), one image's; 0 where images chunk like
    text, or none come."""
    if not (arch.vision and family_of(arch).has(Trait.BIDIRECTIONAL_IMAGES)):
        return 0
    config = json.loads((Path(model_path) / "config.json").read_text())
    return _image_rules(arch).max_tokens(model_path, config)


def set_encoder_budget(config: EngineConfig) -> None:
    """The image encoder tokens one step may start: as many as the step's tokens (vLLM's
    default), and never fewer than one image's most, so every image fits a step of its own."""
    if not config.arch.vision or family_of(config.arch).images is None:
        return
    model = json.loads((Path(config.model_path) / "config.json").read_text())
    most = _image_rules(config.arch).max_tokens(config.model_path, model)
    config.scheduler.max_num_encoder_tokens = max(config.scheduler.max_num_batched_tokens, most)


def vision_refusals(config: EngineConfig, tokens_per_image: int) -> list[str]:
    """Why each option in `config` cannot run this vision-language model (empty: the config
    runs as asked, or the model takes no images). `tokens_per_image`: one image's tokens
    that one step computes together (tokens_per_image)."""
    if not config.arch.vision:
        return []
    reasons = []
    if config.pipeline_parallel_size > 1:
        reasons.append(
            "--pipeline-parallel-size: the image features join the embeddings, which only "
            "the first stage holds"
        )
    if code_family(config.arch, config.model_impl).images is None:  # on transformers' code
        reasons.append("--model-impl transformers: zllm's own model code takes the images")
    if config.speculative is not None and config.speculative.method != "ngram":
        reasons.append(
            f"--speculative-config method {config.speculative.method}: the draft would read "
            f"the image placeholders as text (n-gram speculation runs with images)"
        )
    if config.deterministic and family_of(config.arch).has(Trait.BIDIRECTIONAL_IMAGES):
        reasons.append(
            "--deterministic: batch-invariant attention is causal, and this model's image "
            "tokens attend to each other both ways"
        )
    if config.quantization not in (None, "none", "16-bit", "int8"):
        reasons.append(
            f"--quantization {config.quantization}: a vision model's language model runs "
            f"unquantized or with int8 weights"
        )
    budget = config.scheduler.max_num_batched_tokens
    seqs = config.scheduler.max_num_seqs
    if tokens_per_image and tokens_per_image + seqs - 1 > budget:
        reasons.append(
            f"--max-num-batched-tokens {budget}: an image's {tokens_per_image} tokens are "
            f"prefilled in one step, beside up to {seqs - 1} other sequences' tokens (at least "
            f"{tokens_per_image + seqs - 1})"
        )
    return reasons


def check_vision(config: EngineConfig, tokens_per_image: int) -> None:
    reasons = vision_refusals(config, tokens_per_image)
    if reasons:
        raise ValueError(
            f"{config.arch.architecture} with images (a vision-language model) cannot run with "
            + "; ".join(reasons)
        )
