"""Which code runs a model, and what the engine must know of a model only transformers runs.

    --model-impl zllm          our model code (executor/models/): Llama family, Gemma 3, Qwen2.5-VL
    --model-impl transformers  transformers' modeling code with our paged attention plugged in
                               (executor/models/transformers_backend.py)
    --model-impl auto          ours when we have it, else transformers'

The core sizes the KV cache from the model's layers, KV heads, head size and sliding windows
before the executor loads anything, and this process may not import transformers' modeling
(it brings torch). So for a model without native code those few numbers are read here from
config.json (or GGUF metadata) under the names the common families use; the executor then
checks them against what the loaded model's layers actually do and refuses a mismatch.
Models the transformers backend cannot serve at all are refused here, by their config.
No torch here.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zllm.model.arch import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_GGUF_ARCHITECTURES,
    read_arch_config,
    sequence_labels,
)
from zllm.model.arch_config import ModelArchConfig
from zllm.model.gguf import GGUFFile, invalid_gguf, read_gguf

logger = logging.getLogger(__name__)

MODEL_IMPLS = ("auto", "zllm", "transformers")

# config.json keys of state-space / linear-recurrence layers (Mamba, Mamba 2, Jamba, Zamba,
# Falcon-H1, Bamba, Qwen3-Next's linear attention): no KV cache to page.
_STATE_SPACE_KEYS = (
    "state_size",
    "ssm_state_size",
    "mamba_d_state",
    "mamba_n_heads",
    "mamba_d_conv",
    "linear_conv_kernel_dim",
    "attn_layer_indices",
)
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Vision-language classes the transformers backend runs with images: each one's vision tower
# and projector are transformers' own (executor/models/vision/transformers_images.py), its
# language model attends through zllm's cache, and zllm/media/placeholders.py holds the rule
# its processor counts an image's tokens by. Others are refused by name.
TRANSFORMERS_VISION = ("llava",)
# Encoder-only classes the transformers backend runs as pooling models (each prompt in one
# step, attending both ways: executor/models/transformers_backend.py). RoBERTa's positions
# start past its padding index.
TRANSFORMERS_ENCODERS = ("bert", "roberta", "xlm-roberta", "modernbert")
_ENCODER_DECODER_GGUF = frozenset({"t5", "t5encoder", "umt5", "bert", "nomic-bert"})


@dataclass(frozen=True, slots=True)
class ModelImpl:
    """The code chosen for a model, and why (logged once at startup)."""

    name: str  # "zllm" or "transformers"
    architecture: str  # config.json's model_type or the GGUF general.architecture
    reason: str


def architecture_of(model_path: str) -> tuple[str, bool]:
    """(the model's architecture name, whether zllm has native code for it)."""
    if os.path.isdir(model_path):
        model_type = str(_read_config(Path(model_path)).get("model_type"))
        return model_type, model_type in SUPPORTED_ARCHITECTURES
    arch = str(read_gguf(model_path).metadata.get("general.architecture"))
    return arch, arch in SUPPORTED_GGUF_ARCHITECTURES


def choose_model_impl(model_path: str, requested: str = "auto") -> ModelImpl:
    if requested not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {requested!r}")
    arch, native = architecture_of(model_path)
    if requested == "zllm" or (requested == "auto" and native):
        return ModelImpl("zllm", arch, "zllm's model code")
    if importlib.util.find_spec("transformers") is None:
        why = (
            "--model-impl transformers"
            if requested == "transformers"
            else f"zllm has no native code for {arch!r}; running it"
        )
        raise ValueError(
            f"{model_path}: {why} needs transformers: pip install 'zllm[transformers]'"
        )
    if not os.path.isdir(model_path):
        refuse_unreadable_gguf(model_path, arch)
    if requested == "transformers":
        return ModelImpl("transformers", arch, "transformers' model code, as asked")
    return ModelImpl(
        "transformers", arch, f"transformers' model code (zllm has no native code for {arch!r})"
    )


def read_model_arch(model_path: str, impl: ModelImpl) -> ModelArchConfig:
    """The architecture record the engine runs `model_path` with under `impl`.

    Native architectures are read by model_files whichever code runs them; under "zllm" any
    other is refused there (naming what is supported); under "transformers" it is read here.
    """
    arch, native = architecture_of(model_path)
    if native:
        return read_arch_config(model_path)
    if impl.name == "zllm":
        try:
            read_arch_config(model_path)  # raises, naming what zllm's own code runs
        except ValueError as exc:
            if not os.path.isdir(model_path) and importlib.util.find_spec("transformers"):
                refuse_unreadable_gguf(model_path, arch)  # nothing runs it: say so instead
            raise ValueError(
                f"{exc}; --model-impl transformers (or auto) runs it with transformers' "
                f"modeling code"
            ) from None
    if os.path.isdir(model_path):
        return _arch_from_config(Path(model_path))
    return _arch_from_gguf(read_gguf(model_path))


def arch_of(model_path: str, requested: str = "auto") -> ModelArchConfig:
    """The architecture record of whichever code `requested` picks (benchmarks, tools)."""
    return read_model_arch(model_path, choose_model_impl(model_path, requested))


# ---------------------------------------------------------------------------------------------
# config.json


def _read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / "config.json"
    try:
        return json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_path}: {e}") from None


