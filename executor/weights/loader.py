"""Model weights as float32 CPU tensors under Hugging Face parameter names.

Whatever the file format, the model code sees one naming scheme (HF's) and one layout (HF's),
so a GGUF file and a safetensors directory of the same model load into identical tensors.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Container, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import safe_open
from torch import nn

from zllm.model.arch_config import ModelArchConfig
from zllm.model.gguf import GGUFFile, read_gguf
from zllm.model.progress import Progress

logger = logging.getLogger(__name__)

# llama.cpp's per-layer tensor names (blk.{i}.<key>.weight|bias) -> HF module paths.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # Mixture of experts (Qwen-MoE, Mixtral): the router, each projection of every expert
    # stacked in one 3-D tensor [E, out, in] (executor/layers/moe/ cuts it per expert),
    # Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 3 has four norms per layer and per-head q/k norms; its ffn_norm is the norm before
# the MLP (llama's ffn_norm is that same position, named after the attention there).
_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen 3's per-head q/k norms.
_QWEN3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Phi-3's fused matrices, as its checkpoints store them: attn_qkv holds [q | k | v] and
# ffn_up holds [gate | up] (no ffn_gate), HF's qkv_proj and gate_up_proj row for row.
_PHI3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
# DeepSeek-V2's multi-head latent attention (llama.cpp's deepseek2). Newer converters split
# kv_b_proj into attn_k_b (W_UK transposed, [heads, kv_lora_rank, nope]) and attn_v_b (W_UV,
# [heads, v, kv_lora_rank]); _join_kv_b puts them back together as kv_b_proj.
_DEEPSEEK2_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    # Its shared experts: one ungated MLP, under DeepSeek's plural name.
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# gpt-oss: its sink logits, and the norm before its experts under the name Gemma's files use
# after the attention (HF's post_attention_layernorm, as Llama's ffn_norm).
_GPT_OSS_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_sinks": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm",
}
_LAYER_NAMES_BY_ARCH = {
    "deepseek2": _DEEPSEEK2_LAYER_NAMES,
    "gemma3": _GEMMA3_LAYER_NAMES,
    "gpt-oss": _GPT_OSS_LAYER_NAMES,
    "qwen3": _QWEN3_LAYER_NAMES,
    "qwen3moe": _QWEN3_LAYER_NAMES,
    "phi3": _PHI3_LAYER_NAMES,
}
# Architectures whose checkpoints store qkv_proj and gate_up_proj fused, in our [q | k | v] and
# [gate | up] order: their tensors fill the fused matrices whole (a model's targets, and the
# GGUF blocks that serve them: executor/weights/blocks.py).
FUSED_CHECKPOINTS = frozenset({"phi3"})
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that are no weight of the model: model_files reads them into ModelArchConfig.
_GGUF_NON_WEIGHTS = frozenset(
    {
        "rope_freqs.weight",  # ModelArchConfig.rope_freq_factors
        "rope_factors_long.weight",  # Phi-3's LongRoPE: ModelArchConfig.rope_scaling
        "rope_factors_short.weight",
    }
)


def load_weights(
    model_path: str,
    arch: ModelArchConfig,
    layers: Container[int] | None = None,
    skip: Container[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) one at a time, so peak memory is one tensor beyond the model.

    `layers`: only these decoder layers' tensors are read (a pipeline stage's; the others are
    neither read nor dequantized), with every tensor outside the layers; None: all. `skip`:
    tensors neither widened nor yielded (the CPU kernel reads their blocks or 16-bit rows)."""
    if os.path.isdir(model_path):
        yield from _load_safetensors(Path(model_path), arch, layers, skip)
        return
    gguf = read_gguf(model_path)
    # Bytes rather than tensors: dequantizing dominates, and the embedding alone can be a third.
    total = sum(info.nbytes for info in gguf.tensors.values())
    description = f"Loading {Path(model_path).name}"
    with Progress(description, total=total, unit="B", logger=logger) as progress:
        weights = _load_gguf(gguf, arch, progress, layers, skip)
        yield from _join_kv_b(weights) if arch.architecture == "deepseek2" else weights


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """--load-format dummy: random weights of the model's shapes, no file read. Matrices
    uniform in +-1/sqrt(fan-in) (a layer keeps its input's scale), norm weights 1, biases 0;
    seeded, so every load (a wake-up, another rank) draws the same values."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            bound = param.shape[-1] ** -0.5
            values = torch.rand(param.shape, generator=generator) * (2 * bound) - bound
            param.copy_(values)
        else:
            param.fill_(1.0 if "norm" in name else 0.0)


def layer_of(name: str) -> int | None:
    """The decoder layer a Hugging Face weight name belongs to (None: not a layer's)."""
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".", 3)[2])


