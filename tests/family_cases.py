"""One row per model family in zllm/model/registry.py (FAMILIES), keyed by the family's name:
how tests/executor/models/test_families.py writes a tiny random model of it, from
transformers' own config class of the real architecture, and whether llama.cpp's converter
writes its GGUF (at which outtype: F32 keeps every weight as the checkpoint has it, so greedy
parity with transformers is exact). A family added to the registry adds its row here (the
test fails without one), beside its own special tests.

The tiny shapes of the families whose special tests need more than tiny_models.TINY_CONFIG
(experts, latent attention, LongRoPE, windows) live here too, and those tests import them:
the families test runs the very models they run.

A family with a GGUF form gets one directory for both forms: write_convertible_model's model
(a SentencePiece tokenizer, what the converter reads) with the tokenizer.json zllm reads beside
it (with_tokenizer_json), so the HF form and the GGUF form are the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llama_cpp_convert import SPM_VOCAB_SIZE, write_convertible_model
from pooling_models import write_st_encoder
from tiny_models import draw_sinks_and_expert_biases
from vision_models import write_tiny_llava, write_tiny_qwen_vl

# ---------------------------------------------------------------------------------------------
# The families' tiny shapes (tiny_models.TINY_CONFIG otherwise: hidden 64, 4 heads, 2 KV heads)

# Mixture-of-experts (tests/executor/layers/test_moe.py). Qwen3-MoE renormalises as its
# released configs do (and llama.cpp always does for qwen3moe files).
QWEN3_MOE = dict(
    head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
)
QWEN2_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_hidden_layers=3,
    mlp_only_layers=[1],  # a dense layer between two sparse ones
)
# llama.cpp's qwen2moe has no dense layers (its converter refuses mlp_only_layers' tensors);
# a shared expert 64 wide keeps its down matrix in Q8_0 blocks of 32.
QWEN2_MOE_ALL_SPARSE = {
    **QWEN2_MOE,
    "num_hidden_layers": 2,
    "mlp_only_layers": [],
    "shared_expert_intermediate_size": 64,
}
# (Qwen2-MoE's seeds 0 and 1 repeat two tokens on a prompt: a parity check of little worth.)
QWEN2_MOE_SEED = 3
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=32)

# gpt-oss (tests/executor/models/test_gpt_oss.py): layers sliding, full, sliding, full (its
# order), a window of 8, 4 experts of which 2 a token; heads of 64 as the real model's.
GPT_OSS = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=32,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2,
    tie_word_embeddings=False,
)

# DeepSeek-V2 (tests/executor/attention/test_mla.py): YaRN RoPE with mscale_all_dim, latent
# rows of kv_lora_rank 96 + rope 16, every layer dense but in "moe".
_DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,  # max_position_embeddings 512 over 128
    "original_max_position_embeddings": 128,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
_LATENT: dict = dict(
    num_key_value_heads=None,  # (the config class makes it num_attention_heads)
    kv_lora_rank=96,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=64,
    first_k_dense_replace=2,  # every layer dense
    num_hidden_layers=2,
    rope_parameters=_DEEPSEEK_YARN,
)
DEEPSEEK_V2 = {
    # DeepSeek-V2-Lite's shape: one q_proj, untied logits.
    "lite": dict(_LATENT, q_lora_rank=None, tie_word_embeddings=False),
    # DeepSeek-V2's: q_a_proj, its norm and q_b_proj; tied logits.
    "v2": dict(_LATENT, q_lora_rank=64, tie_word_embeddings=True),
    # The v2 shape with one dense layer, then two of 8 routed experts (2 a token, picked
    # within the best of 2 groups) and one shared expert.
    "moe": dict(
        _LATENT,
        q_lora_rank=64,
        tie_word_embeddings=True,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,  # (transformers' DeepSeek-V2 router never renormalises)
    ),
}

# DeepSeek-V3 (the deepseek_v2 family's second case): the moe shape under V3's router, sigmoid
# scores with drawn correction biases, 8 experts in 4 groups of which each token's best 2,
# renormalised, times 2.5; with the multi-token-prediction layer its checkpoints append.
DEEPSEEK_V3 = dict(
    DEEPSEEK_V2["moe"],
    topk_method="noaux_tc",
    scoring_func="sigmoid",  # (as DeepSeek-V3's config.json: the converter reads it)
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
)

# GLM-4.5 (tests/executor/models/test_glm4_moe.py): q/k/v biases and head norms, half of each
# head rotated; one dense layer, then two of 8 experts (2 a token, from the best 2 of 4
# groups, sigmoid scores with drawn corrections, renormalised, times 2.5) beside a shared
# expert; the MTP layer its checkpoints append.
GLM4_MOE = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    use_qk_norm=True,
    attention_bias=True,
    num_nextn_predict_layers=1,
)

# MiniMax-M2: q/k norms over all heads, half of each head rotated (rotary_dim), every layer
# 2 of 8 experts by sigmoid scores with drawn corrections.
MINIMAX_M2 = dict(
    num_local_experts=8,
    num_experts_per_tok=2,
    head_dim=16,
    rotary_dim=8,
    pad_token_id=None,
)

# Llama 4 (tests/executor/models/test_llama4.py): four layers, the fourth NoPE; experts (1 of 4
# a token, beside a shared expert) on every other layer, dense MLPs of 64 between; the qk norm.
LLAMA4 = dict(
    num_hidden_layers=4,
    num_local_experts=4,
    num_experts_per_tok=1,
    intermediate_size=32,
    intermediate_size_mlp=64,
    interleave_moe_layer_step=2,
    head_dim=16,
    pad_token_id=None,
)

# Phi-3 (tests/executor/models/test_gguf_architectures.py): LongRoPE over 3/4 of each head
# and a window of 8 on every layer. Prompts run past its pretraining context (32): transformers
# takes the long factors only there, zllm for any prompt (its context, 512, is past it).
PHI3_CONTEXT = 32
PHI3 = dict(
    sliding_window=8,
    partial_rotary_factor=0.75,
    original_max_position_embeddings=PHI3_CONTEXT,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": PHI3_CONTEXT,
        "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],  # one per rotated pair: 12 of 16 dims
        "short_factor": [1.0, 1.25, 1.5, 1.75, 2.0, 2.5],
        "partial_rotary_factor": 0.75,
    },
)

# Gemma 3 as its GGUF files can say it: llama.cpp writes no layer pattern and takes every 6th
# layer global, the attention scale's scalar the head size, the local RoPE base 10000.
GEMMA3 = dict(
    num_hidden_layers=6,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=8,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
)


# Gated DeltaNet hybrids (tests/executor/models/test_hybrid.py): state layers and full
# attention alternating, 2 key heads serving 4 value heads; Qwen3-Next's (and Qwen3.5-MoE's)
# MLPs experts with a gated shared expert.
HYBRID = dict(
    num_hidden_layers=4,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"] * 2,
)
HYBRID_MOE = dict(
    HYBRID,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)

# Mamba-2 hybrids: Granite 4.0-H (tests/executor/models/test_hybrid_mamba2.py): state layers
# with an attention layer between, 4 heads of 16 in 2 groups of B and C, experts beside the
# shared MLP, Granite's multipliers away from one.
GRANITE_HYBRID = dict(
    num_hidden_layers=4,
    layer_types=["mamba", "mamba", "attention", "mamba"],
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_head=16,
    mamba_d_conv=4,
    mamba_expand=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=32,
    shared_intermediate_size=64,
    embedding_multiplier=4.0,
    residual_multiplier=0.5,
    attention_multiplier=0.125,
    logits_scaling=2.0,
)

# Nemotron-H: every kind of layer (Mamba-2, attention, MLP alone, Nemotron 3's experts alone),
# Mamba-2 layers of 8 heads of 16 in 2 groups; 8 experts in 2 groups, the best group's 2 best.
NEMOTRON_H = dict(
    hybrid_override_pattern="M*-MEM",
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=64,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    intermediate_size=96,
    head_dim=16,
)


# ---------------------------------------------------------------------------------------------
# The rows


@dataclass(frozen=True)
class FamilyCase:
    """How the families test makes its tiny model of one family."""

    # (directory, **fixtures) -> the directory, holding the model in Hugging Face layout with
    # the tokenizer zllm reads.
    write: Callable[..., Path]
    # conftest fixtures `write` takes, by name (the SmolLM2 GGUF whose vocabulary it adds to).
    fixtures: tuple[str, ...] = ()
    # The outtype llama.cpp's converter writes the GGUF form at (None: no GGUF form).
    gguf_outtype: str | None = None
    # Why there is no GGUF form, for a family that reads GGUF files (gguf_architectures).
    no_gguf: str = ""
    # Prompts are token ids below this: the tokenizer's ordinary tokens.
    prompt_vocab: int = SPM_VOCAB_SIZE
    # The registry family this case runs as, where the row's name is a second case of it
    # (DeepSeek-V3 under deepseek_v2); None: the row's name.
    family: str | None = None


def with_tokenizer_json(path: Path) -> Path:
    """tokenizer.json beside tokenizer.model: transformers' conversion of the SentencePiece
    model, which zllm reads from a directory (the converter reads tokenizer.model first)."""
    import transformers

    transformers.AutoTokenizer.from_pretrained(path).backend_tokenizer.save(
        str(path / "tokenizer.json")
    )
    return path


def convertible(arch: str, seed: int = 0, **shape) -> Callable[[Path], Path]:
    """A writer of write_convertible_model's `arch` model with its tokenizer.json."""
    return lambda path: with_tokenizer_json(write_convertible_model(path, arch, seed, **shape))


