"""A mixture-of-experts MLP over the flat token batch [T, hidden]: Qwen3-MoE, Qwen2-MoE (with
its shared expert), Mixtral and OLMoE, gpt-oss's and DeepSeek-V2's variants of the rule.

    router    logits = x W_r^T (+ b_r)                  [T, E]: one score per token and expert
    route     each token's top-k experts and their weights   route(), the rule's variant
    group     the T*k (token, expert) pairs sorted by expert, so each expert's rows sit together
    experts   per expert that has rows: y = down(act(gate_up(x_rows)))
    combine   out[t] = sum over its k pairs of w * y, added in expert order

    x [T, H] ── router ── top-k ──> pairs (t, e, w)  sorted by e:
        rows  | t3 t7 | t1 | t3 t4 t9 | ...      one gate_up and one down matmul per block
        e     |  e0   | e2 |    e5    | ...      (experts no token chose are never read)
    out[t] += w * y[row]   for every row of token t (index_add, rows in expert order)

Only the chosen experts' matrices are touched: a decode step of a few tokens reads k experts'
rows per token, not all E. ExpertMatrices holds one projection of every expert: a stacked
tensor [E, out, in] as a checkpoint's weights are held (fp32 on CPU, the model's dtype on a
GPU), or a GGUF file's blocks [E, out, bytes per row] (or a bf16/fp16 checkpoint's rows) that
the CPU kernel multiplies in place (csrc/cpu/gguf_linear.h): each expert's matrix is a view
of its rows, never widened (executor/weights/expert_blocks.py swaps them in).

Checkpoint names: the model's targets are each expert's own tensors, transformers' naming
(`mlp.experts.{e}.gate_proj.weight`, also what transformers 5 saves); per_expert_weights cuts a
GGUF file's stacked tensors (`mlp.experts.gate_proj.weight`, [E, out, in]) and transformers 5's
fused in-memory ones (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) into those views.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cpu_layer_ops, cuda_layer_ops, cuda_moe
from zllm.executor.kernels.batch_invariant import TILE_ROWS, tiled
from zllm.executor.weights.gguf_arithmetic import integer_rows
from zllm.model.arch_config import ModelArchConfig

# Router rules: how a token's logits become its experts and their weights.
SOFTMAX_TOPK = "softmax_topk"  # Qwen-MoE, Mixtral, OLMoE: softmax over all E, keep the top k
TOPK_SOFTMAX = "topk_softmax"  # gpt-oss: the top k logits, softmax over those k
# DeepSeek-V2: softmax over all E, the top k among the best groups' experts only (when the
# experts are grouped), optionally renormalised, times routed_scaling.
# (DeepSeek-V3's sigmoid scores chosen with a per-expert bias would be another rule here.)
GROUPED_SOFTMAX_TOPK = "grouped_softmax_topk"
ROUTER_RULES = (SOFTMAX_TOPK, TOPK_SOFTMAX, GROUPED_SOFTMAX_TOPK)

# Expert activations over [gate | up]: SwiGLU, or gpt-oss's clamped SwiGLU.
SILU = "silu"  # silu(gate) * up
CLAMPED_SWIGLU = "clamped_swiglu"  # (clamp(up) + 1) * g * sigmoid(alpha * g), g = clamp(gate)


@dataclass(frozen=True, slots=True)
class MoERule:
    """What differs between the families' MoE layers."""

    router: str = SOFTMAX_TOPK
    norm_topk_prob: bool = False  # SOFTMAX_TOPK: the k weights renormalised to sum to 1
    activation: str = SILU
    # gate_up's columns alternate gate, up (gpt-oss's checkpoints) rather than [gate | up].
    interleaved_gate_up: bool = False
    swiglu_alpha: float = 1.702  # CLAMPED_SWIGLU's sigmoid slope
    swiglu_limit: float = 7.0  # ... and its clamp
    router_bias: bool = False  # gpt-oss: the router's logits have a bias
    expert_bias: bool = False  # gpt-oss: each expert's gate_up and down have biases
    # GROUPED_SOFTMAX_TOPK: E in group_count equal groups, the top k drawn from the
    # groups_used groups of the highest best score (no limit unless groups_used < group_count),
    # the k weights then times routed_scaling.
    group_count: int = 1
    groups_used: int = 1
    routed_scaling: float = 1.0
    # The shared expert's output scaled by sigmoid(x w_g) (Qwen2-MoE), or added as is (DeepSeek).
    shared_expert_gated: bool = True


