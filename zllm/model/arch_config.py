"""A decoder's shape (`ModelArchConfig`), the record every room that sizes weights or KV reads,
and the parts several families share: mixture-of-experts (`MoEConfig`), multi-head latent
attention (`MLAConfig`) and the recurrent state of a hybrid model's state layers
(`StateConfig`).

Apart from its readers (zllm/model/families/, which need the GGUF library and numpy), so the
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
    # The rope dims rotate by adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek's checkpoints;
    # transformers' rope_interleave, default true) or as two halves (Llama's rotate_half).
    rope_interleave: bool = True

    @property
    def latent_width(self) -> int:
        """Values one token's latent row holds: c_kv then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts decoder's experts (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss,
    DeepSeek-V2; executor/layers/moe/): a sparse layer's MLP is num_experts experts of
    moe_intermediate_size each, of which the router picks num_experts_per_tok per token."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1
    # An always-on expert beside the routed ones (Qwen2-MoE's sigmoid-gated one, DeepSeek's
    # ungated shared experts): its width, 0 for none.
    shared_expert_intermediate_size: int = 0
    # Layers whose MLP stays dense (of intermediate_size): Qwen-MoE's mlp_only_layers and
    # decoder_sparse_step, DeepSeek's first_k_dense_replace.
    dense_mlp_layers: tuple[int, ...] = ()
    # DeepSeek-V2's router (layers/moe/router.py): the chosen weights times
    # routed_scaling_factor; experts in expert_group_count equal groups, of which each token
    # picks from the expert_groups_used best (by their best score). 0 groups: no group limit.
    routed_scaling_factor: float = 1.0
    expert_group_count: int = 0
    expert_groups_used: int = 0
    # DeepSeek-V3's router (scoring_func sigmoid, topk_method noaux_tc): sigmoid scores, the
    # experts chosen by score plus a per-expert correction bias (e_score_correction_bias),
    # groups ranked by their two best biased scores.
    sigmoid_scores: bool = False


@dataclass(frozen=True, slots=True)
class StateConfig:
    """A hybrid model's state layers (layer_types "linear_attention"): instead of a KV cache
    each keeps, per sequence, a fixed-size state that every token updates (zllm/kv/
    state_layout.py sizes it; docs/kv-cache.md draws it).

    Gated DeltaNet (Qwen3-Next, Qwen3.5), Hugging Face's names in brackets:
      conv window   the last conv_kernel - 1 inputs of the causal conv1d over q|k|v
                    (conv_dim = 2 x num_key_heads x key_head_dim + num_heads x value_head_dim)
      recurrent     num_heads matrices of key_head_dim x value_head_dim, fp32
      heads         num_key_heads (linear_num_key_heads) query/key heads of key_head_dim
                    (linear_key_head_dim); num_heads (linear_num_value_heads) value heads of
                    value_head_dim (linear_value_head_dim); conv_kernel (linear_conv_kernel_dim)

    Mamba-2 (Granite 4.0-H, Nemotron-H), a gated linear attention with query C, key B and
    value dt x (executor/layers/mamba2_scan.py):
      conv window   over x|B|C (conv_dim = value_dim + 2 x groups x state size, the same sum)
      recurrent     num_heads matrices of state size x head_dim, fp32
      heads         num_heads (mamba_n_heads) heads of value_head_dim (mamba_d_head); B and C
                    in num_key_heads groups (mamba_n_groups) of key_head_dim (the state size,
                    mamba_d_state); conv_kernel (mamba_d_conv)
    """

    kind: str  # "gated_delta_net" | "mamba2"
    conv_kernel: int
    num_heads: int
    num_key_heads: int
    key_head_dim: int
    value_head_dim: int
    # How the weights order the value heads: grouped by the key head they share (Hugging
    # Face's: value head h reads key head h // (heads / key heads)), or tiled (llama.cpp's
    # Qwen3.5 files: h reads key head h % key heads), which the layer follows as stored.
    tiled_value_heads: bool = False
    # How the b and a projections are stored: apart, [b | a] (Qwen3.5's in_proj_b and
    # in_proj_a), or interleaved per key head, [b_0 a_0 b_1 a_1 ...] (Qwen3-Next's in_proj_ba,
    # and llama.cpp's ssm_ba), which the layer reads as stored.
    grouped_beta_alpha: bool = False
    # Mamba-2: the conv has a bias (mamba_conv_bias), in_proj and out_proj have biases
    # (mamba_proj_bias, use_bias); the gated norm's RMS is taken over norm_groups equal slices
    # of the heads' outputs (the B/C groups), with norm_eps (None: the model's rms_norm_eps).
    conv_bias: bool = False
    proj_bias: bool = False
    norm_groups: int = 1
    norm_eps: float | None = None

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the causal conv1d runs over: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_elems(self) -> int:
        """One sequence's conv window in one layer: conv_dim x (conv_kernel - 1) values."""
        return self.conv_dim * (self.conv_kernel - 1)

    @property
    def recurrent_elems(self) -> int:
        """One sequence's recurrent state in one layer: num_heads x key x value values."""
        return self.num_heads * self.key_head_dim * self.value_head_dim


