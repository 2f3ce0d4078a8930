"""What a model file says about the model's shape (`ModelArchConfig`): from a Hugging Face
directory's config.json or a GGUF file's metadata, Gemma 3's conventions included. No torch
here."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from zllm.model.arch_config import ModelArchConfig
from zllm.model.checkpoint_names import is_base_model
from zllm.model.files import registry_entry_of
from zllm.model.gguf import GGUFFile, invalid_gguf, read_gguf
from zllm.model.moe_arch import moe_fields_from_gguf, moe_fields_from_hf

logger = logging.getLogger(__name__)


SUPPORTED_ARCHITECTURES = (
    "deepseek_v2",
    "gemma3",  # Gemma3ForConditionalGeneration: its language model, with images
    "gemma3_text",
    "gpt_oss",
    "llama",
    "mistral",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen2_5_vl",  # Qwen2_5_VLForConditionalGeneration: its Qwen2 language model, with images
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
)
# GGUF general.architecture names (llama.cpp's): a Mistral checkpoint converts to "llama".
SUPPORTED_GGUF_ARCHITECTURES = (
    "deepseek2",
    "gemma3",
    "gpt-oss",
    "llama",
    "phi3",
    "qwen2",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
)


def read_arch_config(model_path: str) -> ModelArchConfig:
    if os.path.isdir(model_path):
        arch = _arch_from_hf_dir(Path(model_path))
        labels = sequence_labels(Path(model_path))
        if labels:  # a classifier: a score head in place of the LM head
            arch = dataclasses.replace(
                arch, tie_word_embeddings=True, lm_head=False, num_labels=len(labels)
            )
        elif is_base_model(Path(model_path)):
            # A base model's checkpoint (an embedding model's decoder): it pools; the model
            # still builds an LM head, which the tied embedding fills.
            arch = dataclasses.replace(arch, tie_word_embeddings=True, lm_head=False)
        return arch
    gguf = read_gguf(model_path)
    if gguf.metadata.get("general.architecture") == "gemma3":
        arch = _gemma3_arch_from_gguf(gguf)
    elif gguf.metadata.get("general.architecture") == "deepseek2":
        from zllm.model.deepseek_arch import deepseek2_arch_from_gguf

        arch = deepseek2_arch_from_gguf(gguf)
    elif gguf.metadata.get("general.architecture") == "gpt-oss":
        from zllm.model.gpt_oss_arch import gpt_oss_arch_from_gguf

        arch = gpt_oss_arch_from_gguf(gguf)
    else:
        arch = _arch_from_gguf(gguf)
    entry = registry_entry_of(model_path)
    if entry is not None and entry.stop_tokens:
        tokens = gguf.metadata.get("tokenizer.ggml.tokens") or []
        extra = [tokens.index(t) for t in entry.stop_tokens if t in tokens]
        arch.eos_token_ids = list(dict.fromkeys([*arch.eos_token_ids, *extra]))
    return arch


def sequence_labels(directory: Path) -> list[str]:
    """A `*ForSequenceClassification` checkpoint's labels in index order (id2label, else
    LABEL_i for num_labels); empty for any other model."""
    cfg = json.loads((directory / "config.json").read_text())
    if not any(
        str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or []
    ):
        return []
    id2label = cfg.get("id2label") or {}
    count = len(id2label) or int(cfg.get("num_labels", 2))
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)]


def _arch_from_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md, path = gguf.metadata, gguf.path

    def need(key: str, kind: type) -> Any:
        value = md.get(key)
        if value is None:
            raise invalid_gguf(path, f"missing metadata key {key!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) and kind is not bool:
            raise invalid_gguf(path, f"metadata key {key!r} is {value!r}, expected {kind.__name__}")
        return kind(value)

    arch = md.get("general.architecture")
    if arch is None:
        raise invalid_gguf(path, "missing metadata key 'general.architecture'")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported architecture {arch!r} "
            f"(zllm runs GGUF files of {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    hidden, heads = need(f"{arch}.embedding_length", int), need(f"{arch}.attention.head_count", int)
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise invalid_gguf(path, "missing tensor 'token_embd.weight'")
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = md.get(f"{arch}.vocab_size") or (len(tokens) if tokens else embd.shape[0])
    # End of sequence, end of turn (chat models), end of message (Llama 3.1 tool calls).
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [md[f"tokenizer.ggml.{k}"] for k in eos_keys if f"tokenizer.ggml.{k}" in md]
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // heads))
    num_layers = need(f"{arch}.block_count", int)
    max_positions = need(f"{arch}.context_length", int)
    layer_types, window = _gguf_sliding_window(md, arch, num_layers, max_positions)
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=need(f"{arch}.feed_forward_length", int),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=need(f"{arch}.attention.layer_norm_rms_epsilon", float),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        # Qwen2's q/k/v biases; Phi-3's fused q/k/v matrix has none.
        attention_bias="blk.0.attn_q.bias" in gguf.tensors or "blk.0.attn_qkv.bias" in gguf.tensors,
        rope_scaling=_partial_rotary(
            gguf, arch, head_dim, _gguf_longrope(gguf, arch) or _gguf_rope_scaling(md, arch)
        ),
        rope_freq_factors=_gguf_rope_freq_factors(gguf),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(t) for t in eos)),
        layer_types=layer_types,
        sliding_window=window,
        qk_norm=arch in ("qwen3", "qwen3moe"),
        **moe_fields_from_gguf(gguf, arch, num_layers),  # zllm/model/moe_arch.py
    )


def _gguf_sliding_window(
    md: dict[str, Any], arch: str, num_layers: int, max_positions: int
) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) as the checkpoint's config.json had them.

    llama.cpp's converter writes a window for Phi-3 only (phi3.attention.sliding_window: its
    config's sliding_window, 0 for none), and transformers windows every Phi-3 layer with it.
    (llama.cpp itself ignores Phi-3's window; zllm runs the file as its checkpoint runs.) A
    Mistral checkpoint converts to a "llama" file without its window: it attends over the
    whole context there, as in llama.cpp. A window no shorter than the context drops nothing.
    """
    window = md.get(f"{arch}.attention.sliding_window") if arch == "phi3" else None
    if not window or window >= max_positions:
        return None, None
    return ["sliding_attention"] * num_layers, int(window)


