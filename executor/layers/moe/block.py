"""A mixture-of-experts MLP (`MoEBlock`): the router, every expert's gate_up and down, and
optionally a shared expert every token goes through (layers/moe/__init__.py draws the flow).
"""

from __future__ import annotations

import torch
from torch import nn

from zllm.executor.kernels import cuda_moe
from zllm.executor.layers.moe.experts import ExpertMatrices, gated_activation
from zllm.executor.layers.moe.router import SIGMOID_BIAS_TOPK, MoERule, route, rule_of
from zllm.model.arch_config import ModelArchConfig


def _weighted_sum(
    x: torch.Tensor,
    out_rows: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
    token_of: torch.Tensor,
) -> torch.Tensor:
    """Each token's experts' outputs (rows in `order` of the flat (token, k) pairs), weighted
    by their routing weights and summed per token in that order."""
    out_rows.mul_(weights.reshape(-1)[order].unsqueeze(1).to(out_rows.dtype))
    return torch.zeros_like(x).index_add_(0, token_of, out_rows)


# Tokens up to which a step's chosen experts run grouped (one parallel region per
# projection, csrc/cpu/moe_experts.cpp): decode steps. A prefill keeps one call per expert,
# whose many rows fill the cores on their own.
GROUPED_MAX_TOKENS = 16


