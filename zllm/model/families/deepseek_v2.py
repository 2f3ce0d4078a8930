"""DeepSeek-V2 and DeepSeek-V3 (and Kimi K2, DeepSeek-V3's architecture under its own model_type;
executor/models/deepseek_v2.py): multi-head latent attention (`ModelArchConfig` with `mla`) and
mixture-of-experts layers with shared experts, from config.json (model_type deepseek_v2,
deepseek_v3 or kimi_k2: transformers' DeepseekV2Config / DeepseekV3Config) or a GGUF file of
llama.cpp's `deepseek2` architecture, which holds both. No torch here.

What the two files say, side by side (DeepSeek-V2-Lite's numbers):

    config.json              deepseek2 GGUF                              Lite
    kv_lora_rank             attention.kv_lora_rank                      512
    q_lora_rank              attention.q_lora_rank (absent: attn_q)      null
    qk_rope_head_dim         rope.dimension_count                        64
    qk_nope + qk_rope        attention.key_length_mla (old files:        192
                             attention.key_length)
    v_head_dim               attention.value_length_mla (old files:      128
                             attention.value_length)
    rope_scaling yarn        rope.scaling.{type,factor,original_context_length,yarn_beta_*}
    mscale_all_dim           rope.scaling.yarn_log_multiplier / 0.1      0.707
    first_k_dense_replace    leading_dense_block_count (and the layers   1
                             without ffn_gate_inp)
    n_routed_experts         expert_count                                64
    num_experts_per_tok      expert_used_count                           6
    n_shared_experts         expert_shared_count                         2
    moe_intermediate_size    expert_feed_forward_length                  1408
    routed_scaling_factor    expert_weights_scale (absent: 1)            1.0
    norm_topk_prob           expert_weights_norm (absent: false)         false
    topk_method, n_group,    expert_group_count, expert_group_used_count greedy, 1, 1
      topk_group             (grouped when more than one group)
    scoring_func softmax     expert_gating_func 1 (absent: softmax)
    scoring_func sigmoid,    expert_gating_func 2, and each layer's      (DeepSeek-V3)
      topk_method noaux_tc,  exp_probs_b (the correction bias)
      e_score_correction_bias
    rope_interleave          (none: the converter keeps the pairs)       (V3: true)

The converter writes no `mscale`: llama.cpp takes it equal to mscale_all_dim (so YaRN's cos/sin
factor is 1, as in every DeepSeek-V2/V3 config), and so does this reader.

A layer is a mixture of experts from first_k_dense_replace on, every moe_layer_freq-th (DeepSeek's
rule; transformers' class reads no moe_layer_freq, and every V2 config has 1). DeepSeek-V3 routes
by sigmoid scores chosen with a per-expert correction bias (`MoEConfig.sigmoid_scores`); its
configs may leave scoring_func and topk_method out (transformers' DeepseekV3Config has neither),
meaning sigmoid and noaux_tc. The checkpoints' multi-token-prediction block (the layers from
num_hidden_layers on, num_nextn_predict_layers of them) is not read: the model skips it, as
llama.cpp's converter does. DeepSeek-V3.2's sparse-attention indexer is refused, naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config
from zllm.model.arch_config import MLAConfig, ModelArchConfig, MoEConfig
from zllm.model.family import Family, Feature, Trait
from zllm.model.gguf import GGUFFile, invalid_gguf
from zllm.model.hf_config import hf_rope_scaling
from zllm.model.moe_arch import MOE_LACKS

FAMILY_NAME = "deepseek_v2"
# DeepSeek-V3's architecture: its own configs and Kimi K2's.
V3_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# llama.cpp's expert_gating_func values.
GATING_SOFTMAX, GATING_SIGMOID = 1, 2
# The DeepSeek-V2 latent norms' epsilon: transformers builds them with its RMSNorm's default,
# not config.rms_norm_eps (so does DeepSeek's own modeling code).
LATENT_NORM_EPS = 1e-6


def read_hf(cfg: dict[str, Any], config_path: Path) -> ModelArchConfig:
    """config.json of model_type deepseek_v2 (transformers 4.5x's or 5's, or DeepSeek's own)."""

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{config_path} is missing {key!r}")
        return cfg[key]

    model_type = cfg.get("model_type") or "deepseek_v2"
    if model_type == "deepseek_v32" or cfg.get("index_topk") is not None:
        raise ValueError(
            f"{config_path}: DeepSeek-V3.2's sparse-attention indexer (index_n_heads, "
            f"index_topk) is not implemented; zllm runs DeepSeek-V2/V3's dense latent attention"
        )
    num_layers = int(need("num_hidden_layers"))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{config_path}: hidden_act {cfg['hidden_act']!r} (DeepSeek-V2 uses silu)")
    q_lora_rank = cfg.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=int(need("qk_nope_head_dim")),
        qk_rope_head_dim=int(need("qk_rope_head_dim")),
        v_head_dim=int(need("v_head_dim")),
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
    rope_params = dict(cfg.get("rope_parameters") or {})
    rope_theta = cfg.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
    eos = cfg.get("eos_token_id")
    return ModelArchConfig(
        architecture=model_type,
        family=FAMILY_NAME,
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=int(need("num_attention_heads")),
        **_latent_kv_layout(mla, str(config_path)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_scaling=hf_rope_scaling(cfg, cfg.get("rope_scaling") or rope_params),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        mla=mla,
        moe=_hf_experts(cfg, num_layers, config_path),
    )


def _hf_experts(cfg: dict[str, Any], num_layers: int, where: Path) -> MoEConfig | None:
    """ModelArchConfig's mixture-of-experts fields of a config.json ({}: every layer dense)."""
    experts = cfg.get("n_routed_experts")
    first_moe = int(cfg.get("first_k_dense_replace") or 0)
    if not experts or first_moe >= num_layers:
        return None
    v3 = cfg.get("model_type") in V3_MODEL_TYPES
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    routers = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}
    if method not in routers.get(scoring, ()):
        raise ValueError(
            f"{where}: scoring_func {scoring!r} with topk_method {method!r}: zllm runs "
            f"DeepSeek-V2's router (softmax; greedy or group_limited_greedy) and DeepSeek-V3's "
            f"(sigmoid; noaux_tc)"
        )
    every = int(cfg.get("moe_layer_freq") or 1)
    moe_inter = int(cfg.get("moe_intermediate_size") or 0)
    # noaux_tc always limits the groups (one group: no limit); V2's greedy never does.
    grouped = method != "greedy"
    return _experts(
        where,
        experts=int(experts),
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        moe_inter=moe_inter,
        shared_inter=int(cfg.get("n_shared_experts") or 0) * moe_inter,
        norm=bool(cfg.get("norm_topk_prob")),
        scale=float(cfg.get("routed_scaling_factor") or 1.0),
        groups=(int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)) if grouped else None,
        dense=[i for i in range(num_layers) if i < first_moe or i % every],
        sigmoid=scoring == "sigmoid",
    )


