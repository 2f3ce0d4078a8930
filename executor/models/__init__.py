"""Model classes by architecture name (ModelArchConfig.architecture)."""

from __future__ import annotations

from torch import nn

from zllm.executor.models.deepseek_v2 import DeepseekV2ForCausalLM
from zllm.executor.models.gemma3 import Gemma3ForCausalLM
from zllm.executor.models.gpt_oss import GptOssForCausalLM
from zllm.executor.models.llama import LlamaForCausalLM

# Mistral is Llama's layout; Qwen2 adds q/k/v biases (ModelArchConfig.attention_bias), Qwen3
# q/k norms (qk_norm), Phi-3 fused checkpoint tensors and LongRoPE (executor/models/llama.py).
_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "deepseek2": DeepseekV2ForCausalLM,  # llama.cpp's name for DeepSeek-V2 GGUF files
    "deepseek_v2": DeepseekV2ForCausalLM,  # multi-head latent attention (deepseek_v2.py)
    "gemma3": Gemma3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,  # sinks, alternating windows, experts (gpt_oss.py)
    "gpt-oss": GptOssForCausalLM,  # llama.cpp's name for its GGUF files
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    # Mixture-of-experts MLPs (executor/layers/moe/) in Llama's decoder; GGUF files name
    # Qwen's without the underscore, and Mixtral's are "llama" files with experts.
    "mixtral": LlamaForCausalLM,
    "qwen2_moe": LlamaForCausalLM,
    "qwen2moe": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "qwen3moe": LlamaForCausalLM,
}


def get_model_class(arch_name: str) -> type[nn.Module]:
    try:
        return _MODEL_CLASSES[arch_name]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {arch_name!r}; supported: {', '.join(sorted(_MODEL_CLASSES))}"
        ) from None


__all__ = [
    "DeepseekV2ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "LlamaForCausalLM",
    "get_model_class",
]