def _gguf_longrope(gguf: GGUFFile, arch: str) -> dict[str, Any] | None:
    """Phi-3's LongRoPE: the converter stores the long and short per-frequency factors as F32
    tensors (rope_factors_long/short.weight) and the pretraining context as
    rope.scaling.original_context_length; rope.scaling.type stays unwritten."""
    if "rope_factors_long.weight" not in gguf.tensors:
        return None
    md = gguf.metadata
    long, short = (_f32_vector(gguf, f"rope_factors_{k}.weight") for k in ("long", "short"))
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if not isinstance(original, int) or original <= 0:
        raise invalid_gguf(
            gguf.path, f"LongRoPE factors without {arch}.rope.scaling.original_context_length"
        )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": long,
        "short_factor": short,
        "original_max_position_embeddings": original,
    }
    # The converter writes the attention factor in float32; when it is LongRoPE's own
    # sqrt(1 + ln(s) / ln(original)) (s: the context extension), it is recomputed in float64
    # (as transformers does from config.json), else kept.
    stored = md.get(f"{arch}.rope.scaling.attn_factor")
    context = md.get(f"{arch}.context_length") or original
    extension = context / original
    default = math.sqrt(1 + math.log(extension) / math.log(original)) if extension > 1 else 1.0
    if stored is not None and np.float32(stored) != np.float32(default):
        scaling["attention_factor"] = float(stored)
    return scaling


def _partial_rotary(
    gguf: GGUFFile, arch: str, head_dim: int, scaling: dict[str, Any] | None
) -> dict[str, Any] | None:
    """RoPE over the first rope.dimension_count dimensions of each head (Phi-4-mini: 3/4),
    as the partial_rotary_factor transformers reads; only Phi-3 files may rotate part."""
    rotary = gguf.metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary == head_dim:
        return scaling
    if arch != "phi3" or not 0 < rotary < head_dim or rotary % 2:
        raise ValueError(
            f"{gguf.path}: {arch}.rope.dimension_count is {rotary} for heads of {head_dim} "
            f"(zllm rotates part of each head in phi3 files only)"
        )
    return {"rope_type": "default", **(scaling or {}), "partial_rotary_factor": rotary / head_dim}


def _f32_vector(gguf: GGUFFile, name: str) -> list[float]:
    info = gguf.tensors[name]
    if info.ggml_type != GGMLQuantizationType.F32 or len(info.shape) != 1:
        raise invalid_gguf(
            gguf.path, f"{name} is {info.ggml_type.name} {list(info.shape)}, not F32 [n]"
        )
    return gguf.tensor_data(name).view(np.float32).tolist()


def _gguf_rope_freq_factors(gguf: GGUFFile) -> list[float] | None:
    """Llama 3.x files store their RoPE scaling as one divisor per frequency (F32
    rope_freqs.weight, [rotary_dim / 2]) rather than as rope.scaling.* parameters."""
    if "rope_freqs.weight" not in gguf.tensors:
        return None
    return _f32_vector(gguf, "rope_freqs.weight")