# A vision-language checkpoint's language model under its text model's names (transformers 4
# and the Hub's Gemma 3 checkpoints: language_model.model.*; transformers 5:
# model.language_model.*; the Hub's Qwen2.5-VL checkpoints: the text model's own model.*);
# its vision encoder's tensors are executor/models/vision/'s.
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
    "model.multi_modal_projector.", "visual.", "model.visual.",
)  # fmt: skip


# A base model's checkpoint (an embedding model's decoder, saved without its causal-LM
# wrapper) names its tensors without the `model.` prefix.
_BASE_MODEL_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def language_model_name(name: str, arch: ModelArchConfig) -> str | None:
    """The text model's name of a checkpoint tensor (None: a vision encoder's, not read
    here); a text-only model's names are their own, a base model's under `model.`."""
    if not arch.lm_head and name.startswith(_BASE_MODEL_PREFIXES):
        return "model." + name
    if not arch.vision:
        return name
    if name.startswith(_VISION_PREFIXES):
        return None
    for old, new in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name if name.startswith("model.") or name == "lm_head.weight" else None


def _wanted(hf_name: str, layers: Container[int] | None) -> bool:
    layer = layer_of(hf_name)
    return layers is None or layer is None or layer in layers


def hf_name_from_gguf(name: str, architecture: str = "llama") -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    layer_names = _LAYER_NAMES_BY_ARCH.get(architecture, _GGUF_LAYER_NAMES)
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def _load_gguf(
    gguf: GGUFFile,
    arch: ModelArchConfig,
    progress: Progress,
    layers: Container[int] | None,
    skip: Container[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, info in gguf.tensors.items():
        progress.advance(info.nbytes)
        if name in _GGUF_NON_WEIGHTS:
            continue
        hf_name = hf_name_from_gguf(name, arch.architecture)
        if hf_name is None:
            raise ValueError(f"{gguf.path}: unexpected tensor {name!r} for a {arch.architecture}")
        if (
            (hf_name == "lm_head.weight" and arch.tie_word_embeddings)
            or not _wanted(hf_name, layers)
            or hf_name in skip
        ):
            continue
        try:
            weight = dequantize(gguf.tensor_data(name), info.ggml_type).reshape(info.shape)
        except NotImplementedError:
            raise ValueError(
                f"{gguf.path}: tensor {name!r} uses {info.ggml_type.name}, which gguf cannot "
                f"dequantize"
            ) from None
        # llama.cpp's converter permutes q/k rows for the "llama" architecture only (Mistral
        # checkpoints included); qwen2, qwen3 and phi3 files keep HF's order.
        if arch.architecture == "llama" and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            weight = unpermute_rope_rows(weight, arch.head_dim)
        if arch.architecture == "gemma3" and hf_name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norm weights as 1 + w (its norm multiplies
            # by the weight); ours, like transformers', multiplies by 1 + w.
            weight = weight - 1.0
        if not weight.flags.writeable:  # F32 tensors come back as views of the mmap
            weight = weight.copy()
        yield hf_name, torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))


def gguf_raw_weights(
    model_path: str, arch: ModelArchConfig, layers: Container[int] | None = None
) -> dict[str, tuple[int, torch.Tensor]]:
    """HF name -> (ggml type id, the tensor's raw rows as uint8 [rows, bytes per row]).

    Only matrices, and of the decoder layers only `layers` (as in load_weights); a stack of
    experts' matrices [E, out, in] comes as its E x out rows (expert_blocks.py). q/k rows are
    put in HF's order as load_weights does: a row permutation moves whole rows, and GGUF
    blocks run along a row, so it applies to the bytes unchanged.
    """
    gguf = read_gguf(model_path)
    raw: dict[str, tuple[int, torch.Tensor]] = {}
    for name, info in gguf.tensors.items():
        hf_name = hf_name_from_gguf(name, arch.architecture)
        matrix = len(info.shape) == 2 or (len(info.shape) == 3 and ".experts." in (hf_name or ""))
        if hf_name is None or not matrix or not _wanted(hf_name, layers):
            continue
        rows = gguf.tensor_data(name).reshape(-1, info.nbytes // math.prod(info.shape[:-1]))
        if arch.architecture == "llama" and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            rows = unpermute_rope_rows(rows, arch.head_dim)
        raw[hf_name] = (int(info.ggml_type), torch.from_numpy(np.array(rows, dtype=np.uint8)))
    return raw


def _join_kv_b(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek-V2's split attn_k_b / attn_v_b back into Hugging Face's kv_b_proj [heads x
    (nope + v), kv_lora_rank] (per head: W_UK's rows, then W_UV's); every other tensor as is."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".self_attn.")
        if kind not in ("k_b_proj.weight", "v_b_proj.weight"):
            yield name, tensor
            continue
        pair = halves.setdefault(prefix, {})
        pair[kind] = tensor
        if len(pair) == 2:
            w_uk = pair["k_b_proj.weight"].transpose(1, 2)  # [heads, nope, kv_lora_rank]
            joined = torch.cat((w_uk, pair["v_b_proj.weight"]), dim=1)
            yield f"{prefix}.self_attn.kv_b_proj.weight", joined.reshape(-1, joined.shape[-1])
            del halves[prefix]
    if halves:
        raise ValueError(f"attn_k_b without attn_v_b (or the reverse) in {sorted(halves)}")


def unpermute_rope_rows(weight: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order, which pairs up the two halves HF's rotary rotates.

    HF's rotate_half rotates row i of a head with row i + head_dim/2; llama.cpp's rope rotates
    adjacent rows, so its converter interleaves the halves. Per head, with h = head_dim / 2:

        HF:    x0 x1 ... x(h-1) | y0 y1 ... y(h-1)
        GGUF:  x0 y0 x1 y1 ... x(h-1) y(h-1)

    Works for biases too (no trailing dimensions).
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    half = head_dim // 2
    by_pair = weight.reshape(rows // head_dim, half, 2, *rest)
    return by_pair.swapaxes(1, 2).reshape(weight.shape)


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{directory} has no *.safetensors files (pytorch_model.bin is not read; "
            f"--load-format dummy runs random weights without any)"
        )
    return files


def safetensors_dtypes(directory: str) -> dict[str, str]:
    """Each tensor's stored dtype ("BF16", "F16", "F32", ...), from the files' headers."""
    dtypes = {}
    for file in safetensors_files(Path(directory)):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                dtypes[name] = shard.get_slice(name).get_dtype()
    return dtypes


# ggml type ids of the 16-bit dtypes, as the CPU kernel reads them.
_SIXTEEN_BIT_TYPES = {torch.float16: 1, torch.bfloat16: 30}


def sixteen_bit_raw_weights(
    directory: str, arch: ModelArchConfig, layers: Container[int] | None = None
) -> dict[str, tuple[int, torch.Tensor]]:
    """HF name -> (ggml type id, the matrix's 16-bit rows as uint8 [rows, 2 x columns]) for
    every bf16/fp16 matrix of a checkpoint (of the decoder layers only `layers`), as
    gguf_raw_weights gives a GGUF file's blocks."""
    raw = {}
    for file in safetensors_files(Path(directory)):
        with safe_open(str(file), framework="pt") as shard:
            for stored in shard.keys():
                name = language_model_name(stored, arch)
                if name is None or not _wanted(name, layers):
                    continue
                if len(shard.get_slice(stored).get_shape()) != 2:
                    continue
                if name == "lm_head.weight" and arch.tie_word_embeddings:
                    continue
                tensor = shard.get_tensor(stored)
                if tensor.dtype in _SIXTEEN_BIT_TYPES:
                    # A copy: get_tensor's tensor maps the file, whose pages would then stay
                    # resident beside the model's (RSS + ~0.45 GiB on Llama-1B bf16).
                    rows = tensor.view(torch.uint8).clone()
                    raw[name] = (_SIXTEEN_BIT_TYPES[tensor.dtype], rows)
    return raw


def _load_safetensors(
    directory: Path, arch: ModelArchConfig, layers: Container[int] | None, skip: Container[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(directory)
    total = sum(_num_tensors(file) for file in files)
    description = f"Loading {directory.name}"
    with Progress(description, total=total, unit="tensors", logger=logger) as progress:
        for file in files:
            with safe_open(str(file), framework="pt") as shard:
                for stored in shard.keys():
                    progress.advance(1)
                    name = language_model_name(stored, arch)
                    if name is None or name.endswith("rotary_emb.inv_freq"):
                        continue  # a vision encoder's; a buffer old checkpoints saved
                    if name == "lm_head.weight" and arch.tie_word_embeddings:
                        continue
                    if not _wanted(name, layers) or name in skip:
                        continue  # another pipeline stage's, or read as 16-bit rows (not read)
                    tensor = shard.get_tensor(stored)
                    # uint8 tensors are packed blocks (gpt-oss's MXFP4 experts): the model
                    # reads them as they are.
                    yield name, tensor if tensor.dtype == torch.uint8 else tensor.float()


def _num_tensors(file: Path) -> int:
    with safe_open(str(file), framework="pt") as shard:
        return len(shard.keys())
