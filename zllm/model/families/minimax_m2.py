"""MiniMax-M2 (model_type minimax_m2; GGUF `minimax-m2`): Llama's decoder (executor/models/
llama.py) with RMSNorms over all query heads and over all key heads at once
(`qk_norm_whole`), part of each head rotated (rotary_dim), and every layer's MLP a mixture of
experts under Mixtral's names (block_sparse_moe, w1/w3/w2) routed by sigmoid scores chosen
with a per-expert correction bias (e_score_correction_bias) and always renormalised: DeepSeek-
V3's rule without groups or scale (`MoEConfig.sigmoid_scores`). No torch here.

Released configs carry use_qk_norm true, qk_norm_type "per_layer" (the norms over all heads)
and scoring_func "sigmoid"; transformers' class reads none of them and runs exactly that, so
other values are refused, naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig, MoEConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile, invalid_gguf
from zllm.model.moe_arch import MOE_LACKS

FAMILY_NAME = "minimax_m2"
# What transformers' MiniMaxM2 runs, whatever config.json says: refused otherwise.
_FIXED = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid"}


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    for key, runs in _FIXED.items():
        if cfg.get(key, runs) != runs:
            raise ValueError(f"{where}: {key} {cfg[key]!r} (MiniMax-M2 runs {key} {runs!r})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} (MiniMax-M2 uses silu)")
    if cfg.get("rotary_dim") and not cfg.get("partial_rotary_factor"):
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        cfg = {**cfg, "partial_rotary_factor": int(cfg["rotary_dim"]) / head_dim}
    arch = hf_config.decoder_arch(cfg, where, FAMILY_NAME, partial_rotary=True, experts=_hf_experts)
    arch.qk_norm_whole = True
    return arch


def _hf_experts(cfg: dict[str, Any], num_layers: int, where: Path) -> MoEConfig:
    return _experts(
        where,
        experts=int(cfg.get("num_local_experts") or 0),
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        inter=int(cfg.get("intermediate_size") or 0),
    )


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md = gguf.metadata

    def experts(gguf: GGUFFile, num_layers: int) -> MoEConfig:
        return _experts(
            gguf.path,
            experts=int(md.get("minimax-m2.expert_count") or 0),
            top_k=int(md.get("minimax-m2.expert_used_count") or 0),
            inter=int(md.get("minimax-m2.expert_feed_forward_length") or 0),
        )

    arch = gguf_config.decoder_arch(gguf, FAMILY_NAME, partial_rotation=True, experts=experts)
    if "blk.0.attn_q_norm.weight" not in gguf.tensors:
        raise invalid_gguf(gguf.path, "no attn_q_norm (MiniMax-M2 norms its queries and keys)")
    arch.qk_norm_whole = True
    return arch


def _experts(where: Any, *, experts: int, top_k: int, inter: int) -> MoEConfig:
    if not 0 < top_k <= experts or inter <= 0:
        raise ValueError(f"{where}: {top_k} experts per token of {experts}, {inter} wide")
    return MoEConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=True,
        sigmoid_scores=True,
    )


FAMILY = Family(
    name=FAMILY_NAME,
    title="MiniMax-M2",
    model_types=("minimax_m2",),
    gguf_architectures=("minimax-m2",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names={
        **gguf_config.LAYER_NAMES,
        **gguf_config.QK_NORM_NAMES,  # (over all heads at once here)
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    },
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.MOE}),
    lacks=MOE_LACKS,
)
