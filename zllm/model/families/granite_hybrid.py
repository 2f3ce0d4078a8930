"""Granite 4.0-H (granitemoehybrid; GGUF granitehybrid): a hybrid decoder of Mamba-2 state layers with an attention
layer every few (layer_types "mamba" / "attention", transformers' "linear_attention" /
"full_attention"), each followed by a mixture of experts beside an always-on shared MLP (or
the shared MLP alone when num_local_experts is 0); Granite's multipliers scale the embeddings,
every sublayer's output, the attention scores and the logits; the attention layers use no
position embedding unless position_embedding_type is "rope" (executor/models/granite_hybrid.py;
zllm/kv/state_layout.py keeps the state).

llama.cpp's files: the attention layers are those with attention.head_count_kv above 0, the
multipliers are embedding_scale, residual_scale, attention.scale and logit_scale, and RoPE is
on where rope.scaling.finetuned says so (llama.cpp's switch; its converter writes it False for
these models); ssm_a holds -exp(A_log), ssm_norm the gated norm's weight per group, and the
q/k rows are permuted as for Llama."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig, StateConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile, invalid_gguf
from zllm.model.moe_arch import MOE_LACKS, moe_from_gguf, moe_from_hf
from zllm.model.state_arch import HYBRID_LACKS, check_attends, mamba2_from_hf

# config.json's Mamba-2 keys (state_arch.mamba2_from_hf).
_MAMBA_KEYS = {
    "heads": "mamba_n_heads",
    "head_dim": "mamba_d_head",
    "groups": "mamba_n_groups",
    "state_size": "mamba_d_state",
    "conv_kernel": "mamba_d_conv",
    "expand": "mamba_expand",
    "conv_bias": "mamba_conv_bias",
    "proj_bias": "mamba_proj_bias",
}
# The checkpoints' layer kinds -> ours (transformers 5 writes its own names back).
_LAYER_KINDS = {
    "mamba": "linear_attention",
    "linear_attention": "linear_attention",
    "attention": "full_attention",
    "full_attention": "full_attention",
}


@dataclass(frozen=True, slots=True)
class GraniteFields:
    """What only Granite's model reads (ModelArchConfig.family_fields)."""

    embedding_multiplier: float = 1.0  # the embeddings times this
    residual_multiplier: float = 1.0  # each mixer's and MLP's output times this
    attention_multiplier: float = 1.0  # the attention scale (not head_dim ** -0.5)
    logits_scaling: float = 1.0  # the logits divided by this
    rope: bool = False  # the attention layers rotate q and k (position_embedding_type "rope")


def layer_kinds(names: list[str], where: Path) -> list[str]:
    unknown = sorted(set(names) - set(_LAYER_KINDS))
    if unknown:
        raise ValueError(f"{where}: layer types {', '.join(unknown)} (Granite 4.0-H has mamba "
                         "and attention layers)")  # fmt: skip
    return [_LAYER_KINDS[name] for name in names]


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    num_layers = int(hf_config.need(cfg, "num_hidden_layers", where))
    names = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * num_layers
    if len(names) != num_layers:
        raise ValueError(f"{where}: layer_types has {len(names)} entries for {num_layers} layers")  # fmt: skip
    position = cfg.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ValueError(f"{where}: position_embedding_type {position!r} (Granite uses rope or none)")  # fmt: skip
    experts = int(cfg.get("num_local_experts", 8) or 0)  # (transformers' default: 8)
    shared = int(hf_config.need(cfg, "shared_intermediate_size", where))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} (Granite uses silu)")
    # The dense MLP is the shared one; the experts (when any) intermediate_size wide.
    dense = {**cfg, "intermediate_size": shared}
    arch = hf_config.decoder_arch(dense, where, FAMILY.name)
    moe = None
    if experts:
        moe = moe_from_hf(
            cfg, num_layers, where, width_key="intermediate_size", always_renormalise=True,
            dense_layers=False,
        )  # fmt: skip
        moe = replace(moe, shared_expert_intermediate_size=shared)
    hidden = arch.hidden_size
    kinds = layer_kinds(list(names), where)
    check_attends(kinds, where)
    return replace(
        arch,
        layer_types=kinds,
        state=mamba2_from_hf(cfg, where, hidden, _MAMBA_KEYS),
        moe=moe,
        family_fields=GraniteFields(
            embedding_multiplier=float(cfg.get("embedding_multiplier") or 1.0),
            residual_multiplier=float(cfg.get("residual_multiplier") or 1.0),
            attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
            logits_scaling=float(cfg.get("logits_scaling") or 1.0),
            rope=position == "rope",
        ),
    )


