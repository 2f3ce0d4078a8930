"""A hybrid model's state layers read from config.json or a GGUF file (`StateConfig`), their
GGUF tensor names, and what the engine's features cannot do with a recurrent state yet
(`HYBRID_LACKS`), for the families with Gated DeltaNet layers
(zllm/model/families/qwen3_next.py, qwen3_5.py) and with Mamba-2 layers (granite_hybrid.py,
nemotron_h.py). No torch here.

    config.json (transformers)                        StateConfig
    linear_conv_kernel_dim                            conv_kernel
    linear_num_value_heads / linear_num_key_heads     num_heads / num_key_heads
    linear_key_head_dim / linear_value_head_dim       key_head_dim / value_head_dim
    layer_types ("linear_attention" | "full_attention"), else every full_attention_interval-th
    layer full (transformers' default, 4)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from zllm.model.arch_config import StateConfig
from zllm.model.family import Feature
from zllm.model.gguf import GGUFFile, invalid_gguf

# Where these families' attention layers rotate a quarter of each head when config.json
# leaves the factor out (transformers' default for them).
DEFAULT_PARTIAL_ROTARY = 0.25


def gated_delta_net_from_hf(cfg: dict[str, Any], where: Path) -> StateConfig:
    def need(key: str) -> int:
        if cfg.get(key) is None:
            raise ValueError(f"{where} is missing {key!r} (a Gated DeltaNet layer's size)")
        return int(cfg[key])

    state = StateConfig(
        kind="gated_delta_net",
        conv_kernel=need("linear_conv_kernel_dim"),
        num_heads=need("linear_num_value_heads"),
        num_key_heads=need("linear_num_key_heads"),
        key_head_dim=need("linear_key_head_dim"),
        value_head_dim=need("linear_value_head_dim"),
    )
    if state.num_heads % state.num_key_heads:
        raise ValueError(
            f"{where}: linear_num_value_heads {state.num_heads} is not a multiple of "
            f"linear_num_key_heads {state.num_key_heads}"
        )
    if state.conv_kernel < 2:
        raise ValueError(f"{where}: linear_conv_kernel_dim {state.conv_kernel} is below 2")
    return state


def mamba2_from_hf(
    cfg: dict[str, Any], where: Path, hidden_size: int, keys: dict[str, str]
) -> StateConfig:
    """A Mamba-2 layer's shape from config.json; `keys`: the family's names of heads,
    head_dim, groups, state size, conv kernel, expand, conv bias and projection bias
    (Granite's mamba_n_heads, Nemotron-H's mamba_num_heads, ...)."""

    def read(field: str, default: Any = None) -> Any:
        value = cfg.get(keys[field], default)
        if value is None:
            raise ValueError(f"{where} is missing {keys[field]!r} (a Mamba-2 layer's size)")
        return value

    heads = int(read("heads"))
    head_dim = read("head_dim", "auto")
    if head_dim == "auto":  # (Granite's default: the expanded width over the heads)
        head_dim = int(read("expand", 2)) * hidden_size // heads
    limit = cfg.get("time_step_limit")
    if limit is not None:
        low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)
        if low > 0.0 or high != float("inf"):
            raise ValueError(
                f"{where}: time_step_limit {list(limit)} (zllm's Mamba-2 layers run with "
                "(0, inf), the released models' default)"
            )
    groups = int(read("groups", 1))
    state = StateConfig(
        kind="mamba2",
        conv_kernel=int(read("conv_kernel", 4)),
        num_heads=heads,
        num_key_heads=groups,
        key_head_dim=int(read("state_size")),
        value_head_dim=int(head_dim),
        conv_bias=bool(read("conv_bias", True)),
        proj_bias=bool(read("proj_bias", False)),
        norm_groups=groups,
    )
    if heads % groups:
        raise ValueError(f"{where}: {heads} Mamba-2 heads in {groups} groups")
    if state.conv_kernel < 2:
        raise ValueError(f"{where}: a Mamba-2 conv kernel of {state.conv_kernel}")
    return state


def check_attends(layer_types: list[str], where: Path | str) -> None:
    """Refuse a hybrid without an attention layer: the KV cache sizes its blocks from the
    attention layers, and a model of state layers alone has none (not supported yet)."""
    if not any(kind in ("full_attention", "sliding_attention") for kind in layer_types):
        raise ValueError(
            f"{where}: a model of state layers alone (no attention layer): zllm's KV cache "
            "sizes its blocks from the attention layers; such models are not supported yet"
        )


def hybrid_layer_types(cfg: dict[str, Any], num_layers: int, where: Path) -> list[str]:
    """config.json's layer_types, or transformers' default pattern (every
    full_attention_interval-th layer full attention, the others linear)."""
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ValueError(f"{where}: layer_types has {len(layer_types)} entries for {num_layers} layers")  # fmt: skip
    unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"{where}: layer types {', '.join(unknown)} (a Gated DeltaNet hybrid has "
                         "full_attention and linear_attention layers)")  # fmt: skip
    return list(layer_types)


def with_partial_rotary(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with partial_rotary_factor set where it leaves it to transformers."""
    params = cfg.get("rope_parameters") or {}
    if cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor"):
        return cfg
    return {**cfg, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY}


