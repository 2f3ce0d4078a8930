"""The router of a mixture-of-experts layer: how a token's logits become its experts and their
weights, per family (`MoERule`: Qwen-MoE / Mixtral / OLMoE's softmax then top k, gpt-oss's top
k then softmax, DeepSeek-V2's group-limited softmax top k, DeepSeek-V3's and Nemotron 3's
sigmoid scores chosen with a score-correction bias, Llama 4's top k then sigmoid), computed in
fp32 as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zllm.model.arch_config import ModelArchConfig

# Router rules: how a token's logits become its experts and their weights.
SOFTMAX_TOPK = "softmax_topk"  # Qwen-MoE, Mixtral, OLMoE: softmax over all E, keep the top k
TOPK_SOFTMAX = "topk_softmax"  # gpt-oss: the top k logits, softmax over those k
# DeepSeek-V2: softmax over all E, the top k among the best groups' experts only (when the
# experts are grouped), optionally renormalised, times routed_scaling.
GROUPED_SOFTMAX_TOPK = "grouped_softmax_topk"
# Nemotron 3 (and DeepSeek-V3's "noaux_tc"): sigmoid scores; the top k chosen by score plus
# a per-expert correction bias, among the groups whose two best biased scores sum highest;
# weighted by the unbiased scores, optionally renormalised, times routed_scaling.
SIGMOID_BIAS_TOPK = "sigmoid_bias_topk"
TOPK_SIGMOID = "topk_sigmoid"  # Llama 4: the top k logits, each weight its logit's sigmoid
ROUTER_RULES = (SOFTMAX_TOPK, TOPK_SOFTMAX, GROUPED_SOFTMAX_TOPK, SIGMOID_BIAS_TOPK, TOPK_SIGMOID)

# Expert activations: SwiGLU or gpt-oss's clamped SwiGLU over [gate | up]; relu2 over an
# ungated up projection (Nemotron 3's experts have no gate).
SILU = "silu"  # silu(gate) * up
CLAMPED_SWIGLU = "clamped_swiglu"  # (clamp(up) + 1) * g * sigmoid(alpha * g), g = clamp(gate)
RELU2 = "relu2"  # relu(up)^2


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
    # Its checkpoint name under mlp.: Qwen2-MoE's "shared_expert", DeepSeek's and GLM's plural.
    shared_name: str = "shared_expert"
    # Llama 4: each chosen expert takes the token times its weight, and its output is summed
    # as is (not the output weighted: the experts are not linear, so the two differ).
    scale_inputs: bool = False

    @property
    def gated(self) -> bool:
        """Whether the experts' first projection is [gate | up] (2 x intermediate rows)."""
        return self.activation != RELU2


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
    renormalised (Mixtral's configs have no norm_topk_prob: its family's reader sets it);
    GLM-4.5's: DeepSeek-V3's sigmoid router (MoEConfig.sigmoid_scores) and its shared
    experts added ungated."""
    moe = arch.moe
    if moe.sigmoid_scores:  # DeepSeek-V3's rule, shared experts and all
        return deepseek_rule(arch)
    return MoERule(norm_topk_prob=moe.norm_topk_prob)


def deepseek_rule(arch: ModelArchConfig) -> MoERule:
    """DeepSeek-V2's rule (softmax, group-limited when the config groups the experts) or
    DeepSeek-V3's (sigmoid scores with a correction bias), and the shared experts added
    ungated."""
    moe = arch.moe
    grouped = moe.expert_group_count > 0
    return MoERule(
        router=SIGMOID_BIAS_TOPK if moe.sigmoid_scores else GROUPED_SOFTMAX_TOPK,
        norm_topk_prob=moe.norm_topk_prob,
        group_count=moe.expert_group_count if grouped else 1,
        groups_used=moe.expert_groups_used if grouped else 1,
        routed_scaling=moe.routed_scaling_factor,
        shared_expert_gated=False,
        shared_name="shared_experts",
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


def route(
    logits: torch.Tensor, top_k: int, rule: MoERule, score_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights: (weights [T, k] fp32, expert ids [T, k] int64).
    `score_bias`: SIGMOID_BIAS_TOPK's per-expert correction [E].

    Computed in fp32 as transformers does. Equal scores go to the lower expert id (a stable
    sort), so the choice does not depend on which top-k kernel runs."""
    if rule.router not in ROUTER_RULES:
        raise ValueError(f"unknown router rule {rule.router!r} (known: {ROUTER_RULES})")
    if rule.router == SIGMOID_BIAS_TOPK:
        return _sigmoid_bias_topk(logits, top_k, rule, score_bias)
    scores = logits.float()
    if rule.router == TOPK_SIGMOID:
        ranked, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        return torch.sigmoid(ranked[:, :top_k]), order[:, :top_k]
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


def _sigmoid_bias_topk(
    logits: torch.Tensor, top_k: int, rule: MoERule, score_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(logits.float())
    choice = scores if score_bias is None else scores + score_bias.float()
    if rule.groups_used < rule.group_count:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, rule.group_count, experts // rule.group_count)
        best_two = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        best = torch.sort(best_two, dim=-1, descending=True, stable=True)[1]
        keep = torch.zeros_like(best_two, dtype=torch.bool)
        keep.scatter_(1, best[:, : rule.groups_used], True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), -torch.inf).view(tokens, experts)
    experts = torch.sort(choice, dim=-1, descending=True, stable=True)[1][:, :top_k]
    top = scores.gather(1, experts)
    if rule.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * rule.routed_scaling, experts