def _gguf_rope_scaling(md: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor") or md.get(f"{arch}.rope.scale_linear")
    if kind is None and factor:
        kind = "linear"  # old files only wrote rope.scale_linear
    if kind in (None, "none") or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _arch_from_hf_dir(directory: Path) -> ModelArchConfig:
    config_path = directory / "config.json"
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_path}: {e}") from None
    model_type = cfg.get("model_type")
    if model_type == "gemma3":  # the vision-language model: its language model, and images
        text = {"vocab_size": 262208, **(cfg.get("text_config") or {})}
        if "vision_config" not in cfg:
            raise ValueError(f"{config_path}: a Gemma 3 'gemma3' config without vision_config")
        gemma3 = _gemma3_arch_from_hf(text, config_path)
        return dataclasses.replace(gemma3, vision=True, images_bidirectional=True)
    if model_type == "gemma3_text":
        return _gemma3_arch_from_hf(cfg, config_path)
    if model_type == "gpt_oss":  # sinks, alternating windows, experts (zllm/model/gpt_oss_arch.py)
        from zllm.model.gpt_oss_arch import gpt_oss_arch_from_hf

        return gpt_oss_arch_from_hf(cfg, config_path)
    if model_type == "deepseek_v2":  # multi-head latent attention (zllm/model/deepseek_arch.py)
        from zllm.model.deepseek_arch import deepseek_v2_arch_from_hf

        return deepseek_v2_arch_from_hf(cfg, config_path)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{config_path}: unsupported model_type {model_type!r} "
            f"(zllm runs {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if model_type == "qwen2_5_vl":  # the vision-language model: a Qwen2 decoder with M-RoPE
        cfg, mrope_section = _qwen_vl_text_config(cfg, config_path)
        arch = _arch_from_hf_config(cfg, config_path)
        return dataclasses.replace(arch, vision=True, mrope_section=mrope_section)
    return _arch_from_hf_config(cfg, config_path)


def _qwen_vl_text_config(
    cfg: dict[str, Any], config_path: Path
) -> tuple[dict[str, Any], list[int]]:
    """A Qwen2.5-VL config.json's language model as a Qwen2 config (transformers 5 nests it
    in text_config, transformers 4 writes it at the top), and its M-RoPE sections (read
    from rope_scaling / rope_parameters, where transformers 4 calls the rope type "mrope")."""
    if "vision_config" not in cfg:
        raise ValueError(f"{config_path}: a Qwen2.5-VL config without vision_config")
    outer = {k: v for k, v in cfg.items() if k not in ("vision_config", "text_config")}
    text = {**outer, **(cfg.get("text_config") or {}), "model_type": "qwen2"}
    mrope_section = None
    for key in ("rope_scaling", "rope_parameters"):
        rope = dict(text.get(key) or {})
        mrope_section = rope.pop("mrope_section", None) or mrope_section
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text[key] = rope or None
    section = [int(n) for n in (mrope_section or [16, 24, 24])]  # transformers' default
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    if sum(section) != head_dim // 2 or len(section) != 3:
        raise ValueError(
            f"{config_path}: mrope_section {section} must be three parts summing to half the "
            f"head dimension ({head_dim // 2})"
        )
    return text, section


def _arch_from_hf_config(cfg: dict[str, Any], config_path: Path) -> ModelArchConfig:
    """A Llama-family decoder's (llama, mistral, qwen2/3, phi3 and their MoE) config.json."""
    model_type = cfg["model_type"]

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{config_path} is missing {key!r}")
        return cfg[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    # transformers 5 writes rope_theta (and any scaling) inside rope_parameters.
    rope_params = dict(cfg.get("rope_parameters") or {})
    rope_theta = cfg.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
    eos = cfg.get("eos_token_id")
    num_layers, max_positions = int(need("num_hidden_layers")), int(need("max_position_embeddings"))
    layer_types, sliding_window = _hf_sliding_window(cfg, num_layers, max_positions)
    return ModelArchConfig(
        architecture=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2"
        or bool(cfg.get("attention_bias", False))
        or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True))),
        rope_scaling=_hf_rope_scaling(cfg, cfg.get("rope_scaling") or rope_params),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        layer_types=layer_types,
        sliding_window=sliding_window,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **moe_fields_from_hf(cfg, num_layers, config_path),  # zllm/model/moe_arch.py
    )