# gpt-oss's layer (its model is another task; tests hold this rule to transformers' block).
GPT_OSS_RULE = MoERule(
    router=TOPK_SOFTMAX,
    activation=CLAMPED_SWIGLU,
    interleaved_gate_up=True,
    router_bias=True,
    expert_bias=True,
)


def rule_of(arch: ModelArchConfig) -> MoERule:
    """The rule of the Qwen-MoE / Mixtral / OLMoE families: softmax, top k, optionally
    renormalised (Mixtral's configs have no norm_topk_prob: arch.py sets it for them)."""
    return MoERule(norm_topk_prob=arch.norm_topk_prob)


def deepseek_rule(arch: ModelArchConfig) -> MoERule:
    """DeepSeek-V2's rule: its router (group-limited when the config groups the experts) and
    its shared experts added ungated."""
    grouped = arch.expert_group_count > 0
    return MoERule(
        router=GROUPED_SOFTMAX_TOPK,
        norm_topk_prob=arch.norm_topk_prob,
        group_count=arch.expert_group_count if grouped else 1,
        groups_used=arch.expert_groups_used if grouped else 1,
        routed_scaling=arch.routed_scaling_factor,
        shared_expert_gated=False,
    )


def keep_best_groups(scores: torch.Tensor, group_count: int, groups_used: int) -> torch.Tensor:
    """scores [T, E] with every expert outside each token's `groups_used` best groups (ranked
    by their highest score; ties to the lower group) set to 0, as DeepSeek-V2 masks them."""
    tokens, experts = scores.shape
    if experts % group_count:
        raise ValueError(f"{experts} experts do not split into {group_count} groups")
    grouped = scores.view(tokens, group_count, experts // group_count)
    best = torch.sort(grouped.amax(dim=-1), dim=-1, descending=True, stable=True)[1]
    keep = torch.zeros(tokens, group_count, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, best[:, :groups_used], True)
    return grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view(tokens, experts)


def route(logits: torch.Tensor, top_k: int, rule: MoERule) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights: (weights [T, k] fp32, expert ids [T, k] int64).

    Computed in fp32 as transformers does. Equal scores go to the lower expert id (a stable
    sort), so the choice does not depend on which top-k kernel runs."""
    if rule.router not in ROUTER_RULES:
        raise ValueError(f"unknown router rule {rule.router!r} (known: {ROUTER_RULES})")
    scores = logits.float()
    if rule.router != TOPK_SOFTMAX:
        scores = torch.softmax(scores, dim=-1)
    if rule.router == GROUPED_SOFTMAX_TOPK and rule.groups_used < rule.group_count:
        scores = keep_best_groups(scores, rule.group_count, rule.groups_used)
    ranked, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    top, experts = ranked[:, :top_k], order[:, :top_k]
    if rule.router == TOPK_SOFTMAX:
        return torch.softmax(top, dim=-1), experts
    if rule.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    if rule.router == GROUPED_SOFTMAX_TOPK:  # after renormalising, as llama.cpp's deepseek2
        top = top * rule.routed_scaling
    return top, experts


def gated_activation(gate_up: torch.Tensor, rule: MoERule) -> torch.Tensor:
    """act(gate) * up of an expert's gate_up rows [n, 2 x intermediate] -> [n, intermediate]."""
    if rule.activation == SILU and not rule.interleaved_gate_up:
        if cpu_layer_ops.usable(gate_up):
            fused = cpu_layer_ops.gated_act(gate_up, "silu")  # csrc/cpu/row_ops.h
            if fused is not None:
                return fused
        elif cuda_layer_ops.usable(gate_up):
            fused = cuda_layer_ops.silu_mul(gate_up)  # csrc/layer_ops.cu: torch's bits
            if fused is not None:
                return fused
    if rule.interleaved_gate_up:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if rule.activation == SILU:
        return F.silu(gate) * up
    if rule.activation != CLAMPED_SWIGLU:
        raise ValueError(f"unknown expert activation {rule.activation!r}")
    gate = gate.clamp(max=rule.swiglu_limit)
    up = up.clamp(min=-rule.swiglu_limit, max=rule.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * rule.swiglu_alpha))