@dataclass(slots=True)
class ModelArchConfig:
    """A decoder's shape, read from GGUF metadata or config.json by its family
    (zllm/model/families/): what every room that sizes weights or KV reads. A family's own
    fields (Gemma 3's attention scale, say) sit in `family_fields`, a record of its module's."""

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
    attention_bias: bool = False  # q/k/v biases (Qwen2's)
    # HF-style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...} or None.
    rope_scaling: dict[str, Any] | None = None
    # Llama 3.x GGUFs: per-frequency divisors of the RoPE inverse frequencies (rope_freqs.weight).
    rope_freq_factors: list[float] | None = None
    # Multimodal RoPE (Qwen2.5-VL): the rotary frequencies split in sections, each turned by
    # one of a token's (time, row, column) positions (executor/models/vision/mrope.py);
    # text tokens have all three equal. None: one position per token.
    mrope_section: list[int] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Per layer, "full_attention" or "sliding_attention" (Hugging Face's names); None: all full.
    layer_types: list[str] | None = None
    # Keys a sliding layer's query sees, itself included (positions q - window < k <= q).
    sliding_window: int | None = None
    # Layers whose attention takes no position embedding (NoPE: SmolLM3's every fourth).
    nope_layers: tuple[int, ...] = ()
    # Why max_position_embeddings is below the checkpoint's own, where it is capped (Llama 4
    # on a GPU: its chunked attention runs within one chunk there); None: the checkpoint's.
    context_cap: str | None = None
    # Chunked attention (Llama 4's): these layers' queries see only the keys of their own
    # chunk of attention_chunk positions ([p // chunk * chunk, p]).
    attention_chunk: int | None = None
    chunked_layers: tuple[int, ...] = ()
    qk_norm: bool = False  # an RMSNorm over each query and key head (Qwen 3's, Gemma 3's)
    # One RMSNorm over all query heads at once and one over all key heads (OLMo 2/3's,
    # MiniMax-M2's q_norm [heads x head_dim]); not with qk_norm.
    qk_norm_whole: bool = False
    hidden_act: str = "silu"  # the MLP gate's activation ("gelu_pytorch_tanh" for Gemma)
    # The experts of a mixture-of-experts model; None: every MLP dense.
    moe: MoEConfig | None = None
    # Multi-head latent attention (DeepSeek-V2): then the KV pool's rows are the latent's, one
    # KV head of half the latent row per K/V plane (num_kv_heads 1, head_dim latent_width / 2:
    # executor/attention/mla.py draws it), so every rule that sizes a block by num_kv_heads x
    # head_dim x 2 holds the latent row exactly, no V beside it.
    mla: MLAConfig | None = None
    # A hybrid model's state layers (layer_types "linear_attention"): their shape. None: every
    # layer attends over the KV cache.
    state: StateConfig | None = None
    # Whether the model takes images (a vision encoder beside the decoder: its family's
    # ImageRules). Other multimodal checkpoints are refused at load, and an image sent to a
    # text-only model is refused naming it (zllm/media/images.py require_vision).
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
    # What only the family reads: a frozen record its module defines (families/gemma3.py's
    # Gemma3Fields), None for a family with none.
    family_fields: Any = None

    def __post_init__(self) -> None:
        # The family's own record crosses processes inside EngineConfig as msgspec's dict of
        # its fields (family_fields is typed Any here); its family rebuilds the record.
        if isinstance(self.family_fields, dict):
            from zllm.model.registry import family_named

            self.family_fields = family_named(self.family).fields(**self.family_fields)

    def is_state_layer(self, layer: int) -> bool:
        """Whether this layer keeps a recurrent state rather than K and V."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_state_layer(i))

    def is_mlp_only(self, layer: int) -> bool:
        """Whether this layer is an MLP (or experts) alone (layer_types "mlp" or "moe",
        Nemotron-H's): neither K and V nor a state."""
        return self.layer_types is not None and self.layer_types[layer] in ("mlp", "moe")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with K and V in the paged cache (every layer but a hybrid's state ones
        and MLP-only ones)."""
        return tuple(
            i for i in range(self.num_layers) if not (self.is_state_layer(i) or self.is_mlp_only(i))
        )

    def within_one_chunk(self) -> None:
        """Chunked attention where it does not run (a GPU's: the CUDA kernels take a window,
        not a chunk): the context capped at one chunk, within which it is plain causal
        attention (context_cap says so when a longer one is asked)."""
        if self.attention_chunk and self.max_position_embeddings > self.attention_chunk:
            self.context_cap = (
                "chunked attention runs on the CPU backends only: the CUDA kernels take a "
                "sliding window, not a chunk; within one chunk it is plain causal attention"
            )
            self.max_position_embeddings = self.attention_chunk
        self.chunked_layers = ()

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether this layer's MLP is a mixture of experts."""
        return self.moe is not None and layer not in self.moe.dense_mlp_layers
