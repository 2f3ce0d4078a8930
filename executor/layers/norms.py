"""RMS norms as Hugging Face computes them: Llama's (weight, with the residual add of the
pre-norm stream), Gemma's ((1 + weight), in fp32), and Qwen 3's per-head query and key norms.

Each has `multiplier()`, what the normed rows are multiplied by: what a whole-stack runner
(the fused CPU decode step, executor/graphs/fused_decode.py) hands the kernel. On CPU both
norms run csrc/cpu/row_ops.h (the fused step's own row op), RMSNorm on a GPU csrc/layer_ops.cu.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.kernels import cpu_layer_ops, cuda_layer_ops
from zllm.model.arch_config import ModelArchConfig


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, accumulated in fp32 as Hugging Face does.

    With `residual`, first adds it to x and returns (normed, x): the pre-norm residual stream.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def multiplier(self) -> torch.Tensor:
        """The weight in fp32: what the normed rows are multiplied by."""
        return self.weight.float()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cuda_layer_ops.usable(x):
            fused = cuda_layer_ops.rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        elif cpu_layer_ops.usable(x):  # csrc/cpu/row_ops.h, as the fused decode step
            fused = cpu_layer_ops.rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32:
            # One fused op instead of six; bit-identical to the lines below in fp32 on CPU
            # (checked in tests/test_model.py), ~15 us less per call at one token.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype), x


class QKNorm(nn.Module):
    """Qwen 3: an RMSNorm over each query head and each key head before RoPE, one weight
    [head_dim] shared by the query heads and one by the key heads (HF's q_norm, k_norm)."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        """qk [T, heads + kv_heads, head_dim] -> the same with every head normalized."""
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return torch.cat((self.q_norm(q)[0], self.k_norm(k)[0]), dim=1)


class WholeQKNorm(nn.Module):
    """OLMo 2/3: one RMSNorm over all query heads at once and one over all key heads (HF's
    q_norm [heads x head_dim], k_norm [kv_heads x head_dim]), before RoPE."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.q_norm = RMSNorm(arch.num_heads * arch.head_dim, arch.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(arch.num_kv_heads * arch.head_dim, arch.rms_norm_eps, dtype)

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        """qk [T, heads + kv_heads, head_dim] -> the same, q and k each normed whole."""
        tokens, _, head_dim = qk.shape
        q = qk[:, : self.num_heads].reshape(tokens, -1)
        k = qk[:, self.num_heads :].reshape(tokens, -1)
        q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        return torch.cat((q, k), dim=1).view(tokens, -1, head_dim)


class HeadL2Norm(nn.Module):
    """Llama 4: each query and key head divided by its root mean square, no weight (HF's
    L2Norm over head_dim)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        """qk [T, heads + kv_heads, head_dim] -> the same, every head normed."""
        return F.rms_norm(qk.float(), (qk.shape[-1],), None, self.eps).to(qk.dtype)


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in fp32, cast back: Gemma's norm."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.eps = eps

    def multiplier(self) -> torch.Tensor:
        """1 + weight in fp32: what the normed rows are multiplied by."""
        return 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_layer_ops.usable(x):  # csrc/cpu/row_ops.h, as the fused decode step
            fused = cpu_layer_ops.rms_norm(x, None, self.multiplier(), self.eps)
            if fused is not None:
                return fused[0]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.multiplier()).to(x.dtype)