class ExpertMatrices(nn.Module):
    """One projection of every expert: y = x W_e^T (+ b_e) for the rows routed to expert e.

    `weight` [E, out, in] in the model's dtype, until hold_blocks_ swaps in blocks
    [E, rows, bytes per row] per part (a fused projection whose parts a file stores in
    different types has several, each writing its own columns of y)."""

    def __init__(
        self,
        num_experts: int,
        out_features: int,
        in_features: int,
        dtype: torch.dtype,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.out_features = out_features
        self.in_features = in_features
        # Plain empty tensors (untouched pages): load_weights fills them, or blocks replace them.
        shape = (num_experts, out_features, in_features)
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(shape, dtype=dtype))
        self.bias = (
            nn.Parameter(torch.empty(num_experts, out_features, dtype=dtype)) if bias else None
        )
        self.parts: list[tuple[torch.Tensor, int]] | None = None  # (blocks, ggml type)
        self.int8_max_rows = 0  # integer dots up to this many rows (gguf_arithmetic.py)
        # --deterministic (make_batch_invariant): every call in TILE_ROWS-row tiles, so an
        # expert's rows do not depend on how many other tokens chose it this step.
        self.tile_rows: int | None = None

    def hold_blocks_(
        self, parts: list[tuple[torch.Tensor, int]], arithmetic: str = "gguf-float"
    ) -> None:
        """Multiply these blocks ([E, rows, bytes per row] each, rows summing to
        out_features) from now on; the float weight is dropped."""
        rows = sum(blocks.shape[1] for blocks, _ in parts)
        if rows != self.out_features or any(b.shape[0] != self.num_experts for b, _ in parts):
            shapes = [tuple(b.shape) for b, _ in parts]
            raise ValueError(f"expert blocks {shapes} for {self.num_experts} x {self.out_features}")
        self.parts = [(blocks.contiguous(), ggml_type) for blocks, ggml_type in parts]
        types = [ggml_type for _, ggml_type in parts]
        self.int8_max_rows = integer_rows(arithmetic, types)
        self.weight = None

    @property
    def int8_activations(self) -> bool:
        return self.int8_max_rows > 0

    def held_bytes(self) -> int:
        """Bytes of the expert matrices held (blocks, or the float weight)."""
        if self.parts is not None:
            return sum(blocks.numel() * blocks.element_size() for blocks, _ in self.parts)
        assert self.weight is not None
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [n, in] (rows contiguous) -> [n, out] through expert `expert`'s matrix."""
        if self.tile_rows is not None:
            assert self.tile_rows == TILE_ROWS
            return tiled(lambda rows: self._multiply(rows, expert), x)
        return self._multiply(x, expert)

    def _multiply(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[expert]
        if self.parts is None:
            assert self.weight is not None
            return F.linear(x, self.weight[expert], bias)
        y = x.new_empty(x.shape[0], self.out_features)
        int8 = self.int8_activations and x.shape[0] <= self.int8_max_rows
        start = 0
        for blocks, ggml_type in self.parts:
            rows = blocks.shape[1]
            columns = y if len(self.parts) == 1 else y[:, start : start + rows]
            if int8:
                cpu_kernels.gguf_linear_int8(x, blocks[expert], ggml_type, columns)
            else:
                cpu_kernels.gguf_linear_into(x, blocks[expert], ggml_type, columns)
            start += rows
        if bias is not None:
            y.add_(bias)
        return y

    def serves_grouped(self, x: torch.Tensor) -> bool:
        """Whether grouped() takes rows like x: blocks, no --deterministic tiles, fp32 rows
        on the CPU."""
        return self.parts is not None and self.tile_rows is None and _kernel_rows(x)

    def grouped(self, x: torch.Tensor, groups: tuple[list[int], list[int]]) -> torch.Tensor:
        """x [R, in] through the chosen experts in one kernel call per part (one parallel
        region, csrc/cpu/moe_experts.h), groups = (experts, row starts); the bits the
        per-expert calls give. Only where serves_grouped(x)."""
        assert self.parts is not None
        y = x.new_empty(x.shape[0], self.out_features)
        int8_rows = self.int8_max_rows
        start = 0
        for blocks, ggml_type in self.parts:
            rows = blocks.shape[1]
            columns = y if len(self.parts) == 1 else y[:, start : start + rows]
            cpu_kernels.moe_experts_linear(x, blocks, ggml_type, groups, int8_rows, columns)
            start += rows
        if self.bias is not None:
            experts, starts = groups
            for g, expert in enumerate(experts):
                y[starts[g] : starts[g + 1]].add_(self.bias[expert])
        return y

    def extra_repr(self) -> str:
        held = "float"
        if self.parts is not None:
            names = cpu_kernels.SUPPORTED_GGML_TYPES
            held = "types=" + "/".join(names.get(t, str(t)) for _, t in self.parts)
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, {held}"


def _kernel_rows(x: torch.Tensor) -> bool:
    """x is rows the CPU kernel reads in place: fp32 on the CPU, rows contiguous."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


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
# projection, csrc/cpu/moe_experts.h): decode steps. A prefill keeps one call per expert,
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
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"{self.top_k} experts per token of {self.num_experts}")
        hidden, inter = arch.hidden_size, arch.moe_intermediate_size
        self.intermediate_size = inter
        self.gate = nn.Linear(hidden, self.num_experts, bias=self.rule.router_bias, dtype=dtype)
        bias = self.rule.expert_bias
        self.experts_gate_up = ExpertMatrices(self.num_experts, 2 * inter, hidden, dtype, bias)
        self.experts_down = ExpertMatrices(self.num_experts, hidden, inter, dtype, bias)
        self.shared_expert = shared_expert
        gated = shared_expert is not None and self.rule.shared_expert_gated
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, experts = route(self.gate(x), self.top_k, self.rule)
        out = self.routed(x, weights, experts)
        if self.shared_expert is None:
            return out
        if self.shared_expert_gate is None:
            return out + self.shared_expert(x)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), one matmul pair per chosen
        expert over its tokens' rows (grouped by a stable sort of the pairs by expert)."""
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

    def checkpoint_targets(
        self, prefix: str, shared_name: str = "shared_expert"
    ) -> dict[str, torch.Tensor]:
        """Each checkpoint name under `prefix` ("model.layers.{i}.mlp.") -> the tensor (a
        view of the stacked experts) it fills; the shared expert's under `shared_name`
        (DeepSeek's checkpoints: "shared_experts")."""
        targets = {f"{prefix}gate.weight": self.gate.weight.data}
        gate_up, down = self.experts_gate_up.weight, self.experts_down.weight
        assert gate_up is not None and down is not None, "the expert weights were released"
        for e in range(self.num_experts):
            gate, up = gate_up.data[e].split(self.intermediate_size)
            targets[f"{prefix}experts.{e}.gate_proj.weight"] = gate
            targets[f"{prefix}experts.{e}.up_proj.weight"] = up
            targets[f"{prefix}experts.{e}.down_proj.weight"] = down.data[e]
        shared = self.shared_expert
        if shared is not None:
            gate, up = shared.gate_up_proj.weight.data.split(shared.intermediate_size)
            targets[f"{prefix}{shared_name}.gate_proj.weight"] = gate
            targets[f"{prefix}{shared_name}.up_proj.weight"] = up
            targets[f"{prefix}{shared_name}.down_proj.weight"] = shared.down_proj.weight.data
        if self.shared_expert_gate is not None:
            targets[f"{prefix}shared_expert_gate.weight"] = self.shared_expert_gate.weight.data
        return targets


# A GGUF file's stacked expert tensors under our names ([E, out, in]; loader.py), and
# transformers 5's fused in-memory ones ([E, 2 x intermediate, hidden] and [E, hidden, inter]).
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)")
# Mixtral's checkpoint names -> Qwen-MoE's, which the model's targets use.
_MIXTRAL_NAMES = (
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
)