# llama.cpp's names of a Mamba-2 layer's tensors -> Hugging Face's (under the layer's mixer),
# beside gguf_config's Llama-style and expert names.
MAMBA2_GGUF_NAMES = {
    "ssm_in": "in_proj",
    "ssm_conv1d": "conv1d",
    "ssm_dt": "dt",  # (ssm_dt.bias: dt_bias)
    "ssm_a": "A",
    "ssm_d": "D",
    "ssm_norm": "norm",
    "ssm_out": "out_proj",
}
GGUF_NAMES = {
    **gguf_config.LAYER_NAMES,
    **{key: f"mamba.{name}" for key, name in MAMBA2_GGUF_NAMES.items()},
}


def mamba2_from_gguf(gguf: GGUFFile) -> StateConfig:
    """A Mamba-2 layer's shape from llama.cpp's ssm.* keys (time_step_rank: the heads)."""
    md = gguf.metadata
    arch = str(md["general.architecture"])

    def need(key: str) -> int:
        value = md.get(f"{arch}.{key}")
        if not isinstance(value, int) or value <= 0:
            raise invalid_gguf(gguf.path, f"missing metadata key {arch}.{key!r}")
        return value

    heads, groups = need("ssm.time_step_rank"), need("ssm.group_count")
    first = _first_state_layer(gguf)
    return StateConfig(
        kind="mamba2",
        conv_kernel=need("ssm.conv_kernel"),
        num_heads=heads,
        num_key_heads=groups,
        key_head_dim=need("ssm.state_size"),
        value_head_dim=need("ssm.inner_size") // heads,
        conv_bias=f"blk.{first}.ssm_conv1d.bias" in gguf.tensors,
        proj_bias=f"blk.{first}.ssm_in.bias" in gguf.tensors,
        norm_groups=groups,
    )


def _first_state_layer(gguf: GGUFFile) -> int:
    return next(i for i, attends in enumerate(_attends(gguf)) if not attends)


def _attends(gguf: GGUFFile) -> list[bool]:
    """Per block: whether it is an attention layer (head_count_kv above 0)."""
    md = gguf.metadata
    arch = str(md["general.architecture"])
    blocks = gguf_config.need(gguf, f"{arch}.block_count", int)
    kv = md.get(f"{arch}.attention.head_count_kv", 0)
    return [v > 0 for v in kv] if isinstance(kv, list) else [kv > 0] * blocks


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md = gguf.metadata
    arch = str(md["general.architecture"])
    attends = _attends(gguf)
    if all(attends):
        raise invalid_gguf(gguf.path, "a granitehybrid file without Mamba-2 layers")
    if not any(attends):
        check_attends([], gguf.path)
    experts = int(md.get(f"{arch}.expert_count") or 0)
    reader = (lambda g, n: moe_from_gguf(g, n, renormalise=True)) if experts else None
    record = gguf_config.decoder_arch(gguf, FAMILY.name, experts=reader)
    # The MLP every layer has (beside the experts, if any) is the shared one.
    shared = md.get(f"{arch}.expert_shared_feed_forward_length")
    if not shared:
        raise invalid_gguf(gguf.path, f"missing metadata key {arch}.expert_shared_feed_forward_length")  # fmt: skip
    if record.moe is not None:
        record = replace(record, moe=replace(record.moe, norm_topk_prob=True))

    def scale(key: str, default: float = 1.0) -> float:
        return float(md.get(f"{arch}.{key}") or default)

    return replace(
        record,
        intermediate_size=int(shared),
        layer_types=["full_attention" if a else "linear_attention" for a in attends],
        state=mamba2_from_gguf(gguf),
        family_fields=GraniteFields(
            embedding_multiplier=scale("embedding_scale"),
            residual_multiplier=scale("residual_scale"),
            attention_multiplier=scale("attention.scale", record.head_dim**-0.5),
            logits_scaling=scale("logit_scale"),
            rope=bool(md.get(f"{arch}.rope.scaling.finetuned", False)),
        ),
    )


FAMILY = Family(
    name="granite_hybrid",
    title="Granite 4.0-H",
    model_types=("granitemoehybrid",),
    gguf_architectures=("granitehybrid",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names=GGUF_NAMES,
    gguf_permuted_qk=True,
    model_class="zllm.executor.models.granite_hybrid:GraniteHybridForCausalLM",
    traits=frozenset({Trait.MOE, Trait.RECURRENT_STATE}),
    lacks={**MOE_LACKS, **HYBRID_LACKS},
    fields=GraniteFields,
)