def _gpt_oss(path: Path) -> Path:
    """Sinks, router and expert biases drawn (transformers initialises them to zero)."""
    return draw_sinks_and_expert_biases(convertible("gpt_oss", **GPT_OSS)(path))


def with_mtp_head(path: Path) -> Path:
    """A multi-token-prediction head beside the decoder, as Qwen3-Next's and Qwen3.5's
    checkpoints carry one (mtp.*: its fc over [embedding | hidden], its norms, one decoder
    layer, here a copy of the last full-attention layer's tensors): zllm skips it, and
    llama.cpp's converter writes it as one more block (nextn)."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    full = max(i for i, t in enumerate(config["layer_types"]) if t == "full_attention")
    file = path / "model.safetensors"
    tensors = load_file(file)
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(7)
    head = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.05,
        "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden, generator=gen) * 0.1,
        "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden, generator=gen) * 0.1,
        "mtp.norm.weight": torch.randn(hidden, generator=gen) * 0.1,
    }
    prefix = f"model.layers.{full}."
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            head["mtp.layers.0." + name[len(prefix) :]] = tensor.clone()
    save_file({**tensors, **head}, str(file), metadata={"format": "pt"})
    return path


def hybrid(arch: str, **shape) -> Callable[[Path], Path]:
    """A Gated DeltaNet hybrid's writer: convertible's model with an MTP head."""
    return lambda path: with_mtp_head(convertible(arch, **shape)(path))


def with_mamba2_parameters(path: Path, seed: int = 0) -> Path:
    """A saved Mamba-2 hybrid's A_log, D and dt_bias drawn (transformers initialises them to
    log(1..heads), ones and ones, the same in every layer), and Nemotron 3's experts' score
    corrections (zeros)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("A_log", ".D", "dt_bias")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(path)
    return path