def _experts(
    where: Any,
    *,
    experts: int,
    top_k: int,
    moe_inter: int,
    shared_inter: int,
    norm: bool,
    scale: float,
    groups: tuple[int, int] | None,
    dense: list[int],
    sigmoid: bool,
) -> MoEConfig:
    """The fields, checked: k of the experts, their width, groups that split them evenly."""
    if not 0 < top_k <= experts:
        raise ValueError(f"{where}: {top_k} experts per token of {experts}")
    if moe_inter <= 0:
        raise ValueError(f"{where}: {experts} experts without moe_intermediate_size")
    group_count, groups_used = groups or (0, 0)
    if groups is not None and (experts % group_count or not 0 < groups_used <= group_count):
        raise ValueError(f"{where}: {experts} experts in {group_count} groups, {groups_used} used")
    return MoEConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
        expert_group_count=group_count,
        expert_groups_used=groups_used,
        dense_mlp_layers=tuple(dense),
        sigmoid_scores=sigmoid,
    )


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    """A `deepseek2` file as llama.cpp's convert_hf_to_gguf.py writes it (either kv_b layout:
    attn_kv_b whole, or attn_k_b / attn_v_b split by newer converters; loader.py joins them)."""
    md, path = gguf.metadata, gguf.path

    def need(key: str) -> int | float:
        value = md.get(f"deepseek2.{key}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise invalid_gguf(path, f"metadata key 'deepseek2.{key}' is {value!r}")
        return value

    num_layers = int(need("block_count"))
    rope_dim = int(need("rope.dimension_count"))
    # Newer converters keep key_length / value_length for the latent (MQA) view and write
    # the per-head sizes as *_mla; older ones wrote the per-head sizes as key/value_length.
    mla_keys = "deepseek2.attention.key_length_mla" in md
    qk_head_dim = int(need("attention.key_length_mla" if mla_keys else "attention.key_length"))
    v_head_dim = int(need("attention.value_length_mla" if mla_keys else "attention.value_length"))
    q_lora_rank = md.get("deepseek2.attention.q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=int(need("attention.kv_lora_rank")),
        qk_nope_head_dim=qk_head_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_head_dim,
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
    )
    tokens = md.get("tokenizer.ggml.tokens")
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise invalid_gguf(path, "missing tensor 'token_embd.weight'")
    vocab = md.get("deepseek2.vocab_size") or (len(tokens) if tokens else embd.shape[0])
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [md[f"tokenizer.ggml.{k}"] for k in eos_keys if f"tokenizer.ggml.{k}" in md]
    return ModelArchConfig(
        architecture="deepseek2",
        family=FAMILY_NAME,
        vocab_size=int(vocab),
        hidden_size=int(need("embedding_length")),
        intermediate_size=int(need("feed_forward_length")),
        num_layers=num_layers,
        num_heads=int(need("attention.head_count")),
        **_latent_kv_layout(mla, path),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(md.get("deepseek2.rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_kv_a_mqa.bias" in gguf.tensors,
        rope_scaling=_gguf_yarn(md),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(t) for t in eos)),
        mla=mla,
        moe=_gguf_experts(gguf, num_layers),
    )


def _gguf_experts(gguf: GGUFFile, num_layers: int) -> MoEConfig | None:
    """The mixture-of-experts fields of a deepseek2 file ({}: no layer has a router). Grouped
    as llama.cpp groups them: when the file names more than one group."""
    md, path = gguf.metadata, gguf.path
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors]
    if len(dense) == num_layers:
        return None
    # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (DeepSeek-V2; files without the key
    # are V2's) or _SIGMOID (DeepSeek-V3, its correction bias in exp_probs_b).
    gating = md.get("deepseek2.expert_gating_func", GATING_SOFTMAX)
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise invalid_gguf(
            path, f"expert_gating_func {gating} (DeepSeek-V2 routes by softmax, V3 by sigmoid)"
        )
    group_count = int(md.get("deepseek2.expert_group_count") or 0)
    groups_used = int(md.get("deepseek2.expert_group_used_count") or 0)
    moe_inter = int(md.get("deepseek2.expert_feed_forward_length") or 0)
    return _experts(
        path,
        experts=int(md.get("deepseek2.expert_count") or 0),
        top_k=int(md.get("deepseek2.expert_used_count") or 0),
        moe_inter=moe_inter,
        shared_inter=int(md.get("deepseek2.expert_shared_count") or 0) * moe_inter,
        norm=bool(md.get("deepseek2.expert_weights_norm", False)),
        scale=float(md.get("deepseek2.expert_weights_scale") or 1.0),
        groups=(group_count, groups_used) if group_count > 1 else None,
        dense=dense,
        sigmoid=gating == GATING_SIGMOID,
    )


