"""Gemma 3, text and vision-language (executor/models/gemma3.py, its SigLIP encoder in
executor/models/vision/gemma3.py): sandwich norms of 1 + weight, q/k head norms, GeGLU, five
sliding layers to one global with their own RoPE bases, an attention scale from
query_pre_attn_scalar, soft-capped logits. A vision checkpoint (model_type gemma3) nests its
language model in text_config; its images' tokens attend to each other both ways.

What Gemma 3 GGUF files leave out, as llama.cpp and transformers' GGUF loader assume it:
every 6th layer global, the rest sliding; the local RoPE base; the attention scale's scalar
is the head size (256 for the released models). llama.cpp stores its norms as 1 + weight."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Feature, ImageRules, Trait
from zllm.model.gguf import GGUFFile
from zllm.model.image_tokens import ImagePlaceholders

_PATTERN = 6
_LOCAL_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class Gemma3Fields:
    """What only Gemma 3's model reads (ModelArchConfig.family_fields)."""

    # The attention scale is query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5).
    query_pre_attn_scalar: float
    rope_local_theta: float  # the RoPE base of the sliding layers
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # (Gemma 2's; refused by the model)


def layer_types(num_layers: int, pattern: int = _PATTERN) -> list[str]:
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    if cfg["model_type"] != "gemma3":
        return _read_text_config(cfg, where)
    # The vision-language model: its language model, and images.
    if "vision_config" not in cfg:
        raise ValueError(f"{where}: a Gemma 3 'gemma3' config without vision_config")
    text = {"vocab_size": 262208, **(cfg.get("text_config") or {})}
    text_model = _read_text_config(text, where)
    return dataclasses.replace(text_model, vision=True)


def _read_text_config(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    """config.json of model_type gemma3_text, as transformers 4.5x or 5 writes it."""
    num_layers = int(hf_config.need(cfg, "num_hidden_layers", where))
    hidden = int(hf_config.need(cfg, "hidden_size", where))
    heads = int(hf_config.need(cfg, "num_attention_heads", where))
    head_dim = int(cfg.get("head_dim") or 256)
    types = cfg.get("layer_types") or layer_types(
        num_layers, int(cfg.get("sliding_window_pattern") or _PATTERN)
    )
    # transformers 5: rope_parameters per layer type; 4.x: rope_theta, rope_local_base_freq
    # and rope_scaling (which applies to the global layers only).
    rope = cfg.get("rope_parameters") or {}
    full_rope = dict(rope.get("full_attention") or {})
    local_rope = rope.get("sliding_attention") or {}
    rope_theta = full_rope.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local_theta = local_rope.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return ModelArchConfig(
        architecture="gemma3",
        family=FAMILY.name,
        vocab_size=int(hf_config.need(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(hf_config.need(cfg, "intermediate_size", where)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(hf_config.need(cfg, "max_position_embeddings", where)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope_scaling=hf_config.hf_rope_scaling(cfg, cfg.get("rope_scaling") or full_rope),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=hf_config.eos_token_ids(cfg),
        layer_types=list(types),
        sliding_window=int(cfg.get("sliding_window") or 4096),
        qk_norm=True,
        hidden_act=str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
        family_fields=Gemma3Fields(
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
            rope_local_theta=float(local_theta),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        ),
    )


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md = gguf.metadata

    def need(key: str, kind: type = float) -> Any:
        return gguf_config.need(gguf, f"gemma3.{key}", kind)

    hidden, heads = need("embedding_length", int), need("attention.head_count", int)
    head_dim = int(md.get("gemma3.attention.key_length", hidden // heads))
    num_layers = need("block_count", int)
    tokens = md.get("tokenizer.ggml.tokens") or []
    return ModelArchConfig(
        architecture="gemma3",
        family=FAMILY.name,
        vocab_size=len(tokens) or gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length", int),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(md.get("gemma3.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=need("attention.layer_norm_rms_epsilon"),
        rope_theta=float(md.get("gemma3.rope.freq_base", 1_000_000.0)),
        max_position_embeddings=need("context_length", int),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        rope_scaling=gguf_config.rope_scaling(md, "gemma3"),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_config.eos_token_ids(md),
        layer_types=layer_types(num_layers),
        sliding_window=need("attention.sliding_window", int),
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        family_fields=Gemma3Fields(float(head_dim), _LOCAL_ROPE_THETA),
    )


def tokens_per_image(config: dict) -> int:
    """The tokens one image takes in a Gemma 3 prompt, from its config.json (transformers'
    default where the config leaves it out)."""
    return int(config.get("mm_tokens_per_image", 256))


def placeholders(
    model_path: str, config: dict, token_text: Callable[[int], str | None]
) -> ImagePlaceholders:
    """Gemma3Processor's expansion: "<start_of_image>" -> "\\n\\n<start_of_image>" +
    mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\\n\\n", from config.json's
    token ids and the tokenizer's text for them (`token_text`: id -> token string, None when
    unknown)."""
    ids = {
        "boi_token_index": config.get("boi_token_index", 255999),
        "eoi_token_index": config.get("eoi_token_index", 256000),
        "image_token_index": config.get("image_token_index", 262144),
    }
    texts = {}
    for field, token_id in ids.items():
        text = token_text(token_id)
        if text is None:
            raise ValueError(
                f"the tokenizer has no token {token_id} (config.json's {field}): a Gemma 3 "
                f"vision checkpoint's tokenizer holds its image tokens"
            )
        texts[field] = text
    return ImagePlaceholders(
        marker=texts["boi_token_index"],
        before=f"\n\n{texts['boi_token_index']}",
        image_token=texts["image_token_index"],
        after=f"{texts['eoi_token_index']}\n\n",
        image_token_id=ids["image_token_index"],
        tokens_per_image=tokens_per_image(config),
    )


FAMILY = Family(
    name="gemma3",
    title="Gemma 3",
    model_types=("gemma3_text", "gemma3"),
    gguf_architectures=("gemma3",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    # Four norms per layer and per-head q/k norms; its ffn_norm is the norm before the MLP
    # (Llama's ffn_norm is that same position, named after the attention there).
    gguf_tensor_names={
        **gguf_config.LAYER_NAMES,
        **gguf_config.QK_NORM_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    gguf_norms_plus_one=True,
    fields=Gemma3Fields,
    model_class="zllm.executor.models.gemma3:Gemma3ForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW, Trait.VISION, Trait.BIDIRECTIONAL_IMAGES}),
    lacks={Feature.CLASSIFIER_HEAD: "its model code carries no score head"},
    images=ImageRules(
        placeholders=placeholders,
        max_tokens=lambda model_path, config: tokens_per_image(config),
        encoder="zllm.executor.models.vision.gemma3:Gemma3Images",
    ),
)
