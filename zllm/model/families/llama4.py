"""Llama 4's text model (model_type llama4_text; GGUF `llama4`; executor/models/llama4.py):
Llama's pre-norm layers where

  - three layers in four rotate q and k (by adjacent pairs, Meta's layout: the model moves
    them to halves at load) and RMS-normalise each head without a weight (use_qk_norm); they
    attend within chunks of attention_chunk_size tokens;
  - the fourth (no_rope_layers 0) takes no position embedding and attends over everything,
    its queries scaled by log1p(floor((position + 1) / floor_scale)) * attn_scale + 1
    (attn_temperature_tuning);
  - the MLP is a mixture of experts every interleave_moe_layer_step-th layer (moe_layers):
    the top num_experts_per_tok router logits, each expert taking the token times its logit's
    sigmoid, beside an always-on shared expert; the other layers a dense MLP of
    intermediate_size_mlp (intermediate_size is one expert's width).

Chunked attention (ModelArchConfig.attention_chunk, chunked_layers): a rotating layer's query
at position p sees the keys of its own chunk, [p // chunk * chunk, p]; the CPU backends'
metadata and decode kernel take the chunk (executor/attention/metadata.py). On a GPU the
context is capped at one chunk, within which it is plain causal attention (the CUDA kernels
take a window, not a chunk: zllm/config/engine_args.py). A GGUF file holds no chunk size, NoPE interval, temperature or
head-norm switch: llama.cpp's fixed values (8192, every fourth, 8192 and 0.1; the norm but for
128 experts) are taken, as its loader does (read_gguf). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig, MoEConfig
from zllm.model.family import Family, Feature, Trait
from zllm.model.gguf import GGUFFile
from zllm.model.moe_arch import MOE_LACKS

FAMILY_NAME = "llama4"
# llama.cpp's fixed values for `llama4` files (and transformers' defaults).
NOPE_EVERY, CHUNK, FLOOR_SCALE, ATTN_SCALE = 4, 8192, 8192, 0.1


@dataclass(frozen=True, slots=True)
class Llama4Fields:
    """What only Llama 4's model reads (ModelArchConfig.family_fields)."""

    qk_norm: bool = True  # the rotating layers' weightless per-head norm (use_qk_norm)
    temperature_tuning: bool = True  # the NoPE layers' query scale (attn_temperature_tuning)
    floor_scale: float = FLOOR_SCALE
    attn_scale: float = ATTN_SCALE


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    if cfg.get("model_type") == "llama4":  # the multimodal checkpoint's config
        raise ValueError(
            f"{where}: Llama 4's multimodal checkpoint (model_type llama4, vision beside the "
            f"language model) is not run; its text model (llama4_text) is"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} (Llama 4 uses silu)")
    num_layers = int(hf_config.need(cfg, "num_hidden_layers", where))
    flags = cfg.get("no_rope_layers") or [
        int((i + 1) % int(cfg.get("no_rope_layer_interval") or NOPE_EVERY) != 0)
        for i in range(num_layers)
    ]
    step = int(cfg.get("interleave_moe_layer_step") or 1)
    moe_layers = cfg.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, num_layers, step))
    dense_cfg = {**cfg, "intermediate_size": cfg.get("intermediate_size_mlp", 16384)}
    arch = hf_config.decoder_arch(dense_cfg, where, FAMILY_NAME)
    arch.moe = _experts(
        where,
        experts=int(cfg.get("num_local_experts") or 0),
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        inter=int(cfg.get("intermediate_size") or 0),
        moe_layers=moe_layers,
        num_layers=num_layers,
    )
    arch.family_fields = Llama4Fields(
        qk_norm=bool(cfg.get("use_qk_norm", True)),
        temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)),
        floor_scale=float(cfg.get("floor_scale", FLOOR_SCALE)),
        attn_scale=float(cfg.get("attn_scale", ATTN_SCALE)),
    )
    return _finish(arch, flags, cfg.get("attention_chunk_size", CHUNK))


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    """As llama.cpp's loader reads a `llama4` file: a sliding_window of 0 (MobileLLM's) means
    every layer rotates and attends whole; else its fixed chunk, NoPE interval and temperature.
    The head norm goes with every expert count but Maverick's 128."""
    md = gguf.metadata

    def experts(gguf: GGUFFile, num_layers: int) -> MoEConfig | None:
        moe_layers = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in gguf.tensors]  # fmt: skip
        if not moe_layers:
            return None
        return _experts(
            gguf.path,
            experts=int(md.get("llama4.expert_count") or 0),
            top_k=int(md.get("llama4.expert_used_count") or 0),
            inter=int(md.get("llama4.expert_feed_forward_length") or 0),
            moe_layers=moe_layers,
            num_layers=num_layers,
        )

    arch = gguf_config.decoder_arch(gguf, FAMILY_NAME, experts=experts)
    chunked = md.get("llama4.attention.sliding_window", CHUNK) != 0
    num_experts = arch.moe.num_experts if arch.moe is not None else 0
    arch.family_fields = Llama4Fields(qk_norm=num_experts != 128, temperature_tuning=chunked)
    every = NOPE_EVERY if chunked else arch.num_layers + 1
    flags = [int((i + 1) % every != 0) for i in range(arch.num_layers)]
    return _finish(arch, flags, CHUNK if chunked else None)


def _finish(arch: ModelArchConfig, flags: list[int], chunk: int | None) -> ModelArchConfig:
    if len(flags) != arch.num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {arch.num_layers} layers")
    arch.nope_layers = tuple(i for i, rotate in enumerate(flags) if not rotate)
    if chunk:  # (the rotating layers attend within their chunk; the NoPE layers see all)
        arch.attention_chunk = int(chunk)
        arch.chunked_layers = tuple(i for i, rotate in enumerate(flags) if rotate)
    return arch


def _experts(
    where: Any, *, experts: int, top_k: int, inter: int, moe_layers: list[int], num_layers: int
) -> MoEConfig:
    if not 0 < top_k <= experts or inter <= 0:
        raise ValueError(f"{where}: {top_k} experts per token of {experts}, {inter} wide")
    return MoEConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=inter,
        dense_mlp_layers=tuple(i for i in range(num_layers) if i not in set(moe_layers)),
    )


FAMILY = Family(
    name=FAMILY_NAME,
    title="Llama 4",
    model_types=("llama4_text", "llama4"),
    gguf_architectures=("llama4",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    # (our names for its MLPs: mlp.*, as the model spells transformers' feed_forward.*)
    gguf_tensor_names=gguf_config.LAYER_NAMES,
    model_class="zllm.executor.models.llama4:Llama4ForCausalLM",
    traits=frozenset({Trait.MOE}),
    lacks={
        **MOE_LACKS,
        Feature.LORA: "its model code takes no adapters yet",
        Feature.DRAFT_MODEL: "a draft model runs Llama's model code",
        Feature.CLASSIFIER_HEAD: "its model code carries no score head",
    },
    fields=Llama4Fields,
)