# What a recurrent state cannot do in the engine yet, with the reason (each family with state
# layers lacks these, and may lack more).
HYBRID_LACKS = {
    Feature.FUSED_CPU_DECODE: "the fused CPU decode step runs attention layers only",
    Feature.CUDA_GRAPHS: "its state layers run eager torch code, not captured",
    Feature.PIECEWISE_CUDA_GRAPHS: "its state layers run eager torch code, not captured",
    Feature.TENSOR_PARALLEL: "its state layers' heads are not split across ranks yet",
    Feature.PIPELINE_PARALLEL: "its recurrent-state pool is not split across stages yet",
    Feature.LORA: "its state layers' projections take no adapters yet",
    Feature.DRAFT_MODEL: "a draft model's state could not roll back its rejected proposals",
    Feature.SPECULATIVE_DECODING: (
        "a recurrent state cannot roll back the proposals a step rejects (the KV cache "
        "simply overwrites them)"
    ),
    Feature.DETERMINISTIC: "its state layers' chunked rule is not batch-invariant yet",
    Feature.TRANSFORMERS_IMPL: "transformers' hybrid cache is not paged: zllm's own code runs it",
    Feature.CLASSIFIER_HEAD: "its model class has no sequence-classification head",
    Feature.QUANTIZATION: "zllm's int8 matmuls are not wired into its state layers yet",
}


# llama.cpp's names of a Gated DeltaNet hybrid's layer tensors (qwen3next, qwen35,
# qwen35moe files) -> Hugging Face's, beside gguf_config's Llama-style names. Its converter
# wrote Qwen3-Next's in_proj_qkvz as attn_qkv (q, k, v) and attn_gate (z), kept in_proj_ba
# whole (ssm_ba), stored A_log as -exp(A_log) (ssm_a) and squeezed conv1d's channel dim.
HYBRID_GGUF_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_a": "linear_attn.A",
    "ssm_dt": "linear_attn.dt",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}

# The norms llama.cpp's converter stored as 1 + weight (every "norm.weight" but the state
# layers' gated norm), Hugging Face names.
_PLUS_ONE = re.compile(r"(layernorm|model\.norm|[qk]_norm)\.weight$")


def undo_gguf_norms(name: str, weight: Any) -> Any:
    """A GGUF tensor as the checkpoint held it: the one the converter added to the
    zero-centred norms taken off (the model adds it back, as for a checkpoint)."""
    return weight - 1.0 if _PLUS_ONE.search(name) else weight


def gated_delta_net_from_gguf(gguf: GGUFFile, tiled: bool) -> tuple[StateConfig, list[str], int]:
    """(the state layers' shape, layer_types, the decoder's layers) from a hybrid's GGUF
    metadata: llama.cpp's ssm.* keys, its recurrent_layers flags, and block_count less the
    multi-token-prediction blocks after the decoder (nextn_predict_layers). `tiled`: the
    file's value heads are in llama.cpp's tiled order (its Qwen3.5 files)."""
    md = gguf.metadata
    arch = str(md["general.architecture"])

    def need(key: str) -> int:
        value = md.get(f"{arch}.{key}")
        if not isinstance(value, int) or value <= 0:
            raise invalid_gguf(gguf.path, f"missing metadata key {arch}.{key!r}")
        return value

    heads = need("ssm.time_step_rank")
    state = StateConfig(
        kind="gated_delta_net",
        conv_kernel=need("ssm.conv_kernel"),
        num_heads=heads,
        num_key_heads=need("ssm.group_count"),
        key_head_dim=need("ssm.state_size"),
        value_head_dim=need("ssm.inner_size") // heads,
        tiled_value_heads=tiled and heads != need("ssm.group_count"),
    )
    num_layers = need("block_count") - int(md.get(f"{arch}.nextn_predict_layers") or 0)
    recurrent = md.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = int(md.get(f"{arch}.full_attention_interval") or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    layer_types = ["linear_attention" if r else "full_attention" for r in recurrent[:num_layers]]
    return state, layer_types, num_layers
