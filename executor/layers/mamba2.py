"""A Mamba-2 layer (Granite 4.0-H's and Nemotron-H's state layers): instead of attending over a
KV cache it keeps per sequence a conv window and a recurrent state in its slot of the state
pool (executor/kv/state_pool.py):

    proj = in_proj(x)                     [T, z | x B C | dt]: one GEMM
    x|B|C = silu(causal_conv1d(x|B|C) + conv bias)   the window carries the last kernel - 1
    dt = softplus(dt + dt_bias)                       inputs
    y = scan(x, B, C, dt, A, D)           one token at a time for decodes (batched), a chunk
                                          at a time for prompts (per sequence)
    out = out_proj(group_rms_norm(y * silu(z)) * w)

The arithmetic is executor/layers/mamba2_scan.py's, in fp32; the decode rows' step runs
csrc/cpu/state_layers.cpp's kernels on CPU and csrc/state_layers.cu's on a GPU
(executor/kernels/state_ops.py), which update each slot's window and state in place.
StateConfig's names: heads num_heads of head_dim value_head_dim, B and C in num_key_heads
groups of key_head_dim (the state size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.kernels import state_ops
from zllm.executor.kv.state_pool import LayerState
from zllm.executor.kv.state_step import StateStep, pieces, save_at_ends, start_fresh
from zllm.executor.layers.causal_conv import step_conv
from zllm.executor.layers.linear.dense import empty_linear
from zllm.executor.layers.mamba2_scan import chunked_scan, gated_group_norm, scan_step
from zllm.model.arch_config import ModelArchConfig


def as_held(name: str, tensor: torch.Tensor, mixer: str) -> tuple[str, torch.Tensor]:
    """A checkpoint's or GGUF file's tensor of a Mamba-2 layer (named under `.{mixer}.`:
    Granite's "mamba", Nemotron-H's "mixer") as the layer holds it: A_log as the decay
    A = -exp(A_log), as transformers computes it and llama.cpp's ssm_a stores it; llama.cpp's
    shapes undone (conv1d's channel dim squeezed, A and D [heads, 1], the norm [groups, group
    width]) and its ssm_dt.bias named dt_bias. Any other tensor as it is."""
    if name.endswith(f"{mixer}.A_log"):
        return name.removesuffix("_log"), -tensor.float().exp().to(tensor.dtype)
    if name.endswith(f"{mixer}.conv1d.weight") and tensor.dim() == 2:
        return name, tensor.unsqueeze(1)
    if name.endswith((f"{mixer}.A", f"{mixer}.D", f"{mixer}.norm.weight")):
        return name, tensor.reshape(-1)
    if name.endswith(f"{mixer}.dt.bias"):
        return name.removesuffix(".dt.bias") + ".dt_bias", tensor
    return name, tensor


class Mamba2Mixer(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        s = arch.state
        assert s is not None and s.kind == "mamba2"
        self.state = s
        self.eps = s.norm_eps if s.norm_eps is not None else arch.rms_norm_eps
        self.sections = [s.value_dim, s.conv_dim, s.num_heads]  # z | x B C | dt
        self.in_proj = empty_linear(arch.hidden_size, sum(self.sections), dtype, bias=s.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_kernel, dtype=dtype))
        self.conv_bias = nn.Parameter(torch.empty(s.conv_dim, dtype=dtype)) if s.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(s.num_heads, dtype=dtype))
        # -exp(A_log), as llama.cpp's files store it (a checkpoint's A_log turned at load).
        self.A = nn.Parameter(torch.empty(s.num_heads, dtype=dtype))
        self.D = nn.Parameter(torch.empty(s.num_heads, dtype=dtype))
        self.norm_weight = nn.Parameter(torch.empty(s.value_dim, dtype=dtype))
        self.out_proj = empty_linear(s.value_dim, arch.hidden_size, dtype, bias=s.proj_bias)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """transformers' names under `prefix` (…mamba. or …mixer.) -> the tensors they fill."""
        targets = {
            f"{prefix}in_proj.weight": self.in_proj.weight.data,
            f"{prefix}conv1d.weight": self.conv_weight.data,
            f"{prefix}dt_bias": self.dt_bias.data,
            f"{prefix}A": self.A.data,
            f"{prefix}D": self.D.data,
            f"{prefix}norm.weight": self.norm_weight.data,
            f"{prefix}out_proj.weight": self.out_proj.weight.data,
        }
        if self.conv_bias is not None:
            targets[f"{prefix}conv1d.bias"] = self.conv_bias.data
        for name in ("in_proj", "out_proj"):
            linear_bias = getattr(self, name).bias
            if linear_bias is not None:
                targets[f"{prefix}{name}.bias"] = linear_bias.data
        return targets

    def forward(self, x: torch.Tensor, cache: LayerState, step: StateStep) -> torch.Tensor:
        s = self.state
        num_tokens = x.shape[0]
        z, xbc, dt = self.in_proj(x).split(self.sections, dim=-1)
        start_fresh(cache, step)  # sequences starting at position 0 start from zeros
        ops = state_ops.decode_ops(x)  # the decode rows' kernels (CPU, GPU): in place
        conv_weight = self.conv_weight.squeeze(1).float()
        conv_bias = None if self.conv_bias is None else self.conv_bias.float()
        xbc = step_conv(xbc.float(), cache, step, conv_weight, conv_bias, ops)
        xs, B, C = xbc.split([s.value_dim, s.key_dim, s.key_dim], dim=-1)
        xs = xs.view(num_tokens, s.num_heads, s.value_head_dim)
        B = B.view(num_tokens, s.num_key_heads, s.key_head_dim)
        C = C.view(num_tokens, s.num_key_heads, s.key_head_dim)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        A, D = self.A.float(), self.D.float()
        rows, slots = step.decode_rows, step.decode_slots
        if not step.prefill_seqs and ops is not None:  # decodes only: every row in order
            y = ops.mamba2_decode_(xs, B, C, dt, A, D, cache.recurrent, slots)
        else:
            y = torch.empty_like(xs)
            if step.decode_seqs and ops is not None:
                y[rows] = ops.mamba2_decode_(
                    xs[rows], B[rows], C[rows], dt[rows], A, D, cache.recurrent, slots
                )
            elif step.decode_seqs:
                out, states = scan_step(
                    xs[rows], B[rows], C[rows], dt[rows], A, D, cache.recurrent[slots]
                )
                y[rows] = out
                cache.recurrent[slots] = states
            bounds = step.query_start
            for i in step.prefill_seqs:
                state = cache.recurrent[step.slots[i]]
                for start, end, snapshot in pieces(bounds[i], bounds[i + 1], step.saves.get(i)):
                    span = slice(start, end)
                    y[span], state = chunked_scan(xs[span], B[span], C[span], dt[span], A, D, state)
                    if snapshot is not None:
                        cache.snap_recurrent[snapshot] = state
                cache.recurrent[step.slots[i]] = state
        save_at_ends(cache, step)
        normed = gated_group_norm(
            y.reshape(num_tokens, s.value_dim), z, self.norm_weight, s.norm_groups, self.eps
        )
        return self.out_proj(normed.to(x.dtype))