def refuse_unservable(cfg: dict[str, Any], where: str) -> None:
    """ValueError naming the architecture and why the transformers backend cannot serve it."""
    name = cfg.get("model_type")
    if cfg.get("is_encoder_decoder"):
        raise ValueError(
            f"{where}: {name} is an encoder-decoder model; zllm serves decoder-only causal LMs"
        )
    multimodal = "text_config" in cfg or "vision_config" in cfg or "audio_config" in cfg
    if multimodal and not (name in TRANSFORMERS_VISION and "audio_config" not in cfg):
        raise ValueError(
            f"{where}: {name} is a multimodal checkpoint; zllm serves text-only causal LMs, "
            f"and of vision-language models Gemma 3 (model_type 'gemma3') and Qwen2.5-VL "
            f"(model_type 'qwen2_5_vl') natively and {', '.join(TRANSFORMERS_VISION)} through "
            f"transformers"
        )
    ssm_keys = [k for k in _STATE_SPACE_KEYS if k in cfg]
    other_layers = sorted(set(cfg.get("layer_types") or []) - _ATTENTION_LAYER_TYPES)
    if ssm_keys or other_layers:
        shown = ", ".join(other_layers) if other_layers else ", ".join(ssm_keys)
        raise ValueError(
            f"{where}: {name} has state-space or recurrent layers ({shown}); zllm's paged KV "
            f"cache serves attention layers only"
        )


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _arch_from_config(directory: Path) -> ModelArchConfig:
    """A causal LM's KV cache layout from config.json, under the names families use."""
    cfg = _read_config(directory)
    where = str(directory / "config.json")
    refuse_unservable(cfg, where)
    classifier = any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])  # fmt: skip
    if classifier and cfg.get("model_type") not in TRANSFORMERS_ENCODERS:
        raise ValueError(
            f"{where}: a sequence-classification {cfg.get('model_type')} model: zllm runs "
            f"classifier heads on its own models (Llama, Mistral, Qwen2, Qwen3, Phi-3) and on "
            f"encoders ({', '.join(TRANSFORMERS_ENCODERS)})"
        )
    vision = cfg.get("model_type") in TRANSFORMERS_VISION
    if vision:  # the language model's layout, under the vision-language model's name
        cfg = _vision_text_config(cfg)

    def need(*keys: str) -> Any:
        value = _first(cfg, *keys)
        if value is None:
            raise ValueError(f"{where} has none of {', '.join(map(repr, keys))}")
        return value

    num_layers = int(need("num_hidden_layers", "n_layer", "num_layers"))
    heads = int(need("num_attention_heads", "n_head", "num_heads"))
    hidden = int(need("hidden_size", "n_embd", "d_model"))
    kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    max_positions = int(
        need("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
    )
    if cfg.get("model_type") in ("roberta", "xlm-roberta"):  # positions past the padding index
        max_positions -= int(cfg.get("pad_token_id") or 0) + 1
    layer_types, window = _sliding_layers(cfg, num_layers, max_positions)
    if cfg.get("model_type") in TRANSFORMERS_ENCODERS:  # no KV cache to window: it attends
        layer_types, window = None, None  # within the step (ModernBERT's local layers too)
    eos = cfg.get("eos_token_id")
    return ModelArchConfig(
        architecture=str(cfg.get("model_type")),
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_first(cfg, "intermediate_size", "n_inner", "ffn_hidden_size") or 0),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(_first(cfg, "rms_norm_eps", "layer_norm_eps") or 1e-6),
        rope_theta=float(cfg.get("rope_theta") or 10000.0),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        layer_types=layer_types,
        sliding_window=window,
        vision=vision,
        encoder=cfg.get("model_type") in TRANSFORMERS_ENCODERS,
        # An encoder classifier (transformers' head): no LM head, its labels' count.
        lm_head=not classifier,
        num_labels=len(sequence_labels(directory)) if classifier else 0,
    )


# transformers' LlamaConfig defaults: the Hub's LLaVA 1.5 configs (written by transformers
# 4.3x) give only what differs from them in text_config.
_LLAMA_TEXT_DEFAULTS = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "vocab_size": 32000,
}  # fmt: skip


