"""Tensor parallelism for the transformers backend: transformers' own modules, cut by the
tensor-parallel plan transformers declares for the architecture (`config.base_model_tp_plan`,
e.g. Llama's {"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj": "rowwise"}).

    "colwise"   an nn.Linear cut by output rows (its bias too): the rank's heads, or its slice
                of the intermediate features; no communication
    "rowwise"   an nn.Linear cut by input columns (RowParallelLinear, executor/layers/linear/
                parallel.py): the rank's partial
                product, summed across ranks by an all-reduce, the bias added once after it
    replicated  norms and embeddings ("replicated_with_grad_allreduce", "embedding_rowwise",
                ...) stay whole on every rank, as do lm_head and everything the plan leaves out

This is zllm's own cut (executor/parallel/) in transformers' terms: a rank's q/k/v hold its
query and KV heads (a KV head replicated on the ranks whose query heads read it when ranks
outnumber them), so its attention, KV cache and cache sizing are those of `local_arch`. Every
rank keeps the whole lm_head and computes the same logits from the same bits (the hidden
states after each all-reduce are bit-identical on every rank).

Plans with anything else (expert parallelism, packed or gathered outputs, local or
sequence-parallel styles) are refused with the reason, before any weight is read.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from zllm.executor.layers.linear.parallel import RankPart, RowParallelLinear
from zllm.executor.parallel.groups import TensorParallel
from zllm.executor.parallel.shards import kv_heads_of, local_arch
from zllm.model.arch_config import ModelArchConfig

CUT_STYLES = frozenset({"colwise", "rowwise"})
# Styles that at inference leave the module whole on every rank (transformers' embedding
# styles cut the vocabulary and all-reduce the lookup: keeping the table whole is the same sum).
WHOLE_STYLES = frozenset(
    {"replicated_with_grad_allreduce", "replicate", "embedding_rowwise", "embedding_colwise"}
)
_EXPERT_MARKS = ("expert", "moe", "grouped_gemm", "packed")
_KV_PROJECTIONS = ("k_proj", "v_proj")  # replicated per rank when ranks outnumber KV heads

_FLAG = "--tensor-parallel-size with --model-impl transformers"


def usable_plan(config: Any) -> dict[str, str]:
    """The plan's colwise/rowwise entries (module-name pattern -> style) for transformers'
    `config`, or ValueError naming the architecture and why zllm cannot cut it."""
    name = config.model_type
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(
            f"{_FLAG}: transformers declares no tensor-parallel plan for {name} "
            f"(its config's base_model_tp_plan is empty), so which matmuls to cut is unknown; "
            f"run it on one rank"
        )
    experts = {k: v for k, v in plan.items() if _cuts_experts(k, v)}
    if experts:
        raise ValueError(
            f"{_FLAG}: {name} cannot be split: its plan cuts experts ({_entries(experts)}), "
            f"which zllm does not (it cuts colwise and rowwise nn.Linear layers only)"
        )
    other = {k: v for k, v in plan.items() if v not in CUT_STYLES | WHOLE_STYLES}
    if other:
        raise ValueError(
            f"{_FLAG}: {name} cannot be split: its plan has entries zllm does not cut "
            f"({_entries(other)}); zllm cuts colwise and rowwise nn.Linear layers only"
        )
    return {k: v for k, v in plan.items() if v in CUT_STYLES}


def _cuts_experts(pattern: str, style: str) -> bool:
    return any(mark in pattern or mark in style for mark in _EXPERT_MARKS)


def _entries(plan: dict[str, str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in plan.items())


def _even_share(count: int, tp: TensorParallel, what: str) -> slice:
    if count % tp.size:
        raise ValueError(f"{_FLAG}: {count} {what} do not split over {tp.size} ranks")
    per_rank = count // tp.size
    return slice(tp.rank * per_rank, (tp.rank + 1) * per_rank)


def _colwise_rows(name: str, linear: nn.Linear, arch: ModelArchConfig, tp: TensorParallel):
    """The output rows this rank keeps: its KV head when ranks outnumber KV heads (k/v
    projections), else an even share (its query or KV heads, or intermediate features)."""
    if name.rsplit(".", 1)[-1] in _KV_PROJECTIONS and arch.num_kv_heads < tp.size:
        heads = kv_heads_of(arch, tp)
        return slice(heads.start * arch.head_dim, heads.stop * arch.head_dim)
    return _even_share(linear.out_features, tp, f"output features of {name}")


def _cut_colwise(name: str, linear: nn.Linear, arch: ModelArchConfig, tp: TensorParallel):
    rows = _colwise_rows(name, linear, arch, tp)
    linear.weight.data = linear.weight.data[rows].contiguous()
    if linear.bias is not None:
        linear.bias.data = linear.bias.data[rows].contiguous()
    linear.out_features = rows.stop - rows.start
    linear.rank_part = RankPart(rows=rows)
    return linear


def _pattern(key: str) -> re.Pattern[str]:
    """A plan key ("layers.*.self_attn.q_proj") as a module-name pattern ("*": a layer index)."""
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def cut_by_plan(
    base: nn.Module, plan: dict[str, str], arch: ModelArchConfig, tp: TensorParallel
) -> int:
    """Cut `base` (transformers' base model, loaded whole) to this rank's part, in place;
    `arch`: the whole model's. Returns how many matmuls were cut."""
    patterns = [(_pattern(key), style) for key, style in plan.items()]
    cut, parents = 0, set()
    for name, module in list(base.named_modules()):
        style = next((s for p, s in patterns if p.fullmatch(name)), None)
        if style is None:
            continue
        if type(module) is not nn.Linear:
            raise ValueError(
                f"{_FLAG}: {arch.architecture}'s {name} ({type(module).__name__}) is not an "
                f"nn.Linear; zllm cuts only those by the plan's {style!r}"
            )
        parent_name, _, attr = name.rpartition(".")
        parent = base.get_submodule(parent_name)
        part = (
            _cut_colwise(name, module, arch, tp)
            if style == "colwise"
            else RowParallelLinear(
                module, tp, _even_share(module.in_features, tp, "input features")
            )
        )
        setattr(parent, attr, part)
        parents.add(parent)
        cut += 1
    if not cut:
        raise ValueError(
            f"{_FLAG}: no module of {arch.architecture} matches its tensor-parallel plan "
            f"({', '.join(plan)})"
        )
    for parent in parents:
        _localize_head_counts(parent, arch, tp)
    return cut


def _localize_head_counts(module: nn.Module, arch: ModelArchConfig, tp: TensorParallel) -> None:
    """Head counts an attention module keeps for its reshapes, made this rank's (Llama-style
    modules view with -1 heads and need none of this; others keep num_heads and the like)."""
    local = local_arch(arch, tp)
    whole_to_local = {
        "num_heads": (arch.num_heads, local.num_heads),
        "num_attention_heads": (arch.num_heads, local.num_heads),
        "num_key_value_heads": (arch.num_kv_heads, local.num_kv_heads),
        "num_kv_heads": (arch.num_kv_heads, local.num_kv_heads),
    }
    for attr, (whole, mine) in whole_to_local.items():
        if getattr(module, attr, None) == whole:
            setattr(module, attr, mine)
    if isinstance(getattr(module, "num_key_value_groups", None), int):
        # Query heads per KV head: a replicated KV head serves fewer of them on each rank.
        module.num_key_value_groups = local.num_heads // local.num_kv_heads
