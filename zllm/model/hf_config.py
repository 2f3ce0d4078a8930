"""Reading a Hugging Face config.json into the engine's record, the parts every decoder family
shares: the sizes, the rope parameters as transformers resolves them, sliding windows, EOS
ids. A family's module (zllm/model/families/) calls `decoder_arch` with what is its own (q/k
norms, biases, which layers window, its experts); nothing here names an architecture. No
torch here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zllm.model.arch_config import ModelArchConfig, MoEConfig

# (config.json, layer count) -> (layer_types, sliding_window) before the context check.
WindowRule = Callable[[dict[str, Any], int], tuple[list[str] | None, int | None]]
# (config.json, layer count, where) -> the family's experts (moe_arch.py).
ExpertRule = Callable[[dict[str, Any], int, Path], MoEConfig]


def need(cfg: dict[str, Any], key: str, where: Path | str) -> Any:
    """cfg[key], or a ValueError naming the file and the key."""
    if cfg.get(key) is None:
        raise ValueError(f"{where} is missing {key!r}")
    return cfg[key]


def eos_token_ids(cfg: dict[str, Any]) -> list[int]:
    eos = cfg.get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def rope_theta_and_parameters(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, the rope parameters less rope_theta): transformers 5 writes both inside
    rope_parameters, transformers 4 rope_theta at the top beside rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta", params.pop("rope_theta", 10000.0))
    return float(theta), params


def hf_rope_scaling(
    cfg: dict[str, Any],
    scaling: dict[str, Any],
    *,
    partial_rotary: bool = False,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:
    """The rope parameters (less rope_theta) as transformers resolves them; None for plain
    RoPE over whole heads. `partial_rotary`: the family rotates part of each head when the
    config says so (partial_rotary_factor kept); `aliases`: the family's early names of a
    rope type (Phi-3's "su" and "yarn" are transformers' longrope)."""
    scaling = dict(scaling)
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")  # the pre-4.45 spelling
    rope_type = scaling.get("rope_type", "default")
    if aliases and rope_type in aliases:
        scaling["rope_type"] = rope_type = aliases[rope_type]
    # Phi-3 configs keep the pretraining context at the top level; transformers prefers it.
    if rope_type in ("llama3", "yarn", "longrope") and cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    partial = scaling.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1
    if partial != 1:
        if not partial_rotary:  # transformers rotates whole heads for the others
            raise ValueError(
                f"partial_rotary_factor={partial}: transformers rotates whole heads of "
                f"model_type {cfg.get('model_type')!r}, so zllm reads no partial rotation for it"
            )
        scaling["partial_rotary_factor"] = partial
    if rope_type == "default" and partial == 1:
        return None
    return scaling


def no_windows(cfg: dict[str, Any], num_layers: int) -> tuple[None, None]:
    return None, None


def every_layer_windowed(default: int | None = None) -> WindowRule:
    """Every layer windowed by sliding_window (`default` where config.json leaves it out:
    Mistral's config class has 4096)."""

    def rule(cfg: dict[str, Any], num_layers: int) -> tuple[list[str], int | None]:
        return ["sliding_attention"] * num_layers, cfg.get("sliding_window", default)

    return rule


def windowed_from_max_window_layers(
    cfg: dict[str, Any], num_layers: int
) -> tuple[list[str], int | None]:
    """Qwen's rule: windows only with use_sliding_window, then the layers from
    max_window_layers on (or config.json's own layer_types)."""
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
    first_sliding = cfg.get("max_window_layers", 28)
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)
    ]
    return layer_types, window


def sliding_layers(
    rule: WindowRule, cfg: dict[str, Any], num_layers: int, max_positions: int
) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) as transformers applies them; (None, None) for none. A
    window no shorter than max_position_embeddings never drops a key, so it is left out:
    such layers stay full attention (and keep the full-attention kernels)."""
    layer_types, window = rule(cfg, num_layers)
    if layer_types is None or window is None or window >= max_positions:
        return None, None
    if "sliding_attention" not in layer_types:
        return None, None
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return list(layer_types), int(window)


def decoder_arch(
    cfg: dict[str, Any],
    where: Path,
    family: str,
    *,
    qk_norm: bool = False,
    attention_bias: bool | None = None,
    windows: WindowRule = no_windows,
    partial_rotary: bool = False,
    rope_aliases: Mapping[str, str] | None = None,
    experts: ExpertRule | None = None,
) -> ModelArchConfig:
    """A Llama-style decoder's record from its config.json. `attention_bias`: the family's
    rule (None: config.json's attention_bias); `experts`: how it reads its experts (a
    moe_arch.moe_from_hf with the family's arguments bound), None for a dense family."""
    hidden, heads = int(need(cfg, "hidden_size", where)), int(need(cfg, "num_attention_heads", where))  # fmt: skip
    rope_theta, rope_params = rope_theta_and_parameters(cfg)
    num_layers = int(need(cfg, "num_hidden_layers", where))
    max_positions = int(need(cfg, "max_position_embeddings", where))
    layer_types, window = sliding_layers(windows, cfg, num_layers, max_positions)
    moe = experts(cfg, num_layers, where) if experts else None
    scaling = hf_rope_scaling(
        cfg, cfg.get("rope_scaling") or rope_params, partial_rotary=partial_rotary, aliases=rope_aliases
    )  # fmt: skip
    return ModelArchConfig(
        architecture=str(cfg["model_type"]),
        family=family,
        vocab_size=int(need(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(need(cfg, "intermediate_size", where)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False))
        if attention_bias is None
        else attention_bias,
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_token_ids(cfg),
        layer_types=layer_types,
        sliding_window=window,
        qk_norm=qk_norm,
        moe=moe,
    )