def _vision_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config.json's language model as a text model's config: its
    text_config over its text model type's defaults (Llama's), with the outer config's
    vocabulary and tied embeddings where it states them, named as the whole model."""
    text = dict(cfg.get("text_config") or {})
    defaults = _LLAMA_TEXT_DEFAULTS if text.get("model_type", "llama") == "llama" else {}
    outer = {k: cfg[k] for k in ("vocab_size", "tie_word_embeddings") if k in cfg}
    return {**defaults, **text, **outer, "model_type": cfg["model_type"]}


def _sliding_layers(
    cfg: dict[str, Any], num_layers: int, max_positions: int
) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window): config.json's layer_types when it has them, else every
    layer windowed when sliding_window is set (Mistral's and Starcoder2's reading); a window
    no shorter than the context drops nothing and counts as none."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or not window or window >= max_positions:
        return None, None
    layer_types = cfg.get("layer_types") or ["sliding_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    if "sliding_attention" not in layer_types:
        return None, None
    return list(layer_types), int(window)


# ---------------------------------------------------------------------------------------------
# GGUF metadata (the architectures transformers' GGUF reader knows)

# llama.cpp's general.architecture names that transformers' GGUF reader spells otherwise.
_TRANSFORMERS_GGUF_NAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}


def transformers_gguf_architectures() -> list[str]:
    """The GGUF architectures the installed transformers reads (its GGUF config mapping:
    no torch behind it)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})


def refuse_unreadable_gguf(model_path: str, arch: str) -> None:
    """ValueError naming a GGUF file's architecture when neither zllm's code nor transformers'
    GGUF reader runs it (transformers would fail deep in its loader), and what runs instead."""
    if arch == "gpt-oss" and "gpt-oss.rope.scaling.type" in read_gguf(model_path).metadata:
        # transformers' reader lists gpt-oss but takes each rope.scaling key's first part
        # (the key's length, an array) for its value: "TypeError: only 0-dimensional arrays".
        raise ValueError(
            f"{model_path}: transformers' GGUF reader cannot read gpt-oss files (it misreads "
            f"their rope.scaling metadata); zllm's own code runs them (--model-impl auto or zllm)"
        )
    if arch == "phi3" and _phi3_file_needs_what_transformers_drops(read_gguf(model_path)):
        raise ValueError(
            f"{model_path}: transformers' GGUF reader drops this Phi-3 file's sliding window "
            f"and LongRoPE factors (it would run another model); zllm's own code runs it "
            f"(--model-impl auto or zllm)"
        )
    readable = transformers_gguf_architectures()
    if _TRANSFORMERS_GGUF_NAMES.get(arch, arch) in readable:
        return
    raise ValueError(
        f"{model_path}: GGUF architecture {arch!r} runs neither in zllm's own code (GGUF files "
        f"of {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}) nor through transformers' GGUF reader "
        f"({', '.join(readable)}); the original checkpoint's Hugging Face directory (config.json "
        f"and safetensors) may run with --model-impl transformers"
    )


def _phi3_file_needs_what_transformers_drops(gguf: GGUFFile) -> bool:
    """A window or LongRoPE factors, which transformers' reader does not read."""
    window = "phi3.attention.sliding_window" in gguf.metadata
    return window or "rope_factors_long.weight" in gguf.tensors


def _arch_from_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md, path = gguf.metadata, gguf.path
    arch = str(md.get("general.architecture"))
    if arch in _ENCODER_DECODER_GGUF:
        raise ValueError(f"{path}: {arch} is an encoder model; zllm serves decoder-only causal LMs")
    if any(key.startswith(f"{arch}.ssm.") for key in md):
        raise ValueError(
            f"{path}: {arch} has state-space layers; zllm's paged KV cache serves attention only"
        )

    def need(key: str) -> Any:
        value = md.get(f"{arch}.{key}")
        if value is None:
            raise invalid_gguf(path, f"missing metadata key '{arch}.{key}'")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    num_layers, max_positions = int(need("block_count")), int(need("context_length"))
    tokens = md.get("tokenizer.ggml.tokens")
    embd = gguf.tensors.get("token_embd.weight")
    vocab = md.get(f"{arch}.vocab_size") or (len(tokens) if tokens else embd and embd.shape[0])
    window = md.get(f"{arch}.attention.sliding_window")
    sliding = bool(window) and window < max_positions
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [md[f"tokenizer.ggml.{k}"] for k in eos_keys if f"tokenizer.ggml.{k}" in md]
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(vocab or 0),
        hidden_size=hidden,
        intermediate_size=int(md.get(f"{arch}.feed_forward_length") or 0),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(md.get(f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        rope_theta=float(md.get(f"{arch}.rope.freq_base") or 10000.0),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(t) for t in eos)),
        layer_types=["sliding_attention"] * num_layers if sliding else None,
        sliding_window=int(window) if sliding else None,
    )