def with_drawn_score_corrections(path: Path, seed: int = 0) -> Path:
    """A saved model's experts' score corrections (e_score_correction_bias, buffers that
    transformers initialises to zeros) drawn."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    model.save_pretrained(path)
    return path


def with_mtp_layer(path: Path, seed: int = 0) -> Path:
    """DeepSeek-V3's multi-token-prediction block as its checkpoints append it: layer
    num_hidden_layers (a copy of the last layer, drawn anew) with its eh_proj, enorm, hnorm and
    shared head. Neither transformers nor llama.cpp's converter reads it."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    last, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(seed)
    mtp = f"model.layers.{last + 1}."
    extra = {
        mtp + name[len(f"model.layers.{last}.") :]: torch.randn(t.shape, generator=gen)
        for name, t in tensors.items()
        if name.startswith(f"model.layers.{last}.")
    }
    extra |= {
        mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
        mtp + "enorm.weight": torch.randn(hidden, generator=gen),
        mtp + "hnorm.weight": torch.randn(hidden, generator=gen),
        mtp + "shared_head.norm.weight": torch.randn(hidden, generator=gen),
    }
    save_file({**tensors, **extra}, str(file), metadata={"format": "pt"})
    return path


def corrected_with_mtp(arch: str, **shape) -> Callable[[Path], Path]:
    """DeepSeek-V3's and GLM-4.5's writer: convertible's model, its experts' score corrections
    drawn, the MTP layer their checkpoints append."""
    return lambda path: with_mtp_layer(
        with_drawn_score_corrections(convertible(arch, **shape)(path))
    )


def minimax_m2(**shape) -> Callable[[Path], Path]:
    """MiniMax-M2's writer: convertible's model with its experts' score corrections drawn."""
    return lambda path: with_drawn_score_corrections(convertible("minimax_m2", **shape)(path))


def with_released_layer_names(path: Path) -> Path:
    """config.json's layer_types as Granite 4.0-H's checkpoints spell them ("mamba",
    "attention"; transformers 5 saves its own names, which llama.cpp's converter reads as
    all-Mamba)."""
    file = path / "config.json"
    config = json.loads(file.read_text())
    released = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [released.get(t, t) for t in config["layer_types"]]
    file.write_text(json.dumps(config, indent=2))
    return path


def granite_hybrid(**shape) -> Callable[[Path], Path]:
    """Granite 4.0-H's writer: convertible's model, its state parameters drawn, its layer
    names as released."""
    return lambda path: with_released_layer_names(
        with_mamba2_parameters(convertible("granitemoehybrid", **shape)(path))
    )