def expert_name(name: str) -> str:
    """A checkpoint's expert tensor name as the model's targets spell it (Mixtral's w1/w3/w2
    under block_sparse_moe -> gate_proj/up_proj/down_proj under mlp)."""
    if ".block_sparse_moe." in name:
        for pattern, replacement in _MIXTRAL_NAMES:
            name = pattern.sub(replacement, name)
    return name


def per_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with stacked and fused expert tensors cut into each expert's
    (views, no copy) and Mixtral's names as the targets spell them."""
    for name, tensor in weights:
        name = expert_name(name)
        stacked, fused = _STACKED.fullmatch(name), _FUSED.fullmatch(name)
        if stacked is not None and tensor.dim() == 3:
            prefix, proj = stacked.groups()
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.{proj}.weight", tensor[e]
        elif fused is not None and tensor.dim() == 3:
            prefix, proj = fused.groups()
            if proj == "down_proj":
                for e in range(tensor.shape[0]):
                    yield f"{prefix}{e}.down_proj.weight", tensor[e]
                continue
            for e in range(tensor.shape[0]):
                gate, up = tensor[e].chunk(2)
                yield f"{prefix}{e}.gate_proj.weight", gate
                yield f"{prefix}{e}.up_proj.weight", up
        else:
            yield name, tensor


def per_expert_names(names: Collection[str], num_experts: int) -> frozenset[str]:
    """`names` (the tensors GGUF blocks serve) with each stacked expert tensor's name
    replaced by its experts' own names, as per_expert_weights cuts it."""
    out = set()
    for name in names:
        stacked = _STACKED.fullmatch(name)
        if stacked is None:
            out.add(expert_name(name))
            continue
        prefix, proj = stacked.groups()
        out.update(f"{prefix}{e}.{proj}.weight" for e in range(num_experts))
    return frozenset(out)
