"""gpt-oss (executor/models/gpt_oss.py), from a Hugging Face config.json (model_type gpt_oss)
or a GGUF file of llama.cpp's `gpt-oss` architecture. It writes OpenAI's harmony format, so
harmony's parsers are its defaults. No torch here.

What the record holds for it (executor/models/gpt_oss.py builds the model from it):

    layers      sliding-window (128) and full attention alternating, layer 0 sliding
                (config.json's layer_types; a GGUF file does not store them: llama.cpp's
                swa pattern of 2, the same order); each on its KV cache group (hybrid cache)
    attention   q/k/v/o biases, a sink logit per head (its ATTENTION_SINKS trait), YaRN RoPE
    MLP         every layer a mixture of experts: num_local_experts of intermediate_size,
                num_experts_per_tok chosen by a biased router (the softmax over the top k)

YaRN: gpt-oss computes its correction range without rounding it (config.json's
`truncate: false`, as OpenAI's reference does). GGUF files do not carry that key, and
llama.cpp rounds; a gpt-oss file is read here as its checkpoint runs, unrounded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config
from zllm.model.arch_config import ModelArchConfig, MoEConfig
from zllm.model.family import Family, Feature, Trait
from zllm.model.gguf import GGUFFile, invalid_gguf
from zllm.model.moe_arch import MOE_LACKS

FAMILY_NAME = "gpt_oss"
HF_NAME = "gpt_oss"  # config.json's model_type
GGUF_NAME = "gpt-oss"  # GGUF general.architecture
# The clamped SwiGLU of gpt-oss's experts (executor/layers/moe/ GPT_OSS_RULE): every
# released checkpoint has these; another value would be silently ignored, so it is refused.
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702


def alternating_layer_types(num_layers: int) -> list[str]:
    """Sliding on even layers, full on odd ones: GptOssConfig's default and llama.cpp's."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def read_hf(cfg: dict[str, Any], config_path: Path) -> ModelArchConfig:
    """config.json of model_type gpt_oss, as transformers 4.5x or 5 writes it (or OpenAI's)."""

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{config_path} is missing {key!r}")
        return cfg[key]

    for key, expected in (("swiglu_limit", SWIGLU_LIMIT), ("swiglu_alpha", SWIGLU_ALPHA)):
        if float(cfg.get(key, expected)) != expected:
            raise ValueError(
                f"{config_path}: {key}={cfg[key]} (zllm runs gpt-oss's experts with {expected})"
            )
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ValueError(f"{config_path}: gpt-oss quantized with {quant!r} (zllm reads mxfp4)")
    num_layers = int(need("num_hidden_layers"))
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    layer_types = list(cfg.get("layer_types") or alternating_layer_types(num_layers))
    if len(layer_types) != num_layers:
        raise ValueError(f"{config_path}: {len(layer_types)} layer_types for {num_layers} layers")
    # transformers 5 writes rope_theta inside rope_parameters; 4.x and OpenAI's config beside
    # rope_scaling.
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rope_theta = cfg.get("rope_theta") or rope.get("rope_theta") or 150000.0
    rope.pop("rope_theta", None)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    eos = cfg.get("eos_token_id")
    inter = int(need("intermediate_size"))
    return ModelArchConfig(
        architecture=HF_NAME,
        family=FAMILY_NAME,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", True)),
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        layer_types=layer_types,
        sliding_window=int(cfg.get("sliding_window") or 128),
        moe=MoEConfig(int(need("num_local_experts")), int(need("num_experts_per_tok")), inter),
    )


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    """A GGUF file of llama.cpp's gpt-oss architecture (convert_hf_to_gguf.py's GptOssModel)."""
    md, path = gguf.metadata, gguf.path

    def need(key: str) -> Any:
        value = md.get(f"{GGUF_NAME}.{key}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise invalid_gguf(path, f"metadata key '{GGUF_NAME}.{key}' is {value!r}")
        return value

    num_layers = int(need("block_count"))
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    inter = int(md.get(f"{GGUF_NAME}.expert_feed_forward_length") or need("feed_forward_length"))
    tokens = md.get("tokenizer.ggml.tokens") or []
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [int(md[f"tokenizer.ggml.{k}"]) for k in eos_keys if f"tokenizer.ggml.{k}" in md]
    if "token_embd.weight" not in gguf.tensors:
        raise invalid_gguf(path, "missing tensor 'token_embd.weight'")
    return ModelArchConfig(
        architecture=GGUF_NAME,
        family=FAMILY_NAME,
        vocab_size=len(tokens) or gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(md.get(f"{GGUF_NAME}.attention.head_count_kv", heads)),
        head_dim=int(md.get(f"{GGUF_NAME}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(md.get(f"{GGUF_NAME}.rope.freq_base", 150000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        rope_scaling=_gguf_yarn(md),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        layer_types=alternating_layer_types(num_layers),
        sliding_window=int(need("attention.sliding_window")),
        moe=MoEConfig(int(need("expert_count")), int(need("expert_used_count")), inter),
    )


def _gguf_yarn(md: dict[str, Any]) -> dict[str, Any] | None:
    """rope.scaling.* (each a scalar key; transformers' GGUF reader takes a field's first
    part, the key's length, for its value and fails) as the rope parameters RoPE reads."""
    prefix = f"{GGUF_NAME}.rope.scaling."
    kind = md.get(f"{prefix}type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ValueError(f"{GGUF_NAME} rope scaling {kind!r} (gpt-oss uses yarn)")
    scaling: dict[str, Any] = {"rope_type": "yarn", "truncate": False}
    keys = {
        "factor": "factor",
        "original_context_length": "original_max_position_embeddings",
        "yarn_beta_fast": "beta_fast",
        "yarn_beta_slow": "beta_slow",
        "yarn_attn_factor": "attention_factor",
    }
    for key, name in keys.items():
        value = md.get(prefix + key)
        if value is not None:
            scaling[name] = value
    if "factor" not in scaling:
        raise ValueError(f"{GGUF_NAME} yarn scaling without {prefix}factor")
    return scaling


def _transformers_gguf_problem(gguf: GGUFFile) -> str | None:
    """transformers' GGUF reader lists gpt-oss but takes each rope.scaling key's first part
    (the key's length, an array) for its value: "TypeError: only 0-dimensional arrays"."""
    if f"{GGUF_NAME}.rope.scaling.type" not in gguf.metadata:
        return None
    return "transformers' GGUF reader cannot read gpt-oss files (it misreads their rope.scaling metadata)"  # noqa: E501


FAMILY = Family(
    name=FAMILY_NAME,
    title="gpt-oss",
    model_types=(HF_NAME,),
    gguf_architectures=(GGUF_NAME,),
    read_hf=read_hf,
    read_gguf=read_gguf,
    # Its sink logits, and the norm before its experts under the name Gemma's files use after
    # the attention (HF's post_attention_layernorm, as Llama's ffn_norm).
    gguf_tensor_names={
        **gguf_config.LAYER_NAMES,
        "attn_sinks": "self_attn.sinks",
        "post_attention_norm": "post_attention_layernorm",
    },
    transformers_gguf_problem=_transformers_gguf_problem,
    model_class="zllm.executor.models.gpt_oss:GptOssForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW, Trait.ATTENTION_SINKS, Trait.MOE}),
    lacks={**MOE_LACKS, Feature.CLASSIFIER_HEAD: "its model code carries no score head"},
    default_parsers=("openai_gptoss", "openai"),
)
