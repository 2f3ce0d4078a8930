"""Rotary position embeddings (RoPE) as Hugging Face computes them, with the rope_scaling
types the supported checkpoints use (linear, llama3, yarn, longrope), a Llama 3.x GGUF's
per-frequency divisors, and partial rotation (Phi-4-mini).

    rope_inv_freq(arch)     a checkpoint's frequencies and cos/sin scale
    RotaryEmbedding         their cos | sin table per position, in the model's dtype
    apply_rope / rope       rotate q and k (rope: through a device's fused op where it applies)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from zllm.executor.kernels import cpu_layer_ops, cuda_layer_ops
from zllm.model.arch_config import ModelArchConfig


def rotary_dim(arch: ModelArchConfig) -> int:
    """How many leading dimensions of each head RoPE rotates: all of them unless the rope
    parameters carry a partial_rotary_factor below 1 (Phi-4-mini rotates 3/4)."""
    factor = (arch.rope_scaling or {}).get("partial_rotary_factor", 1.0)
    return int(arch.head_dim * factor)


def rope_inv_freq(arch: ModelArchConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] and the cos/sin scale for arch's rope_scaling.

    A Llama 3.x GGUF stores its scaling as per-frequency divisors instead (rope_freqs.weight,
    arch.rope_freq_factors); llama.cpp divides each frequency by its factor, and so do we.
    """
    inv_freq, scale = _scaled_inv_freq(arch)
    if arch.rope_freq_factors is not None:
        factors = torch.tensor(arch.rope_freq_factors, dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"{len(arch.rope_freq_factors)} rope frequency factors for "
                f"{inv_freq.numel()} rotary frequencies"
            )
        inv_freq = inv_freq / factors
    return inv_freq, scale


def _scaled_inv_freq(arch: ModelArchConfig) -> tuple[torch.Tensor, float]:
    dim, base = rotary_dim(arch), arch.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling: dict[str, Any] = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, scaling, arch.max_position_embeddings)
    if rope_type == "longrope":
        return _longrope_inv_freq(dim, base, scaling, arch.max_position_embeddings)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported "
        f"(supported: default, linear, llama3, yarn, longrope)"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by factor, blend the band between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_band = (wavelen >= old_context / high_freq_factor) & (
        wavelen <= old_context / low_freq_factor
    )
    return torch.where(is_band, blended, scaled)


def _yarn_inv_freq(
    dim: int, base: float, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    factor = scaling["factor"]
    old_context = scaling.get("original_max_position_embeddings") or max_positions

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = (
        correction_dim(scaling.get("beta_fast") or 32),
        correction_dim(scaling.get("beta_slow") or 1),
    )
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(
    dim: int, base: float, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its factor, from `long_factor` beyond the
    original context and `short_factor` within it; cos/sin scaled by the attention factor.

    transformers picks the set per forward pass from the sequence's current length (its
    generate even recomputes the cache when a sequence crosses the original context). A paged
    cache cannot re-rotate the keys it holds, so, like vLLM, we pick once, for the longest
    context the model serves: the long factors when max_position_embeddings exceeds
    original_max_position_embeddings (Phi-3-*-128k), else the short ones (Phi-3-*-4k). Outputs
    equal transformers' for sequences past the original context, or for every sequence when
    the two lengths are equal; a short prompt to a long-context model sees the long factors.
    """
    original = scaling.get("original_max_position_embeddings") or max_positions
    factors = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    if len(factors) != dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors for {dim // 2} rotary frequencies")
    # The attention factor grows with the context extension (max_position / original).
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Hugging Face-style RoPE (rotate_half over two halves, not interleaved pairs).

    cos and sin for every position up to max_position_embeddings are precomputed in fp32, then
    stored in the model dtype side by side as one [max_positions, rotary_dim] table
    (cos of the rotary_dim/2 frequencies | sin of them), so a step does one index_select.
    """

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(arch)
        freqs = torch.outer(
            torch.arange(arch.max_position_embeddings, dtype=torch.float32), inv_freq
        )
        table = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        # M-RoPE (Qwen2.5-VL): which of a token's (time, row, column) positions turns each
        # column of the table (a frequency's cos and its sin alike); None: one position.
        self.mrope_rows: torch.Tensor | None = None
        if arch.mrope_section is not None:
            section = torch.repeat_interleave(
                torch.arange(3), torch.tensor(arch.mrope_section, dtype=torch.int64)
            )
            self.mrope_rows = section.repeat(2).view(1, 1, -1)

    def keep_positions(self, count: int) -> None:
        """Drop the table past `count` positions (the engine's max_model_len, which no position
        reaches): Gemma 3's two 32K-position tables are 32 MB each."""
        if count < self.cos_sin_cache.shape[0]:
            self.cos_sin_cache = self.cos_sin_cache[:count].clone()

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [T, 1, rotary_dim / 2], broadcasting over heads.
        `positions`: int64 [T], or [3, T] (time, row, column) for an M-RoPE model's step
        with image tokens, whose frequencies each take their section's position."""
        if positions.dim() == 2:
            assert self.mrope_rows is not None, "three positions per token need M-RoPE"
            rows = self.cos_sin_cache[positions]  # [3, T, rotary_dim]
            index = self.mrope_rows.to(rows.device).expand(1, *rows.shape[1:])
            table = rows.gather(0, index).squeeze(0)
        else:
            table = self.cos_sin_cache.index_select(0, positions)
        cos, sin = table.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] -> rotated copy; same arithmetic as HF's x*cos + rotate_half(x)*sin.

    Rotates the first 2 * cos.shape[-1] dimensions of each head; any beyond (a partial
    rotary factor) pass through unchanged, as in transformers.
    """
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_into_cache(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: object,
) -> bool:
    """RoPE on q and k (in place) and the step's k and v into the KV cache, in one kernel
    where the device has one (CUDA); False when nothing was done: rotate with `rope`, and
    the attention layer writes the cache."""
    if not cuda_layer_ops.usable(qk):
        return False
    slots = getattr(meta, "slot_mapping", None)
    return slots is not None and cuda_layer_ops.rope_cache_(qk, v, cos, sin, kv_cache, slots)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope through a device's fused op where one takes the layout (in place on qk,
    a view into the qkv projection's output), else torch's."""
    rotated = None
    if cuda_layer_ops.usable(qk):
        rotated = cuda_layer_ops.rope_(qk, cos, sin)
    elif cpu_layer_ops.usable(qk):
        rotated = cpu_layer_ops.rope_(qk, cos, sin)
    return apply_rope(qk, cos, sin) if rotated is None else rotated