def nemotron_h(**shape) -> Callable[[Path], Path]:
    """Nemotron-H's writer: convertible's model, its state parameters drawn, config.json's
    layer pattern as the released checkpoints give it (hybrid_override_pattern; transformers 5
    saves a list) and their norm_eps (llama.cpp's loader needs the key it becomes)."""

    def write(path: Path) -> Path:
        with_mamba2_parameters(convertible("nemotron_h", **shape)(path))
        file = path / "config.json"
        config = json.loads(file.read_text())
        config.pop("layers_block_type", None)
        config["hybrid_override_pattern"] = shape["hybrid_override_pattern"]
        config["norm_eps"] = config["layer_norm_epsilon"]
        file.write_text(json.dumps(config, indent=2))
        return path

    return write


def _bert(path: Path) -> Path:
    """A tiny BERT with sentence-transformers' mean pooling and normalisation."""
    return write_st_encoder(path, "bert", "mean", True)


F32 = "f32"
SMOLLM2_VOCAB = 49152  # the SmolLM2 tokenizer's ordinary tokens (image tokens after them)

CASES: dict[str, FamilyCase] = {
    "llama": FamilyCase(convertible("llama"), gguf_outtype=F32),
    # Four layers: the fourth is NoPE (transformers' default no_rope_layers, llama.cpp's rule).
    "smollm3": FamilyCase(
        convertible("smollm3", num_hidden_layers=4, pad_token_id=None), gguf_outtype=F32
    ),
    "mixtral": FamilyCase(convertible("mixtral", **MIXTRAL), gguf_outtype=F32),
    "qwen2": FamilyCase(convertible("qwen2"), gguf_outtype=F32),
    "qwen2_moe": FamilyCase(
        convertible("qwen2_moe", QWEN2_MOE_SEED, **QWEN2_MOE_ALL_SPARSE), gguf_outtype=F32
    ),
    "qwen3": FamilyCase(convertible("qwen3"), gguf_outtype=F32),
    # OLMo 3 (the olmo2 family's second case): four layers, three windowed (8 keys), one full.
    "olmo3": FamilyCase(
        convertible("olmo3", num_hidden_layers=4, sliding_window=8, pad_token_id=None),
        gguf_outtype=F32,
        family="olmo2",
    ),
    # (seed 3: seed 0's post-norm model repeats one token for two of the prompts)
    "olmo2": FamilyCase(convertible("olmo2", seed=3, pad_token_id=None), gguf_outtype=F32),
    "qwen3_moe": FamilyCase(convertible("qwen3_moe", **QWEN3_MOE), gguf_outtype=F32),
    "glm4_moe": FamilyCase(corrected_with_mtp("glm4_moe", **GLM4_MOE), gguf_outtype=F32),
    "minimax_m2": FamilyCase(minimax_m2(**MINIMAX_M2), gguf_outtype=F32),
    "llama4": FamilyCase(convertible("llama4_text", **LLAMA4), gguf_outtype=F32),
    "phi3": FamilyCase(convertible("phi3", **PHI3), gguf_outtype=F32),
    "gemma3": FamilyCase(convertible("gemma3_text", **GEMMA3), gguf_outtype=F32),
    "qwen2_5_vl": FamilyCase(
        lambda path, smollm2_path: write_tiny_qwen_vl(path, smollm2_path),
        fixtures=("smollm2_path",),
        prompt_vocab=SMOLLM2_VOCAB,
    ),
    "gpt_oss": FamilyCase(_gpt_oss, gguf_outtype=F32),
    "deepseek_v2": FamilyCase(convertible("deepseek_v2", **DEEPSEEK_V2["moe"]), gguf_outtype=F32),
    "deepseek_v3": FamilyCase(
        corrected_with_mtp("deepseek_v3", **DEEPSEEK_V3), gguf_outtype=F32, family="deepseek_v2"
    ),
    "llava": FamilyCase(
        lambda path, smollm2_path: write_tiny_llava(path, smollm2_path),
        fixtures=("smollm2_path",),
        prompt_vocab=SMOLLM2_VOCAB,
    ),
    "bert": FamilyCase(_bert),
    "qwen3_next": FamilyCase(hybrid("qwen3_next", **HYBRID_MOE), gguf_outtype=F32),
    "qwen3_5": FamilyCase(hybrid("qwen3_5_text", **HYBRID), gguf_outtype=F32),
    "qwen3_5_moe": FamilyCase(hybrid("qwen3_5_moe_text", **HYBRID_MOE), gguf_outtype=F32),
    "granite_hybrid": FamilyCase(granite_hybrid(**GRANITE_HYBRID), gguf_outtype=F32),
    "nemotron_h": FamilyCase(nemotron_h(**NEMOTRON_H), gguf_outtype=F32),
}
