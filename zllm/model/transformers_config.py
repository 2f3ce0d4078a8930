"""What the engine must know of a model that transformers' modeling code runs (the transformers
backend, executor/models/transformers/), read from config.json or GGUF metadata under the
names the common families use. No torch here.

The core sizes the KV cache from the model's layers, KV heads, head size and sliding windows
before the executor loads anything, and this process may not import transformers' modeling
(it brings torch). So those few numbers are read here; the executor then checks them against
what the loaded model's layers actually do and refuses a mismatch. Models the backend cannot
serve at all are refused here, by their config. The families that run on this backend
(zllm/model/families/: LLaVA, the BERT-style encoders, and any other architecture) call these
readers with what is their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Feature
from zllm.model.gguf import GGUFFile, invalid_gguf

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

# What transformers' modeling code does not run in the engine, and why: every family on
# this backend lacks these (and may lack more).
TRANSFORMERS_LACKS = {
    Feature.FUSED_CPU_DECODE: "transformers' modeling code runs its own modules",
    Feature.CUDA_GRAPHS: "transformers' modeling code runs eagerly",
    Feature.PIECEWISE_CUDA_GRAPHS: "transformers' modeling code runs eagerly",
    Feature.DRAFT_MODEL: "a draft model runs on zllm's own model code",
}


def refuse_unservable(cfg: dict[str, Any], where: str, vision: bool = False) -> None:
    """ValueError naming the architecture and why the transformers backend cannot serve it.
    `vision`: the family runs this checkpoint's images (its vision tower is transformers')."""
    name = cfg.get("model_type")
    if cfg.get("is_encoder_decoder"):
        raise ValueError(
            f"{where}: {name} is an encoder-decoder model; zllm serves decoder-only causal LMs"
        )
    multimodal = "text_config" in cfg or "vision_config" in cfg or "audio_config" in cfg
    if multimodal and not (vision and "audio_config" not in cfg):
        from zllm.model.registry import vision_families_text

        raise ValueError(
            f"{where}: {name} is a multimodal checkpoint; zllm serves text-only causal LMs, "
            f"and of vision-language models {vision_families_text()}"
        )
    shapes = _layers_of_other_shapes(cfg)
    if shapes:
        raise ValueError(
            f"{where}: {name} has layers of different shapes ({shapes}); zllm's paged KV cache "
            f"holds one head size for a model's layers, and zllm has no {name} code of its own"
        )
    ssm_keys = [k for k in _STATE_SPACE_KEYS if k in cfg]
    other_layers = sorted(set(cfg.get("layer_types") or []) - _ATTENTION_LAYER_TYPES)
    if ssm_keys or other_layers:
        shown = ", ".join(other_layers) if other_layers else ", ".join(ssm_keys)
        raise ValueError(
            f"{where}: {name} has state-space or recurrent layers ({shown}); zllm's paged KV "
            f"cache serves attention layers only"
        )


def _layers_of_other_shapes(cfg: dict[str, Any]) -> str:
    """What makes some layers' attention differ in shape from others' (Gemma 4's global
    layers' wider heads, per-layer inputs, layers reading another's KV); "" for none."""
    per_layer = [c for c in (cfg.get("per_layer_config") or {}).values() if isinstance(c, dict)]
    sizes = {
        cfg.get("head_dim"),
        cfg.get("global_head_dim"),
        *(c.get("head_dim") for c in per_layer),
    }
    sizes.discard(None)
    found = [f"head sizes {', '.join(map(str, sorted(sizes)))}"] if len(sizes) > 1 else []
    if cfg.get("hidden_size_per_layer_input"):
        found.append("per-layer inputs (hidden_size_per_layer_input)")
    if cfg.get("num_kv_shared_layers"):
        found.append(f"{cfg['num_kv_shared_layers']} layers sharing another's KV")
    return "; ".join(found)


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def read_hf(
    cfg: dict[str, Any],
    where: Path,
    family: str,
    *,
    encoder: bool = False,
    vision: bool = False,
    position_offset: int = 0,
) -> ModelArchConfig:
    """A model's KV cache layout from its config.json, under the names families use.
    `encoder`: every token attends to its whole prompt (no KV cache to window);
    `position_offset`: positions the model's embedding reserves before the first token
    (RoBERTa's start past its padding index); `vision`: a vision-language model whose
    config the family has already flattened to its language model's."""
    num_layers = int(need(cfg, where, "num_hidden_layers", "n_layer", "num_layers"))
    heads = int(need(cfg, where, "num_attention_heads", "n_head", "num_heads"))
    hidden = int(need(cfg, where, "hidden_size", "n_embd", "d_model"))
    kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    max_positions = (
        int(
            need(
                cfg,
                where,
                "max_position_embeddings",
                "n_positions",
                "max_sequence_length",
                "seq_length",
            )  # fmt: skip
        )
        - position_offset
    )
    layer_types, window = (None, None) if encoder else _sliding_layers(cfg, num_layers, max_positions)  # fmt: skip
    return ModelArchConfig(
        architecture=str(cfg.get("model_type")),
        family=family,
        vocab_size=int(need(cfg, where, "vocab_size")),
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
        eos_token_ids=hf_config.eos_token_ids(cfg),
        layer_types=layer_types,
        sliding_window=window,
        vision=vision,
    )


def need(cfg: dict[str, Any], where: Path, *keys: str) -> Any:
    value = _first(cfg, *keys)
    if value is None:
        raise ValueError(f"{where} has none of {', '.join(map(repr, keys))}")
    return value


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


def read_gguf(gguf: GGUFFile, family: str) -> ModelArchConfig:
    """The KV cache layout of a GGUF file transformers' GGUF reader loads."""
    md, path = gguf.metadata, gguf.path
    arch = str(md.get("general.architecture"))
    if any(key.startswith(f"{arch}.ssm.") for key in md):
        raise ValueError(
            f"{path}: {arch} has state-space layers; zllm's paged KV cache serves attention only"
        )
    shapes = [
        f"{key} {md[f'{arch}.{key}_swa']} beside {md[f'{arch}.{key}']}"
        for key in ("attention.key_length", "attention.value_length")
        if md.get(f"{arch}.{key}_swa") not in (None, md.get(f"{arch}.{key}"))
    ]
    if md.get(f"{arch}.embedding_length_per_layer_input"):
        shapes.append("per-layer inputs (embedding_length_per_layer_input)")
    if md.get(f"{arch}.attention.shared_kv_layers"):
        shapes.append("layers sharing another's KV (attention.shared_kv_layers)")
    if shapes:
        raise ValueError(
            f"{path}: {arch} has layers of different shapes ({'; '.join(shapes)}); zllm's paged "
            f"KV cache holds one head size for a model's layers, and zllm has no {arch} code of "
            f"its own"
        )

    def need_key(key: str) -> Any:
        value = md.get(f"{arch}.{key}")
        if value is None:
            raise invalid_gguf(path, f"missing metadata key '{arch}.{key}'")
        return value

    hidden, heads = int(need_key("embedding_length")), int(need_key("attention.head_count"))
    num_layers, max_positions = int(need_key("block_count")), int(need_key("context_length"))
    tokens = md.get("tokenizer.ggml.tokens")
    embd = gguf.tensors.get("token_embd.weight")
    vocab = md.get(f"{arch}.vocab_size") or (len(tokens) if tokens else embd and embd.shape[0])
    window = md.get(f"{arch}.attention.sliding_window")
    sliding = bool(window) and window < max_positions
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [md[f"tokenizer.ggml.{k}"] for k in eos_keys if f"tokenizer.ggml.{k}" in md]
    return ModelArchConfig(
        architecture=arch,
        family=family,
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


def transformers_gguf_architectures() -> list[str]:
    """The GGUF architectures the installed transformers reads (its GGUF config mapping:
    no torch behind it)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})
