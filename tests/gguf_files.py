"""Tiny GGUF files written as llama.cpp writes them, for the tests that load, serve or quantize
GGUF weights: a Llama whose every matrix is stored in a chosen type (quantized by gguf-py,
or random blocks with sane scales where it cannot quantize), one mixing types as a real
Q4_K_M file does, and a Llama 3.1-style file written from a transformers model; with the
byte-level tokenizer as GGUF metadata and llama.cpp's permutation of q/k rows."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from tiny_models import CHAT_TEMPLATE, build_tiny_tokenizer, tiny_hf_config, tiny_hf_model

if TYPE_CHECKING:
    import torch

# write_llama_gguf's tiny Llama: hidden 256, the K-quants' block.
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
WEIGHT_STD = 0.08


@dataclass(frozen=True)
class LlamaDims:
    """The sizes of a Llama write_llama_gguf writes (the tiny one unless a test needs weights
    large enough to measure in a process's resident memory)."""

    hidden: int = HIDDEN
    ffn: int = FFN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    layers: int = LAYERS

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = LlamaDims()

# Byte offsets of the fp16 scales in one block, for types gguf-py cannot quantize: random
# bytes elsewhere are bounded integers (quants, sub-block scales), so the values stay finite.
F16_SCALE_OFFSETS = {
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.IQ1_S: (0,),
}


def matrix_shapes(vocab: int, dims: LlamaDims = TINY) -> dict[str, tuple[int, int]]:
    """GGUF name -> (rows, columns) of every matrix of the model (untied logits)."""
    hidden, ffn, kv = dims.hidden, dims.ffn, dims.kv_heads * dims.head_dim
    per_layer = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(dims.layers):
        shapes |= {f"blk.{i}.{key}.weight": shape for key, shape in per_layer.items()}
    return shapes


def stored_matrix(shape: tuple[int, int], ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """What the file holds for a matrix of `shape` in `ggml_type`: floats or raw blocks."""
    if not gguf_dequantizes(ggml_type):  # only for load errors: its values are never read
        return random_bytes(shape, ggml_type, rng).reshape(shape[0], -1)
    if ggml_type in F16_SCALE_OFFSETS or ggml_type in (T.IQ1_M, T.NVFP4):
        return random_blocks(shape, ggml_type, rng)
    weights = (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)
    return weights if ggml_type == T.F32 else quantize(weights, ggml_type)


def random_blocks(shape: tuple[int, int], ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """Random blocks, their scales set so the values spread about WEIGHT_STD around zero
    (a model whose weights share one sign answers every prompt with the same token)."""
    if ggml_type not in F16_SCALE_OFFSETS and ggml_type not in (T.IQ1_M, T.NVFP4):
        raise ValueError(
            f"random_blocks: {ggml_type.name}'s scale offsets are not in F16_SCALE_OFFSETS "
            "(stored_matrix has gguf-py quantize random weights to that type)"
        )
    blocks = random_bytes(shape, ggml_type, rng)
    if ggml_type == T.NVFP4:  # four E4M3 scales: exponents 2-4 give 2^-6..2^-3 (times 1/2)
        blocks[:, :4] = rng.integers(2, 5, (len(blocks), 4)) << 3 | rng.integers(0, 8, (1, 4))
        return blocks.reshape(shape[0], -1)
    d = rng.uniform(0.5, 1.5, len(blocks))
    scales = [d]
    # The means and spread of random bytes' values, from a sample of the blocks: gguf-py
    # dequantizes in numpy, seconds for a real-width matrix, and a few thousand blocks of
    # random bytes give the same statistics.
    probe = slice(0, _PROBE_BLOCKS)

    def values_of(*probe_scales: np.ndarray) -> np.ndarray:
        return dequantize(set_scales(blocks[probe].copy(), ggml_type, *probe_scales), ggml_type)

    if len(F16_SCALE_OFFSETS.get(ggml_type, ())) == 2:  # d * scale * q - dmin * min: centre it
        one, zero = np.ones_like(d[probe]), np.zeros_like(d[probe])
        scaled = values_of(one, zero).mean()
        offset = -values_of(zero, one).mean()
        scales.append(d * scaled / offset)
    spread = values_of(*(s[probe] for s in scales)).std()
    set_scales(blocks, ggml_type, *(s * WEIGHT_STD / spread for s in scales))
    return blocks.reshape(shape[0], -1)


_PROBE_BLOCKS = 2048


def random_bytes(shape: tuple[int, int], ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """[blocks, bytes per block] of random bytes for a `shape` matrix."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return rng.integers(0, 256, (shape[0] * shape[1] // block_size, type_size), np.uint8)


def set_scales(blocks: np.ndarray, ggml_type: T, *scales: np.ndarray) -> np.ndarray:
    """Write each block's fp16 scales (d, then dmin where the type has one); returns blocks."""
    if ggml_type == T.IQ1_M:  # d's four nibbles top the block's last four uint16s
        bits = scales[0].astype(np.float16).view(np.uint16)
        for k, byte in enumerate((49, 51, 53, 55)):
            blocks[:, byte] = blocks[:, byte] & 0x0F | ((bits >> 4 * k) & 0xF) << 4
        return blocks
    for offset, values in zip(F16_SCALE_OFFSETS[ggml_type], scales, strict=True):
        blocks[:, offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks


def write_tokenizer(writer: GGUFWriter) -> int:
    """The tiny byte-level BPE as GGUF metadata; returns the vocabulary size."""
    model = json.loads(build_tiny_tokenizer().to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    special = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(pair) for pair in model["merges"]])
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    return len(tokens)


def write_llama_gguf(
    path: Path, type_of: Callable[[str], T], seed: int = 0, dims: LlamaDims = TINY
) -> dict:
    """A Llama GGUF (tiny unless `dims` says) whose matrix `name` is stored in
    `type_of(name)`; norms are F32. Returns GGUF name -> (type, what was written), the
    reference for dequantization."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(dims.layers)
    writer.add_context_length(256)
    writer.add_embedding_length(dims.hidden)
    writer.add_feed_forward_length(dims.ffn)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = write_tokenizer(writer)
    stored = {}
    for name, shape in matrix_shapes(vocab, dims).items():
        ggml_type = type_of(name)
        data = stored_matrix(shape, ggml_type, rng)
        raw_dtype = None if data.dtype in (np.float32, np.float16) else ggml_type
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        stored[name] = (ggml_type, data)
    norms = ["output_norm.weight"]
    norms += [f"blk.{i}.{n}.weight" for i in range(dims.layers) for n in ("attn_norm", "ffn_norm")]
    for name in norms:
        writer.add_tensor(name, rng.uniform(0.8, 1.2, dims.hidden).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def gguf_dequantizes(ggml_type: T) -> bool:
    """Whether gguf-py reads `ggml_type` back (else a file of it only tests load errors)."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, 256 // block_size * type_size), np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows, written from its description."""
    head_dim = weight.shape[0] // n_heads
    return (
        weight.reshape(n_heads, 2, head_dim // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# Like llama.cpp's Q4_K_M and Q3_K_M files and the Gemma 3 270M file (Q4_K and Q6_K beside
# Q5_0 and Q8_0, q/k and v of different types), with F32 matrices, which no GGUF kernel reads
# (both model codes keep fp32 matmuls for them).
MIXED_TYPES = {
    "blk.0.attn_q": T.Q8_0,
    "blk.0.attn_k": T.Q8_0,
    "blk.0.attn_v": T.Q8_0,
    "blk.0.attn_output": T.F32,
    "blk.0.ffn_gate": T.Q4_1,
    "blk.0.ffn_up": T.Q4_1,
    "blk.0.ffn_down": T.F32,
    "blk.1.attn_q": T.Q5_0,
    "blk.1.attn_k": T.Q5_0,
    "blk.1.attn_v": T.Q8_0,
    "blk.1.attn_output": T.Q3_K,
    "blk.1.ffn_gate": T.Q4_K,
    "blk.1.ffn_up": T.Q5_K,
    "blk.1.ffn_down": T.Q6_K,
    "token_embd": T.IQ4_XS,
    "output": T.F32,
}


# ---------------------------------------------------------------------------------------------
# The Llama 3.1-style GGUF

# Llama 3.1's rope_scaling, at the tiny model's scale: 7 of head_dim 16's 8 frequencies change.
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for Llama 3.1's rope_scaling:
    the divisor of each frequency, 1 for short wavelengths, `factor` for long ones, and
    between them the inverse of the smooth blend."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * math.pi / inv_freq
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (original / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelength > original / low, factor, blended)
    return np.where(wavelength < original / high, 1.0, factors).astype(np.float32)


# HF module path -> llama.cpp tensor key, per layer.
GGUF_LAYER_KEYS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_llama3_gguf(path: Path) -> torch.nn.Module:
    """A tiny HF Llama with Llama 3.1 rope scaling, written as llama.cpp writes one (F32,
    q/k rows permuted, the scaling as rope_freqs.weight); returns the HF model, the
    reference."""
    writer = GGUFWriter(str(path), "llama")
    vocab = write_tokenizer(writer)
    writer.add_chat_template(CHAT_TEMPLATE)
    config = tiny_hf_config("llama", vocab_size=vocab, rope_parameters=dict(LLAMA3_ROPE))
    hf = tiny_hf_model(config).eval()
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    theta = config.rope_parameters["rope_theta"]
    writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, theta, LLAMA3_ROPE))
    for name, tensor in hf.state_dict().items():
        gguf_name, heads = gguf_name_of(name, config)
        if gguf_name is None:
            continue
        data = tensor.numpy().astype(np.float32)
        writer.add_tensor(gguf_name, llama_cpp_permute(data, heads) if heads else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def gguf_name_of(hf_name: str, config) -> tuple[str | None, int]:
    """(llama.cpp's name, heads whose q/k rows it permutes, else 0); None: not written."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight", 0
    if hf_name == "model.norm.weight":
        return "output_norm.weight", 0
    if not hf_name.startswith("model.layers."):
        return None, 0  # lm_head: tied to the embedding
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    heads = {
        "self_attn.q_proj": config.num_attention_heads,
        "self_attn.k_proj": config.num_key_value_heads,
    }.get(module, 0)
    return f"blk.{layer}.{GGUF_LAYER_KEYS[module]}.{kind}", heads