def _hf_rope_scaling(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any] | None:
    """The rope parameters (less rope_theta) as transformers resolves them; None for plain RoPE
    over whole heads. Keeps partial_rotary_factor (Phi-3 family) when it is below 1."""
    scaling = dict(scaling)
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")  # the pre-4.45 spelling
    rope_type = scaling.get("rope_type", "default")
    if cfg["model_type"] == "phi3" and rope_type in ("su", "yarn"):
        # Phi-3's early names for LongRoPE, which transformers reads as longrope.
        scaling["rope_type"] = rope_type = "longrope"
    # Phi-3 configs keep the pretraining context at the top level; transformers prefers it.
    if rope_type in ("llama3", "yarn", "longrope") and cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    partial = scaling.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1
    if partial != 1:
        if cfg["model_type"] != "phi3":  # transformers rotates whole heads for the others
            raise ValueError(f"partial_rotary_factor={partial} is supported for phi3 models only")
        scaling["partial_rotary_factor"] = partial
    if rope_type == "default" and partial == 1:
        return None
    return scaling


def _hf_sliding_window(
    cfg: dict[str, Any], num_layers: int, max_positions: int
) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) as transformers applies them; (None, None) for none.

    Mistral and Phi-3 window every layer when sliding_window is set (Mistral's config class
    defaults it to 4096 when config.json leaves it out); Qwen2/Qwen3 window only with
    use_sliding_window, and then the layers from max_window_layers on (or config.json's own
    layer_types). A window no shorter than max_position_embeddings never drops a key, so it
    is left out: such layers stay full attention (and keep the full-attention kernels).
    """
    model_type = cfg["model_type"]
    if model_type in ("mistral", "mixtral"):  # (Mixtral's config class defaults it to None)
        window = cfg.get("sliding_window", 4096 if model_type == "mistral" else None)
        layer_types = ["sliding_attention"] * num_layers
    elif model_type == "phi3":
        window = cfg.get("sliding_window")
        layer_types = ["sliding_attention"] * num_layers
    elif model_type in ("qwen2", "qwen3"):
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
        first_sliding = cfg.get("max_window_layers", 28)
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    else:
        return None, None
    if window is None or window >= max_positions or "sliding_attention" not in layer_types:
        return None, None
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return list(layer_types), int(window)


# ---------------------------------------------------------------------------------------------
# Gemma 3

# What Gemma 3 GGUF files leave out, as llama.cpp and transformers' GGUF loader assume it:
# every 6th layer global, the rest sliding; the local RoPE base; the attention scale's scalar
# is the head size (256 for the released models).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def gemma3_layer_types(num_layers: int, pattern: int = _GEMMA3_PATTERN) -> list[str]:
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def _gemma3_arch_from_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md, path = gguf.metadata, gguf.path

    def need(key: str) -> Any:
        value = md.get(f"gemma3.{key}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise invalid_gguf(path, f"metadata key 'gemma3.{key}' is {value!r}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(md.get("gemma3.attention.key_length", hidden // heads))
    num_layers = int(need("block_count"))
    tokens = md.get("tokenizer.ggml.tokens") or []
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [int(md[f"tokenizer.ggml.{k}"]) for k in eos_keys if f"tokenizer.ggml.{k}" in md]
    return ModelArchConfig(
        architecture="gemma3",
        vocab_size=len(tokens) or gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(md.get("gemma3.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(md.get("gemma3.rope.freq_base", 1_000_000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        rope_scaling=_gguf_rope_scaling(md, "gemma3"),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        layer_types=gemma3_layer_types(num_layers),
        sliding_window=int(need("attention.sliding_window")),
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(head_dim),
        rope_local_theta=_GEMMA3_LOCAL_ROPE_THETA,
    )


def _gemma3_arch_from_hf(cfg: dict[str, Any], config_path: Path) -> ModelArchConfig:
    """config.json of model_type gemma3_text, as transformers 4.5x or 5 writes it."""

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{config_path} is missing {key!r}")
        return cfg[key]

    num_layers = int(need("num_hidden_layers"))
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or 256)
    layer_types = cfg.get("layer_types") or gemma3_layer_types(
        num_layers, int(cfg.get("sliding_window_pattern") or _GEMMA3_PATTERN)
    )
    # transformers 5: rope_parameters per layer type; 4.x: rope_theta, rope_local_base_freq
    # and rope_scaling (which applies to the global layers only).
    rope = cfg.get("rope_parameters") or {}
    full_rope = dict(rope.get("full_attention") or {})
    local_rope = rope.get("sliding_attention") or {}
    rope_theta = full_rope.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local_theta = local_rope.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    eos = cfg.get("eos_token_id")
    return ModelArchConfig(
        architecture="gemma3",
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope_scaling=_hf_rope_scaling(cfg, cfg.get("rope_scaling") or full_rope),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        layer_types=list(layer_types),
        sliding_window=int(cfg.get("sliding_window") or 4096),
        qk_norm=True,
        hidden_act=str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        rope_local_theta=float(local_theta),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
    )
