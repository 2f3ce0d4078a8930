"""The mixture-of-experts fields of `ModelArchConfig` (num_experts, num_experts_per_tok,
moe_intermediate_size, norm_topk_prob, shared_expert_intermediate_size, dense_mlp_layers),
read from config.json or GGUF metadata. No torch here.

    config.json (transformers)               GGUF (llama.cpp)                  field
    num_experts / num_local_experts          {arch}.expert_count               num_experts
    num_experts_per_tok                      {arch}.expert_used_count          num_experts_per_tok
    moe_intermediate_size (Mixtral, OLMoE:   {arch}.expert_feed_forward_length moe_intermediate_size
      intermediate_size)                       (Mixtral: feed_forward_length)
    norm_topk_prob (Mixtral: always)         {arch}.expert_weights_norm, else  norm_topk_prob
                                               llama.cpp's per-architecture rule
    shared_expert_intermediate_size          {arch}.expert_shared_feed_forward_length
    mlp_only_layers, decoder_sparse_step     the layers without ffn_gate_inp   dense_mlp_layers

llama.cpp renormalises the chosen experts' weights for qwen3moe and Mixtral ("llama" files with
experts) and not for qwen2moe; the file does not say, so its rule is the one applied here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model.gguf import GGUFFile, invalid_gguf

# config.json model_type -> its mixture-of-experts family (what differs is named below).
HF_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
GGUF_MOE_TYPES = ("qwen2moe", "qwen3moe")  # and "llama" files with llama.expert_count (Mixtral)
# llama.cpp's build_moe_ffn norm_w per architecture, for files without expert_weights_norm.
_GGUF_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "llama": True}


def moe_fields_from_hf(cfg: dict[str, Any], num_layers: int, where: Path) -> dict[str, Any]:
    """ModelArchConfig's mixture-of-experts fields from a config.json ({} for dense types)."""
    model_type = cfg["model_type"]
    if model_type not in HF_MOE_TYPES:
        return {}
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window is not supported for {model_type}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} ({model_type} uses silu)")
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not num_experts or not top_k:
        raise ValueError(
            f"{where}: a {model_type} config without num_experts / num_experts_per_tok"
        )
    if model_type == "mixtral":
        return dict(
            num_experts=int(num_experts),
            num_experts_per_tok=int(top_k),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,  # MixtralTopKRouter always renormalises
        )
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_dense = set(cfg.get("mlp_only_layers") or [])
    dense = [i for i in range(num_layers) if i in only_dense or (i + 1) % step]
    shared = cfg.get("shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(shared or 0),
        dense_mlp_layers=dense,
    )


def moe_fields_from_gguf(gguf: GGUFFile, arch: str, num_layers: int) -> dict[str, Any]:
    """ModelArchConfig's mixture-of-experts fields from GGUF metadata ({} for a dense file)."""
    md = gguf.metadata
    num_experts = md.get(f"{arch}.expert_count") or 0
    if not num_experts:
        if arch in GGUF_MOE_TYPES:
            raise invalid_gguf(gguf.path, f"a {arch} file without {arch}.expert_count")
        return {}
    if arch not in _GGUF_NORM_TOPK:
        raise ValueError(f"{gguf.path}: mixture-of-experts {arch!r} files are not supported")
    top_k = md.get(f"{arch}.expert_used_count")
    inter = md.get(f"{arch}.expert_feed_forward_length") or md.get(f"{arch}.feed_forward_length")
    if not top_k or not inter:
        raise invalid_gguf(gguf.path, f"{arch}.expert_used_count or the experts' size missing")
    norm = md.get(f"{arch}.expert_weights_norm", _GGUF_NORM_TOPK[arch])
    shared = md.get(f"{arch}.expert_shared_feed_forward_length") or 0
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors]
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(inter),
        norm_topk_prob=bool(norm),
        shared_expert_intermediate_size=int(shared),
        dense_mlp_layers=dense,
    )
