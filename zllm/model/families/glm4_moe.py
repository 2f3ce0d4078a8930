"""GLM-4.5 / GLM-4.6 (model_type glm4_moe; GGUF `glm4moe`): Llama's decoder (executor/models/
llama.py) with q/k/v biases, half of each head rotated (partial_rotary_factor 0.5, Llama's two
halves within it), optional per-head q/k norms (use_qk_norm), and mixture-of-experts layers
from first_k_dense_replace on: DeepSeek-V3's router (sigmoid scores chosen with each layer's
e_score_correction_bias, groups by their two best, renormalised, times routed_scaling_factor;
`MoEConfig.sigmoid_scores`) beside n_shared_experts ungated shared experts. The checkpoints'
multi-token-prediction layers (num_nextn_predict_layers, after the decoder) are not run; the
converter writes them as blocks past the decoder, which the loader skips. No torch here.

    config.json                GGUF (glm4moe.*)
    n_routed_experts           expert_count
    num_experts_per_tok        expert_used_count
    moe_intermediate_size      expert_feed_forward_length
    n_shared_experts           expert_shared_count (x moe_intermediate_size wide)
    first_k_dense_replace      leading_dense_block_count (and the layers without ffn_gate_inp)
    routed_scaling_factor      expert_weights_scale
    norm_topk_prob             expert_weights_norm
    n_group, topk_group        expert_group_count, expert_group_used_count
    num_nextn_predict_layers   nextn_predict_layers (block_count counts them)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig, MoEConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile, invalid_gguf
from zllm.model.moe_arch import MOE_LACKS

FAMILY_NAME = "glm4_moe"


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} (GLM-4.5 uses silu)")
    cfg = {**cfg, "partial_rotary_factor": cfg.get("partial_rotary_factor", 0.5)}
    return hf_config.decoder_arch(
        cfg,
        where,
        FAMILY_NAME,
        qk_norm=bool(cfg.get("use_qk_norm")),
        partial_rotary=True,
        experts=_hf_experts,
    )


def _hf_experts(cfg: dict[str, Any], num_layers: int, where: Path) -> MoEConfig | None:
    first_moe = int(cfg.get("first_k_dense_replace") or 0)
    if not cfg.get("n_routed_experts") or first_moe >= num_layers:
        return None
    inter = int(cfg["moe_intermediate_size"])
    return _experts(
        where,
        experts=int(cfg["n_routed_experts"]),
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        inter=inter,
        shared=int(cfg.get("n_shared_experts") or 0) * inter,
        norm=bool(cfg.get("norm_topk_prob", True)),
        scale=float(cfg.get("routed_scaling_factor") or 1.0),
        groups=(int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)),
        dense=tuple(range(first_moe)),
    )


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md = gguf.metadata
    nextn = int(md.get("glm4moe.nextn_predict_layers") or 0)
    blocks = int(md.get("glm4moe.block_count") or 0)
    if not 0 <= nextn < blocks:
        raise invalid_gguf(gguf.path, f"{nextn} prediction blocks of {blocks}")
    decoder = blocks - nextn

    def experts(gguf: GGUFFile, num_layers: int) -> MoEConfig | None:
        dense = [i for i in range(decoder) if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors]
        if len(dense) == decoder:
            return None
        gating = md.get("glm4moe.expert_gating_func", 2)
        if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
            raise invalid_gguf(gguf.path, f"expert_gating_func {gating} (GLM-4.5 routes by sigmoid)")  # fmt: skip
        inter = int(md.get("glm4moe.expert_feed_forward_length") or 0)
        return _experts(
            gguf.path,
            experts=int(md.get("glm4moe.expert_count") or 0),
            top_k=int(md.get("glm4moe.expert_used_count") or 0),
            inter=inter,
            shared=int(md.get("glm4moe.expert_shared_count") or 0) * inter,
            norm=bool(md.get("glm4moe.expert_weights_norm", False)),
            scale=float(md.get("glm4moe.expert_weights_scale") or 1.0),
            groups=(
                int(md.get("glm4moe.expert_group_count") or 1),
                int(md.get("glm4moe.expert_group_used_count") or 1),
            ),
            dense=tuple(dense),
        )

    arch = gguf_config.decoder_arch(
        gguf,
        FAMILY_NAME,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
        partial_rotation=True,
        experts=experts,
    )
    arch.num_layers = decoder
    return arch


def _experts(
    where: Any,
    *,
    experts: int,
    top_k: int,
    inter: int,
    shared: int,
    norm: bool,
    scale: float,
    groups: tuple[int, int],
    dense: tuple[int, ...],
) -> MoEConfig:
    """The fields, checked: k of the experts, a width, groups that split them evenly."""
    group_count, groups_used = groups
    if not 0 < top_k <= experts or inter <= 0:
        raise ValueError(f"{where}: {top_k} experts per token of {experts}, {inter} wide")
    if experts % group_count or not 0 < groups_used <= group_count:
        raise ValueError(f"{where}: {experts} experts in {group_count} groups, {groups_used} used")
    return MoEConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=norm,
        shared_expert_intermediate_size=shared,
        dense_mlp_layers=dense,
        routed_scaling_factor=scale,
        expert_group_count=group_count if group_count > 1 else 0,
        expert_groups_used=groups_used if group_count > 1 else 0,
        sigmoid_scores=True,
    )


FAMILY = Family(
    name=FAMILY_NAME,
    title="GLM-4.5",
    model_types=("glm4_moe",),
    gguf_architectures=("glm4moe",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names={
        **gguf_config.LAYER_NAMES,
        **gguf_config.QK_NORM_NAMES,
        # (its converter names the second pre-norm as Gemma's post-attention norm)
        "post_attention_norm": "post_attention_layernorm",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.MOE}),
    lacks=MOE_LACKS,
)