class MoEBlock(nn.Module):
    """A sparse layer's MLP: the router, every expert's gate_up and down, and optionally a
    shared expert every token goes through (Qwen2-MoE's scaled by sigmoid(x w_g), DeepSeek's
    added as is)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        rule: MoERule | None = None,
        shared_expert: nn.Module | None = None,
    ) -> None:
        """`shared_expert`: a dense MLP module (the decoder's), built by the caller."""
        super().__init__()
        self.rule = rule_of(arch) if rule is None else rule
        self.num_experts, self.top_k = arch.moe.num_experts, arch.moe.num_experts_per_tok
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"{self.top_k} experts per token of {self.num_experts}")
        hidden, inter = arch.hidden_size, arch.moe.moe_intermediate_size
        self.intermediate_size = inter
        # (Nemotron 3's router in fp32 whatever the model's dtype, as transformers keeps it:
        # with a score bias, near-ties in bf16 logits would choose other experts)
        self.router_dtype = torch.float32 if self.rule.router == SIGMOID_BIAS_TOPK else dtype
        self.gate = nn.Linear(
            hidden, self.num_experts, bias=self.rule.router_bias, dtype=self.router_dtype
        )
        # SIGMOID_BIAS_TOPK's per-expert score correction (fp32, as the checkpoints hold it).
        self.score_bias = (
            nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32))
            if self.rule.router == SIGMOID_BIAS_TOPK
            else None
        )
        bias = self.rule.expert_bias
        # [gate | up], or up alone for ungated experts (relu2)
        first = 2 * inter if self.rule.gated else inter
        self.experts_gate_up = ExpertMatrices(self.num_experts, first, hidden, dtype, bias)
        self.experts_down = ExpertMatrices(self.num_experts, hidden, inter, dtype, bias)
        self.shared_expert = shared_expert
        gated = shared_expert is not None and self.rule.shared_expert_gated
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        logits = self.gate(x.to(self.router_dtype))
        weights, experts = route(logits, self.top_k, self.rule, self.score_bias)
        out = self.routed(x, weights, experts)
        if self.shared_expert is None:
            return out
        if self.shared_expert_gate is None:
            return out + self.shared_expert(x)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), one matmul pair per chosen
        expert over its tokens' rows (grouped by a stable sort of the pairs by expert). With
        the rule's scale_inputs (Llama 4) the weight scales each expert's input instead."""
        if self.rule.scale_inputs:
            return self._routed_scaled_inputs(x, weights, experts)
        if cuda_moe.usable(x):
            on_device = self._routed_cuda(x, weights, experts)
            if on_device is not None:
                return on_device
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "a CUDA graph cannot capture this MoE layer: its expert weights are not "
                    "float [experts, out, in] tensors the expert kernel reads"
                )
        if x.shape[0] <= GROUPED_MAX_TOKENS:
            grouped = self._routed_grouped(x, weights, experts)
            if grouped is not None:
                return grouped
        pairs = experts.reshape(-1)
        order = torch.argsort(pairs, stable=True)
        chosen, counts = torch.unique_consecutive(pairs[order], return_counts=True)
        token_of = order // self.top_k
        rows = x.index_select(0, token_of)
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, count in zip(chosen.tolist(), counts.tolist(), strict=True):
            block = slice(start, start + count)
            hidden = gated_activation(self.experts_gate_up(rows[block], expert), self.rule)
            out_rows[block] = self.experts_down(hidden, expert)
            start += count
        return _weighted_sum(x, out_rows, weights, order, token_of)

    def _routed_scaled_inputs(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """sum_k expert_{experts[t, k]}(weights[t, k] * x[t]): Llama 4's experts, one matmul
        pair per chosen expert over its tokens' scaled rows."""
        pairs = experts.reshape(-1)
        order = torch.argsort(pairs, stable=True)
        chosen, counts = torch.unique_consecutive(pairs[order], return_counts=True)
        token_of = order // self.top_k
        scale = weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)
        rows = x.index_select(0, token_of) * scale
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, count in zip(chosen.tolist(), counts.tolist(), strict=True):
            block = slice(start, start + count)
            hidden = gated_activation(self.experts_gate_up(rows[block], expert), self.rule)
            out_rows[block] = self.experts_down(hidden, expert)
            start += count
        return torch.zeros_like(x).index_add_(0, token_of, out_rows)

    def _routed_grouped(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor | None:
        """routed() for a decode step's few tokens, the same sums in the same order: the
        pairs sorted by expert in Python (a stable sort, as argsort's) and each projection
        one kernel call for all chosen experts (ExpertMatrices.grouped); None where that
        does not serve them (the activations are fp32 CPU rows as x is)."""
        experts_gate_up, experts_down = self.experts_gate_up, self.experts_down
        if not (experts_gate_up.serves_grouped(x) and experts_down.serves_grouped(x)):
            return None
        pairs = experts.reshape(-1).tolist()
        order = sorted(range(len(pairs)), key=pairs.__getitem__)
        chosen: list[int] = []
        starts: list[int] = []
        for row, pair in enumerate(order):
            if not chosen or chosen[-1] != pairs[pair]:
                chosen.append(pairs[pair])
                starts.append(row)
        starts.append(len(order))
        order_index = torch.tensor(order)
        token_of = order_index // self.top_k
        # One token: its rows are x's row k times, read in place (rows 0 apart).
        rows = x.expand(len(order), -1) if x.shape[0] == 1 else x.index_select(0, token_of)
        groups = (chosen, starts)
        gate_up = experts_gate_up.grouped(rows, groups)
        # The activation is per row, so all groups at once give each row's bits.
        out_rows = experts_down.grouped(gated_activation(gate_up, self.rule), groups)
        return _weighted_sum(x, out_rows, weights, order_index, token_of)

    def _routed_cuda(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor | None:
        """routed() on the GPU with no host sync (csrc/moe_experts.cu): the pairs grouped on
        the device, each projection one launch over the chosen experts, outputs in pair
        order, so the combine is a weighted sum over each token's k rows (in fp32). None
        where the kernel does not read these weights (blocks, --deterministic's tiles)."""
        gate_up_m, down_m = self.experts_gate_up, self.experts_down
        if gate_up_m.tile_rows is not None or down_m.tile_rows is not None:
            return None
        if not (cuda_moe.takes(x, gate_up_m.weight) and cuda_moe.takes(None, down_m.weight)):
            return None
        assert gate_up_m.weight is not None and down_m.weight is not None
        groups = cuda_moe.expert_groups(experts, self.num_experts)
        gate_up = cuda_moe.moe_gemv(x, gate_up_m.weight, gate_up_m.bias, groups, self.top_k)
        hidden = gated_activation(gate_up, self.rule).contiguous()
        out_rows = cuda_moe.moe_gemv(hidden, down_m.weight, down_m.bias, groups, 1)
        per_token = out_rows.view(x.shape[0], self.top_k, x.shape[1]).float()
        return (per_token * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Each checkpoint name under `prefix` ("model.layers.{i}.mlp.") -> the tensor (a
        view of the stacked experts) it fills; the shared expert's under the rule's
        shared_name (DeepSeek's checkpoints: "shared_experts")."""
        shared_name = self.rule.shared_name
        targets = {f"{prefix}gate.weight": self.gate.weight.data}
        if self.score_bias is not None:
            targets[f"{prefix}gate.e_score_correction_bias"] = self.score_bias.data
        gate_up, down = self.experts_gate_up.weight, self.experts_down.weight
        assert gate_up is not None and down is not None, "the expert weights were released"
        for e in range(self.num_experts):
            if self.rule.gated:
                gate, up = gate_up.data[e].split(self.intermediate_size)
                targets[f"{prefix}experts.{e}.gate_proj.weight"] = gate
            else:
                up = gate_up.data[e]
            targets[f"{prefix}experts.{e}.up_proj.weight"] = up
            targets[f"{prefix}experts.{e}.down_proj.weight"] = down.data[e]
        shared = self.shared_expert
        if shared is not None and hasattr(shared, "gate_up_proj"):
            gate, up = shared.gate_up_proj.weight.data.split(shared.intermediate_size)
            targets[f"{prefix}{shared_name}.gate_proj.weight"] = gate
            targets[f"{prefix}{shared_name}.up_proj.weight"] = up
            targets[f"{prefix}{shared_name}.down_proj.weight"] = shared.down_proj.weight.data
        elif shared is not None:  # an ungated MLP (Nemotron 3's)
            targets[f"{prefix}{shared_name}.up_proj.weight"] = shared.up_proj.weight.data
            targets[f"{prefix}{shared_name}.down_proj.weight"] = shared.down_proj.weight.data
        if self.shared_expert_gate is not None:
            targets[f"{prefix}shared_expert_gate.weight"] = self.shared_expert_gate.weight.data
        return targets
