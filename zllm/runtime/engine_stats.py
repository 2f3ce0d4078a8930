"""Several engines' heartbeats (`EngineStats`, one per data-parallel replica) as one: the
dashboard's and /health's totals. The engine-wide counts merge by one rule (counts and
times summed, the KV pools' usage weighed by their sizes and their cells side by side);
each feature's section merges by its own (`SECTION_MERGES`): a section that is None on
every engine stays None."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zllm.protocol import EngineStats, LoRAStats, TenantStats


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    if len(stats) == 1:
        return stats[0]
    merged = EngineStats()
    for name in EngineStats.__struct_fields__:
        values = [getattr(s, name) for s in stats]
        if name in SECTION_MERGES:
            present = [v for v in values if v is not None]
            value = SECTION_MERGES[name](present) if present else None
        elif name in ("time", "blocks_per_cell", "kv_block_bytes"):
            value = max(values)
        elif name == "engine_index":
            value = 0
        elif name == "kv_cache_usage":
            total = sum(s.num_blocks for s in stats)
            value = sum(s.kv_cache_usage * s.num_blocks for s in stats) / total if total else 0.0
        elif name == "block_states":
            value = b"".join(values)
        elif name == "asleep":
            value = all(values)
        else:
            value = sum(values)
        setattr(merged, name, value)
    return merged


def sum_fields(sections: list[Any]) -> Any:
    """A section's fields added up across engines: numbers summed, per-position lists (tier,
    stage, draft position) summed item by item, the first engine's text (alike on all)."""
    merged = type(sections[0])()
    for name in merged.__struct_fields__:
        values = [getattr(s, name) for s in sections]
        if isinstance(values[0], str):
            value = values[0]
        elif isinstance(values[0], list):
            value = [sum(v[i] for v in values if i < len(v)) for i in range(max(map(len, values)))]
        else:
            value = sum(values)
        setattr(merged, name, value)
    return merged


def merge_lora(sections: list[LoRAStats]) -> LoRAStats:
    return LoRAStats(
        running_adapters=sorted({a for s in sections for a in s.running_adapters}),
        waiting_adapters=sorted({a for s in sections for a in s.waiting_adapters}),
        max_lora=max(s.max_lora for s in sections),
    )


def merge_tenants(per_engine: list[list[TenantStats]]) -> list[TenantStats]:
    """Summed by tenant name (a tenant's weight is the same on every engine)."""
    by_name: dict[str, TenantStats] = {}
    for tenants in per_engine:
        for t in tenants:
            into = by_name.setdefault(t.name, TenantStats(t.name, t.weight))
            for name in TenantStats.__struct_fields__:
                if name not in ("name", "weight"):
                    setattr(into, name, getattr(into, name) + getattr(t, name))
    return list(by_name.values())


# EngineStats' section fields and how each merges.
SECTION_MERGES: dict[str, Callable[[list[Any]], Any]] = {
    "pins": sum_fields,
    "tenants": merge_tenants,
    "spec": sum_fields,
    "lora": merge_lora,
    "kv_tiers": sum_fields,
    "kv_transfer": sum_fields,
    "stages": sum_fields,
}