def _latent_kv_layout(mla: MLAConfig, where: str) -> dict[str, int]:
    """num_kv_heads and head_dim of the pool's rows for the latent (ModelArchConfig.mla)."""
    if mla.latent_width % 2:
        raise ValueError(
            f"{where}: kv_lora_rank + qk_rope_head_dim = {mla.latent_width} is odd (the KV "
            f"pool keeps the latent row as two halves)"
        )
    return {"num_kv_heads": 1, "head_dim": mla.latent_width // 2}


def _gguf_yarn(md: dict[str, Any]) -> dict[str, Any] | None:
    """The rope parameters as config.json has them: YaRN's type, factor, original context and
    betas, and mscale_all_dim (= mscale, as llama.cpp takes it) from the log multiplier."""
    scaling = gguf_config.rope_scaling(md, "deepseek2")
    if scaling is None:
        return None
    for ours, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        value = md.get(f"deepseek2.rope.scaling.{key}")
        if value is not None:
            scaling[ours] = float(value)
    log_multiplier = md.get("deepseek2.rope.scaling.yarn_log_multiplier")
    if log_multiplier:
        scaling["mscale"] = scaling["mscale_all_dim"] = float(log_multiplier) / 0.1
    return scaling


FAMILY = Family(
    name=FAMILY_NAME,
    title="DeepSeek-V2/V3",
    # deepseek_v32 only to refuse it naming its indexer (read_hf).
    model_types=("deepseek_v2", *V3_MODEL_TYPES, "deepseek_v32"),
    gguf_architectures=("deepseek2",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    # Multi-head latent attention's tensors (llama.cpp's deepseek2). Newer converters split
    # kv_b_proj into attn_k_b (W_UK transposed, [heads, kv_lora_rank, nope]) and attn_v_b
    # (W_UV, [heads, v, kv_lora_rank]); the model joins them back into kv_b_proj.
    gguf_tensor_names={
        **gguf_config.LAYER_NAMES,
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.k_b_proj",
        "attn_v_b": "self_attn.v_b_proj",
        # DeepSeek-V3's router correction.
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        # Its shared experts: one ungated MLP, under DeepSeek's plural name.
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
    model_class="zllm.executor.models.deepseek_v2:DeepseekV2ForCausalLM",
    traits=frozenset({Trait.MLA, Trait.MOE}),
    # Its layers attend by executor/attention/mla.py: a torch path that reads and writes the
    # latent rows in the model's dtype on one rank.
    lacks={
        **MOE_LACKS,
        Feature.TENSOR_PARALLEL: "the latent attention's heads are not split over ranks yet",
        Feature.TRANSFORMERS_IMPL: (
            "transformers' MLA hands the attention keys and values of different head sizes, "
            "which the paged cache does not hold (zllm's own code runs it: --model-impl auto)"
        ),
        Feature.DETERMINISTIC: "the latent attention has no batch-invariant decode yet",
        Feature.DRAFT_MODEL: "a draft model runs Llama-style attention",
        Feature.CUDA_GRAPHS: "the latent attention runs on the torch backend",
        Feature.CLASSIFIER_HEAD: "its model code carries no score head",
    },
)
