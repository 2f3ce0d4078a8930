"""A mixture-of-experts model's `MoEConfig` (num_experts, num_experts_per_tok,
moe_intermediate_size, norm_topk_prob, shared_expert_intermediate_size, dense_mlp_layers),
read from config.json or GGUF metadata for the families whose experts follow Qwen's and
Mixtral's layout. A family (zllm/model/families/) passes its own rules. No torch here.

    config.json (transformers)               GGUF (llama.cpp)                  field
    num_experts / num_local_experts          {arch}.expert_count               num_experts
    num_experts_per_tok                      {arch}.expert_used_count          num_experts_per_tok
    moe_intermediate_size (Mixtral, OLMoE:   {arch}.expert_feed_forward_length moe_intermediate_size
      intermediate_size)                       (Mixtral: feed_forward_length)
    norm_topk_prob (Mixtral: always)         {arch}.expert_weights_norm, else  norm_topk_prob
                                               llama.cpp's per-architecture rule
    shared_expert_intermediate_size          {arch}.expert_shared_feed_forward_length
    mlp_only_layers, decoder_sparse_step     the layers without ffn_gate_inp   dense_mlp_layers
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model.arch_config import MoEConfig
from zllm.model.family import Feature
from zllm.model.gguf import GGUFFile, invalid_gguf


def moe_from_hf(
    cfg: dict[str, Any],
    num_layers: int,
    where: Path,
    *,
    width_key: str = "moe_intermediate_size",
    always_renormalise: bool = False,
    shared_expert: bool = False,
    dense_layers: bool = True,
) -> MoEConfig:
    """The fields from a config.json. `width_key`: the key of one expert's width (Mixtral's
    experts are intermediate_size wide); `always_renormalise`: the family's router always
    renormalises the chosen weights (Mixtral's), else norm_topk_prob says; `shared_expert`:
    the family has Qwen2-MoE's always-on expert (shared_expert_intermediate_size);
    `dense_layers`: mlp_only_layers and decoder_sparse_step make layers dense (Qwen's;
    transformers' Mixtral reads neither: every layer has experts)."""
    model_type = cfg["model_type"]
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
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_dense = set(cfg.get("mlp_only_layers") or [])
    shared = cfg.get("shared_expert_intermediate_size") if shared_expert else 0
    return MoEConfig(
        num_experts=int(num_experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(cfg[width_key]),
        norm_topk_prob=always_renormalise or bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(shared or 0),
        dense_mlp_layers=tuple(
            i for i in range(num_layers) if dense_layers and (i in only_dense or (i + 1) % step)
        ),
    )


def moe_from_gguf(
    gguf: GGUFFile, num_layers: int, *, renormalise: bool, required: bool = True
) -> MoEConfig | None:
    """The experts from GGUF metadata (None for a dense file where `required` is False).
    `renormalise`: llama.cpp's rule for the family's files that do not say
    (expert_weights_norm): it renormalises the chosen experts' weights for qwen3moe and
    Mixtral's files, not for qwen2moe's."""
    md = gguf.metadata
    arch = str(md["general.architecture"])
    num_experts = md.get(f"{arch}.expert_count") or 0
    if not num_experts:
        if required:
            raise invalid_gguf(gguf.path, f"a {arch} file without {arch}.expert_count")
        return None
    top_k = md.get(f"{arch}.expert_used_count")
    inter = md.get(f"{arch}.expert_feed_forward_length") or md.get(f"{arch}.feed_forward_length")
    if not top_k or not inter:
        raise invalid_gguf(gguf.path, f"{arch}.expert_used_count or the experts' size missing")
    norm = md.get(f"{arch}.expert_weights_norm", renormalise)
    shared = md.get(f"{arch}.expert_shared_feed_forward_length") or 0
    dense = tuple(
        i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors
    )
    return MoEConfig(
        num_experts=int(num_experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(inter),
        norm_topk_prob=bool(norm),
        shared_expert_intermediate_size=int(shared),
        dense_mlp_layers=dense,
    )


# What a family with mixture-of-experts layers (Qwen's, Mixtral's, gpt-oss's, DeepSeek's)
# does not run yet, and why: its Family.lacks starts from this.
MOE_LACKS = {
    Feature.TENSOR_PARALLEL: "its mixture-of-experts layers are not split across ranks yet",
    Feature.FUSED_CPU_DECODE: "the fused decode step does not route experts (the MoE layer does)",
    Feature.PIECEWISE_CUDA_GRAPHS: (
        "a captured prefill piece would run its experts through the decode-sized expert "
        "kernel, slower there than torch's per-expert matmuls"
    ),
}
