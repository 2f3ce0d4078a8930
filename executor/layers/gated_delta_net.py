"""A Gated DeltaNet layer (Qwen3-Next's and Qwen3.5's linear attention): a state layer of a
hybrid model. Instead of attending over a KV cache it keeps per sequence a conv window and
a recurrent state in its slot of the state pool (executor/kv/state_pool.py):

    proj = in_proj(x)                      [T, q | k | v | z | b | a]: one GEMM
    q|k|v = silu(causal_conv1d(q|k|v))      the window carries the last kernel - 1 inputs
    beta = sigmoid(b), g = A * softplus(a + dt_bias)   (A = -exp(A_log) < 0, kept as is)
    o = gated_delta_rule(q, k, v, g, beta)  one token at a time for decodes (batched), a
                                            chunk at a time for prompts (per sequence)
    out = out_proj(rms_norm(o) * w * silu(z))

The arithmetic is executor/layers/gated_delta_rule.py's, in fp32; the decode rows' step runs
csrc/cpu/state_layers.cpp's kernel on CPU and csrc/state_layers.cu's on a GPU
(executor/kernels/state_ops.py), which update each slot's state in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.kernels import state_ops
from zllm.executor.kv.state_pool import LayerState
from zllm.executor.kv.state_step import StateStep, pieces, save_at_ends, start_fresh
from zllm.executor.layers.causal_conv import step_conv
from zllm.executor.layers.gated_delta_rule import chunked_prefill, gated_rms_norm, recurrent_step
from zllm.executor.layers.linear.dense import empty_linear
from zllm.model.arch_config import ModelArchConfig


class GatedDeltaNet(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        s = arch.state
        assert s is not None and s.kind == "gated_delta_net"
        self.state = s
        self.eps = arch.rms_norm_eps
        # [q | k | v | z | b, a]: Qwen3.5's four projections (Qwen3-Next's two, its q, k, v,
        # z interleave undone at load) as one matrix; b and a as stored (arch.state).
        self.sections = [s.conv_dim, s.value_dim, 2 * s.num_heads]
        self.in_proj = empty_linear(arch.hidden_size, sum(self.sections), dtype)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_kernel, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.empty(s.num_heads, dtype=dtype))
        # -exp(A_log): what the decay multiplies, as llama.cpp's files store it (a Hugging
        # Face checkpoint's A_log is turned into it at load, as transformers computes it).
        self.A = nn.Parameter(torch.empty(s.num_heads, dtype=dtype))
        self.norm_weight = nn.Parameter(torch.empty(s.value_head_dim, dtype=dtype))
        self.out_proj = empty_linear(s.value_dim, arch.hidden_size, dtype)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Qwen3.5's names under `prefix` (…linear_attn.) -> the tensors they fill."""
        qkv, z, ba = self.in_proj.weight.data.split(self.sections)
        if self.state.grouped_beta_alpha:
            beta_alpha = {f"{prefix}in_proj_ba.weight": ba}
        else:
            b, a = ba.split(self.state.num_heads)
            beta_alpha = {f"{prefix}in_proj_b.weight": b, f"{prefix}in_proj_a.weight": a}
        return {
            f"{prefix}in_proj_qkv.weight": qkv,
            f"{prefix}in_proj_z.weight": z,
            **beta_alpha,
            f"{prefix}conv1d.weight": self.conv_weight.data,
            f"{prefix}dt_bias": self.dt_bias.data,
            f"{prefix}A": self.A.data,
            f"{prefix}norm.weight": self.norm_weight.data,
            f"{prefix}out_proj.weight": self.out_proj.weight.data,
        }

    def forward(self, x: torch.Tensor, cache: LayerState, step: StateStep) -> torch.Tensor:
        s = self.state
        num_tokens = x.shape[0]
        mixed, z, ba = self.in_proj(x).split(self.sections, dim=-1)
        if s.grouped_beta_alpha:  # [b_0 a_0 b_1 a_1 ...], r value heads per key head
            ba = ba.reshape(num_tokens, s.num_key_heads, 2, s.num_heads // s.num_key_heads)
            b, a = ba[:, :, 0].reshape(num_tokens, -1), ba[:, :, 1].reshape(num_tokens, -1)
        else:
            b, a = ba.split(s.num_heads, dim=-1)
        start_fresh(cache, step)  # sequences starting at position 0 start from zeros
        ops = state_ops.decode_ops(x)  # the decode rows' kernels (CPU, GPU): in place
        # A step of decodes only takes every row in order: no gathers or scatters.
        whole = not step.prefill_seqs
        rows, slots = step.decode_rows, step.decode_slots
        mixed = mixed.float()
        gate = z.reshape(num_tokens, s.num_heads, s.value_head_dim)
        beta = b.float().sigmoid()
        g = self.A.float() * F.softplus(a.float() + self.dt_bias.float())
        conv_weight = self.conv_weight.squeeze(1).float()
        conv_out = step_conv(mixed, cache, step, conv_weight, None, ops)
        q, k, v = conv_out.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = q.view(num_tokens, s.num_key_heads, s.key_head_dim)
        k = k.view(num_tokens, s.num_key_heads, s.key_head_dim)
        v = v.view(num_tokens, s.num_heads, s.value_head_dim)
        tiled = s.tiled_value_heads
        if whole and ops is not None:  # the rule and the gated norm in one pass per head
            normed = ops.gated_delta_decode_(
                q, k, v, g, beta, cache.recurrent, slots, tiled, gate, self.norm_weight, self.eps
            )
            save_at_ends(cache, step)
            return self.out_proj(normed.reshape(num_tokens, s.value_dim).to(x.dtype))
        core = torch.empty(num_tokens, s.num_heads, s.value_head_dim, device=x.device)
        if step.decode_seqs and ops is None:
            out, states = recurrent_step(
                q[rows], k[rows], v[rows], g[rows], beta[rows], cache.recurrent[slots], tiled
            )
            core[rows] = out
            cache.recurrent[slots] = states
        bounds = step.query_start
        for i in step.prefill_seqs:
            state = cache.recurrent[step.slots[i]]
            for start, end, snapshot in pieces(bounds[i], bounds[i + 1], step.saves.get(i)):
                span = slice(start, end)
                core[span], state = chunked_prefill(
                    q[span], k[span], v[span], g[span], beta[span], state, tiled
                )
                if snapshot is not None:
                    cache.snap_recurrent[snapshot] = state
            cache.recurrent[step.slots[i]] = state
        if step.decode_seqs and ops is not None:  # (its rows of core are left unset: normed there)
            decoded = ops.gated_delta_decode_(
                q[rows], k[rows], v[rows], g[rows], beta[rows], cache.recurrent, slots, tiled,
                gate[rows], self.norm_weight, self.eps,
            )  # fmt: skip
        save_at_ends(cache, step)
        normed = gated_rms_norm(core, gate, self.norm_weight, self.eps)
        if step.decode_seqs and ops is not None:
            normed[rows] = decoded
        return self.out_proj(normed.reshape(num_tokens, s.value_dim).to(x.dtype))


def in_proj_names(prefix: str, grouped_beta_alpha: bool) -> list[str]:
    """The checkpoint tensors behind the fused in_proj, in its row order."""
    beta_alpha = ["in_proj_ba"] if grouped_beta_alpha else ["in_proj_b", "in_proj_a"]
    return [f"{prefix}{name}.weight" for name in ["in_proj_qkv", "in_proj_z", *beta_alpha]]
