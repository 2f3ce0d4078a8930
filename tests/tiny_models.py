"""Tiny random models for tests: one Hugging Face config factory, the model and the
ModelArchConfig made from it, and a whole model directory (weights, byte-level BPE
tokenizer, chat template) in Hugging Face layout, which is what `zllm serve` runs in tests.

Every test builds its tiny model from `tiny_hf_config`, passing only what it needs to differ.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import transformers

    from zllm.model.arch_config import ModelArchConfig

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The served tiny model: head_dim 16, grouped-query attention (2 KV heads for 4 query heads).
TINY_CONFIG: dict = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    # A wide init keeps logits far from ties, so greedy parity is exact, not luck.
    initializer_range=0.2,
)

# What an architecture needs beyond TINY_CONFIG: Qwen3's config defaults head_dim to 128, and
# Phi-3's puts its pad and EOS ids at 32000, outside the tiny vocabulary.
_ARCH_DEFAULTS: dict[str, dict] = {
    "qwen3": dict(head_dim=16),
    "phi3": dict(pad_token_id=None, eos_token_id=None),
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching lets requests join and leave every step.",
    "1234567890 + 42 = 1234567932",
    "Emoji 🙂 and CJK 你好世界 and accents: café, naïve, Ångström.",
]


def tiny_hf_config(arch: str = "llama", **overrides) -> transformers.PretrainedConfig:
    """A transformers config of `arch` ("llama", "mistral", "qwen2", "qwen3" or "phi3"):
    TINY_CONFIG with `overrides` (any config field, e.g. rope_parameters, head_dim, eos_token_id)."""
    import transformers

    fields = {**TINY_CONFIG, **_ARCH_DEFAULTS.get(arch, {}), **overrides}
    return transformers.AutoConfig.for_model(arch, **fields)


def tiny_hf_model(
    config: transformers.PretrainedConfig, seed: int = 0, dtype: torch.dtype | None = None
) -> transformers.PreTrainedModel:
    """The transformers causal LM of `config`, with weights drawn from `seed`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model if dtype is None else model.to(dtype)


def arch_config_of(config: transformers.PretrainedConfig) -> ModelArchConfig:
    """What zllm makes of `config`: saved as config.json and read back by read_arch_config,
    the mapping `zllm serve` uses, rather than a second copy of it here."""
    from zllm.model.arch import read_arch_config

    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        return read_arch_config(directory)


def build_tiny_tokenizer(
    vocab_size: int = 512, extra_tokens: Sequence[str] = (), extra_special: Sequence[str] = ()
):
    """A byte-level BPE trained on a few sentences: fast, and covers every byte.
    `extra_tokens` (e.g. "<tool_call>", "</think>") become single added tokens that decoding
    keeps, as Qwen's are; `extra_special` (e.g. Mistral's "[TOOL_CALLS]") ones that decoding
    drops unless asked to keep special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    if extra_tokens:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    if extra_special:
        from tokenizers import AddedToken

        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in extra_special]
        )
    return tok


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    chat_template: str = CHAT_TEMPLATE,
    extra_tokens: Sequence[str] = (),
    extra_special: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    weights: bool = True,
    **overrides,
) -> Path:
    """Save a tiny random model + tokenizer in Hugging Face layout under `path`; `overrides`
    go to tiny_hf_config (the vocabulary and EOS come from the tokenizer). `dtype`: the
    weights' stored dtype (default fp32). `weights=False` saves the config and tokenizer
    only, for `--load-format dummy` at shapes too large to write (the GPU's 8B)."""
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(extra_tokens=extra_tokens, extra_special=extra_special)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": chat_template,
                "model_max_length": 512,
            }
        )
    )
    from_tokenizer = dict(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )
    config = tiny_hf_config(arch, **{**from_tokenizer, **overrides})
    if not weights:
        config.save_pretrained(path)
        return path
    tiny_hf_model(config, seed, dtype).save_pretrained(path, safe_serialization=True)
    return path


def write_lora_adapter(
    path: Path,
    model_dir: str | Path,
    rank: int = 4,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 0,
) -> Path:
    """A random LoRA adapter in PEFT's format (adapter_config.json + safetensors) for the
    model saved in `model_dir`, written directly (no PEFT needed): every named projection of
    every layer gets A [rank, in] and a non-zero B [out, rank]."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": ("self_attn", hidden, q),
        "k_proj": ("self_attn", hidden, kv),
        "v_proj": ("self_attn", hidden, kv),
        "o_proj": ("self_attn", q, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            block, n_in, n_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    lora_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    (path / "adapter_config.json").write_text(
        json.dumps({**lora_config, "target_modules": list(targets), "bias": "none"})
    )
    return path


def tiny_gemma3_overrides(window: int) -> dict:
    """write_tiny_model overrides for a tiny Gemma 3: sliding, global, sliding layers."""
    return dict(
        arch="gemma3_text",
        num_hidden_layers=3,
        head_dim=16,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=window,
    )


def randomize_norms_and_biases(path: Path, seed: int = 0) -> Path:
    """Redraw a saved model's norm weights and biases, which transformers initializes to one
    (Gemma's to zero: it adds one) and zero, leaving those paths untested. Gemma's embedding
    is scaled down too, since Gemma multiplies it by sqrt(hidden): greedy outputs then vary
    instead of repeating one token."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    gemma = model.config.model_type.startswith("gemma")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                drawn = torch.randn(param.shape, generator=gen) * 0.5
                param.copy_(drawn if gemma else drawn + 1.0)
            elif name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        if gemma:
            model.model.embed_tokens.weight.mul_(0.125)
    model.save_pretrained(path)
    return path


def draw_sinks_and_expert_biases(path: Path, seed: int = 0) -> Path:
    """A saved gpt-oss model's sinks, router and expert biases drawn (transformers initialises
    the biases to zero), then norms and the other biases (randomize_norms_and_biases)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_bias", "sinks")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    model.save_pretrained(path)
    return randomize_norms_and_biases(path, seed)
