"""Nemotron-H (nemotron_h; GGUF nemotron_h, nemotron_h_moe): a hybrid decoder whose every layer
is one mixer after one RMS norm, `h + mixer(norm(h))`, the mixer one of

    M   a Mamba-2 state layer (executor/layers/mamba2.py)
    *   attention without a position embedding
    -   an MLP alone: down(relu2(up(x))), no gate (layer_types "mlp": no KV, no state)
    E   a mixture of experts alone (Nemotron 3's, layer_types "moe"): sigmoid router scores
        chosen with a per-expert correction bias among the best groups, ungated relu2
        experts, and a shared relu2 MLP beside them (a latent projection around the
        experts, moe_latent_size, is refused)

config.json gives the pattern as hybrid_override_pattern ("M-M*-...", the released
checkpoints) or as a list (layers_block_type / layer_types: mamba or linear_attention,
attention or full_attention, mlp, moe). executor/models/nemotron_h.py runs it.

llama.cpp's files mark the attention layers by attention.head_count_kv above 0; its converter,
reading config.json through transformers 5, writes feed_forward_length 0 for the MLP layers
and names dense models nemotron_h_moe with transformers' default expert_count, so the MLP
layers (ffn_up) and any experts (ffn_up_exps) are read from the tensors present rather than
from those keys."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig, MoEConfig
from zllm.model.families.granite_hybrid import MAMBA2_GGUF_NAMES, mamba2_from_gguf
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile, invalid_gguf
from zllm.model.moe_arch import MOE_LACKS, moe_from_gguf
from zllm.model.state_arch import HYBRID_LACKS, check_attends, mamba2_from_hf

# config.json's Mamba-2 keys (state_arch.mamba2_from_hf).
_MAMBA_KEYS = {
    "heads": "mamba_num_heads",
    "head_dim": "mamba_head_dim",
    "groups": "n_groups",
    "state_size": "ssm_state_size",
    "conv_kernel": "conv_kernel",
    "expand": "expand",
    "conv_bias": "use_conv_bias",
    "proj_bias": "use_bias",
}
# Every spelling of a layer's kind -> ours.
_KINDS = {
    "M": "linear_attention",
    "mamba": "linear_attention",
    "linear_attention": "linear_attention",
    "*": "full_attention",
    "attention": "full_attention",
    "full_attention": "full_attention",
    "-": "mlp",
    "mlp": "mlp",
    "E": "moe",
    "moe": "moe",
}
_LATENT_REFUSAL = (
    "experts behind a latent projection (moe_latent_size, Nemotron 3 Super's fc1/fc2_latent_proj) "
    "are not supported yet"
)

# llama.cpp's names -> Hugging Face's: each layer's one norm and its mixer's tensors.
GGUF_NAMES = {
    "attn_norm": "norm",
    "attn_q": "mixer.q_proj",
    "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj",
    "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
    # an expert layer's (its mixer is an MoE block, named mlp.* by the model)
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction",  # (.bias: e_score_correction_bias)
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    **{key: f"mixer.{name}" for key, name in MAMBA2_GGUF_NAMES.items()},
}


def layer_kinds(names: list[str] | str, where: Path | str) -> list[str]:
    kinds = [_KINDS.get(name) for name in names]
    if None in kinds:
        unknown = sorted({n for n, k in zip(names, kinds, strict=True) if k is None})
        raise ValueError(f"{where}: layer kinds {', '.join(unknown)} (Nemotron-H has M, *, - and E)")  # fmt: skip
    return kinds


def moe_from_hf(cfg: dict[str, Any], kinds: list[str], where: Path) -> MoEConfig | None:
    """The expert layers' shape (None when there are none)."""
    if "moe" not in kinds:
        return None
    if cfg.get("moe_latent_size"):
        raise ValueError(f"{where}: {_LATENT_REFUSAL}")
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k or not cfg.get("moe_intermediate_size"):
        raise ValueError(f"{where}: expert layers without n_routed_experts, num_experts_per_tok or moe_intermediate_size")  # fmt: skip
    return MoEConfig(
        num_experts=int(experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size") or 0),
        dense_mlp_layers=tuple(i for i, kind in enumerate(kinds) if kind != "moe"),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        expert_group_count=int(cfg.get("n_group") or 1),
        expert_groups_used=int(cfg.get("topk_group") or 1),
    )


# The older config names transformers still reads, and its defaults for the Mamba-2 keys.
_LEGACY_KEYS = {
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "use_conv_bias": "mamba_conv_bias",
    "time_step_limit": "mamba_dt_limit",
}
_MAMBA_DEFAULTS = {"n_groups": 8, "conv_kernel": 4, "use_conv_bias": True}


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    for key, old in _LEGACY_KEYS.items():
        if key not in cfg and old in cfg:
            cfg = {**cfg, key: cfg[old]}
    cfg = {**_MAMBA_DEFAULTS, **cfg}
    for key, allowed in (("mamba_hidden_act", "silu"), ("mlp_bias", False)):
        if cfg.get(key, allowed) != allowed:
            raise ValueError(f"{where}: {key} {cfg[key]!r} (Nemotron-H's is {allowed!r})")
    pattern = (
        cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type") or cfg.get("layer_types")
    )
    if not pattern:
        raise ValueError(f"{where}: a nemotron_h config without hybrid_override_pattern")
    kinds = layer_kinds(pattern, where)
    check_attends(kinds, where)
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"{where}: mlp_hidden_act {act!r} (Nemotron-H's MLPs use relu2)")
    eps = cfg.get("layer_norm_epsilon") or cfg.get("norm_eps") or cfg.get("rms_norm_eps") or 1e-5
    # (one eps for every norm; no RoPE: rope_theta and partial_rotary_factor are not read;
    # lm_head is its own matrix whatever tie_word_embeddings says, as transformers runs it)
    dense = {
        **cfg,
        "tie_word_embeddings": False,
        "num_hidden_layers": len(kinds),
        "rms_norm_eps": eps,
        "attention_bias": False,
        "max_position_embeddings": cfg.get("max_position_embeddings") or 4096,
    }
    arch = hf_config.decoder_arch(dense, where, FAMILY.name)
    return replace(
        arch,
        layer_types=kinds,
        hidden_act="relu2",
        state=mamba2_from_hf(cfg, where, arch.hidden_size, _MAMBA_KEYS),
        moe=moe_from_hf(cfg, kinds, where),
    )


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md = gguf.metadata
    arch = str(md["general.architecture"])
    # (less the multi-token-prediction blocks the converter writes after the decoder; the
    # loader skips them)
    blocks = gguf_config.need(gguf, f"{arch}.block_count", int)
    blocks -= int(md.get(f"{arch}.nextn_predict_layers") or 0)
    kv = md.get(f"{arch}.attention.head_count_kv", 0)
    kv = kv if isinstance(kv, list) else [kv] * blocks
    kinds = []
    for i in range(blocks):
        if f"blk.{i}.ffn_latent_down.weight" in gguf.tensors:
            raise invalid_gguf(gguf.path, _LATENT_REFUSAL)
        if f"blk.{i}.ffn_up_exps.weight" in gguf.tensors:
            kinds.append("moe")
        elif kv[i] > 0:
            kinds.append("full_attention")
        elif f"blk.{i}.ffn_up.weight" in gguf.tensors:
            kinds.append("mlp")
        else:
            kinds.append("linear_attention")
    check_attends(kinds, gguf.path)
    mlps = [i for i, kind in enumerate(kinds) if kind == "mlp"]
    # The MLP width from its tensor (feed_forward_length may be 0 for these layers).
    width = gguf.tensors[f"blk.{mlps[0]}.ffn_up.weight"].shape[0] if mlps else 0
    # (expert_count 0 for the shared reader: the experts are read here, from the file's own
    # keys; a dense model's copies transformers' default count)
    numbers = {
        f"{arch}.feed_forward_length": int(width),
        f"{arch}.expert_count": 0,
        f"{arch}.block_count": blocks,
    }
    moe = None
    if "moe" in kinds:
        moe = moe_from_gguf(gguf, blocks, renormalise=True)
        groups = int(md.get(f"{arch}.expert_group_count") or 1)
        moe = replace(
            moe,
            routed_scaling_factor=float(md.get(f"{arch}.expert_weights_scale") or 1.0),
            expert_group_count=groups,
            # (the converter writes no used-group count: then every group may be chosen)
            expert_groups_used=int(md.get(f"{arch}.expert_group_used_count") or groups),
        )
        if not width:  # (no dense MLP layer to size: the experts' width stands in)
            numbers[f"{arch}.feed_forward_length"] = moe.moe_intermediate_size
    eps = md.get(f"{arch}.attention.layer_norm_epsilon")  # (written where the rms one is not)
    if f"{arch}.attention.layer_norm_rms_epsilon" not in md and eps is not None:
        numbers[f"{arch}.attention.layer_norm_rms_epsilon"] = float(eps)
    record = gguf_config.decoder_arch(_with_numbers(gguf, numbers), FAMILY.name)
    return replace(
        record,
        layer_types=kinds,
        hidden_act="relu2",
        rope_scaling=None,
        state=mamba2_from_gguf(gguf),
        moe=moe,
    )


def _with_numbers(gguf: GGUFFile, numbers: dict[str, Any]) -> GGUFFile:
    """The file's header with these keys set to one number each, where the converter wrote
    per-layer arrays or another key than gguf_config.decoder_arch reads."""
    return replace(gguf, metadata={**gguf.metadata, **numbers})


FAMILY = Family(
    name="nemotron_h",
    title="Nemotron-H",
    model_types=("nemotron_h",),
    gguf_architectures=("nemotron_h", "nemotron_h_moe"),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names=GGUF_NAMES,
    gguf_permuted_qk=True,
    model_class="zllm.executor.models.nemotron_h:NemotronHForCausalLM",
    traits=frozenset({Trait.MOE, Trait.RECURRENT_STATE}),
    lacks={**MOE_LACKS, **HYBRID_LACKS},
)
