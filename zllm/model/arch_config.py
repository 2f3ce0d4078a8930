"""A decoder's shape (`ModelArchConfig`), the record every room that sizes weights or KV reads.

Apart from its reader (zllm/model/arch.py, which needs the GGUF library and numpy), so the
config, the KV rules and LoRA's checks import the record without them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3, Hugging Face's names).

    Per token the KV cache holds one latent row shared by every head: the compressed c_kv
    (kv_lora_rank values, after its norm) and the rotated shared key k_pe (qk_rope_head_dim):
    576 values for DeepSeek-V2-Lite, where its 16 heads' own keys (192) and values (128) would
    take 5,120. A head's query and key are qk_nope_head_dim + qk_rope_head_dim wide, its value
    v_head_dim."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj; else q_a_proj, its norm, q_b_proj

    @property
    def latent_width(self) -> int:
        """Values one token's latent row holds: c_kv then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(slots=True)
class ModelArchConfig:
    """The architecture of a Llama-family decoder, read from GGUF metadata or config.json."""

    # The name the model's files give (config.json's model_type or GGUF general.architecture).
    architecture: str
    # The registry name of the family whose code runs it (zllm/model/registry.py family_of).
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    # HF-style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...} or None.
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Per layer, "full_attention" or "sliding_attention" (Hugging Face's names); None: all full.
    layer_types: list[str] | None = None
    # Keys a sliding layer's query sees, itself included (positions q - window < k <= q).
    sliding_window: int | None = None
    qk_norm: bool = False  # Qwen 3, Gemma 3: an RMSNorm over each query and key head
    hidden_act: str = "silu"  # the MLP gate's activation ("gelu_pytorch_tanh" for Gemma)
    # Attention scale is query_pre_attn_scalar ** -0.5 when set (Gemma), else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding layers when it differs (Gemma 3)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None
    # gpt-oss: a learned sink logit per query head joins each softmax's denominator (no value:
    # executor/attention/sinks.py); the model holds them, every attention path takes them.
    attention_sinks: bool = False
    # Llama 3.x GGUFs: per-frequency divisors of the RoPE inverse frequencies (rope_freqs.weight).
    rope_freq_factors: list[float] | None = None
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE; executor/models/moe.py): a
    # sparse layer's MLP is num_experts experts of moe_intermediate_size each, of which the
    # router picks num_experts_per_tok per token. 0 experts: every MLP dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on, sigmoid-gated expert
    # Layers whose MLP stays dense (of intermediate_size) in a mixture-of-experts model
    # (Qwen-MoE's mlp_only_layers and decoder_sparse_step).
    dense_mlp_layers: list[int] = field(default_factory=list)
    # DeepSeek-V2's router (executor/models/moe.py's DeepSeek rule): the chosen weights times
    # routed_scaling_factor; experts in expert_group_count equal groups, of which each token
    # picks from the expert_groups_used best (by their best score). 0 groups: no group limit.
    routed_scaling_factor: float = 1.0
    expert_group_count: int = 0
    expert_groups_used: int = 0
    # Multi-head latent attention (DeepSeek-V2): then the KV pool's rows are the latent's, one
    # KV head of half the latent row per K/V plane (num_kv_heads 1, head_dim latent_width / 2:
    # executor/attention/mla.py draws it), so every rule that sizes a block by num_kv_heads x
    # head_dim x 2 holds the latent row exactly, no V beside it.
    mla: MLAConfig | None = None
    # Whether the model takes images (a vision encoder beside the decoder: Gemma 3's and
    # Qwen2.5-VL's in zllm's code, zllm/model/arch.py; LLaVA's in transformers',
    # zllm/model/impl.py). Other multimodal checkpoints are refused at load, and an image sent
    # to a text-only model is refused naming it (zllm/media/images.py require_vision).
    vision: bool = False
    # False: the checkpoint is a base model without a language-model head (an embedding
    # model's decoder, zllm/model/checkpoint_names.py): it runs as a pooling model only.
    lm_head: bool = True
    # A sequence-classification head (`*ForSequenceClassification`: `score.weight`, one row
    # per label) read on the last token: a classifier, cross-encoder or reward model. 0: none.
    num_labels: int = 0
    # A classifier made from a causal LM's head (--hf-overrides classifier_from_token): the
    # LM head rows of these tokens score the labels; one label from two tokens scores the
    # second's logit less the first's (Qwen3-Reranker's yes over no). None: none.
    classifier_tokens: list[int] | None = None
    # An encoder (BERT, RoBERTa, XLM-R on the transformers backend): every token attends to
    # its whole prompt, so a prompt is computed in one step and pools; it never decodes.
    encoder: bool = False
    # Whether an image's tokens attend to each other both ways (Gemma 3), so each image is
    # prefilled in one step (core/request.py chunk_end); else they are causal like text.
    images_bidirectional: bool = False
    # Multimodal RoPE (Qwen2.5-VL): the rotary frequencies split in sections, each turned by
    # one of a token's (time, row, column) positions (executor/models/vision/mrope.py);
    # text tokens have all three equal. None: one position per token.
    mrope_section: list[int] | None = None

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether this layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers
