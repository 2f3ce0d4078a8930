"""Several engines' heartbeats (`EngineStats`, one per data-parallel replica) as one: the
dashboard's and /health's totals. `EngineStats` is all sections, and each section merges by its
own rule (`SECTION_MERGES`): counts and times summed, the KV pools' usage weighed by their sizes
and their cells side by side, the status the latest and asleep only if all are, each cache's
entries and bound summed. A feature's section that is None on every engine stays None."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zllm.protocol import (
    CacheSize,
    EngineStats,
    EngineStatus,
    KVPoolStats,
    LoRAStats,
    TenantStats,
)


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    if len(stats) == 1:
        return stats[0]
    merged = EngineStats()
    for section, merge in SECTION_MERGES.items():
        present = [value for s in stats if (value := getattr(s, section)) is not None]
        setattr(merged, section, merge(present) if present else None)
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


def merge_status(sections: list[EngineStatus]) -> EngineStatus:
    """The latest heartbeat's time; asleep only when every engine is; no one engine's index."""
    return EngineStatus(
        engine_index=0,
        time=max(s.time for s in sections),
        asleep=all(s.asleep for s in sections),
    )


def merge_kv_pools(sections: list[KVPoolStats]) -> KVPoolStats:
    """The pools as one: blocks and slots summed, usage weighed by each pool's blocks, the
    cells side by side (each pool's at the widest pool's cell size and block size)."""
    merged = KVPoolStats(
        num_blocks=sum(s.num_blocks for s in sections),
        num_free_blocks=sum(s.num_free_blocks for s in sections),
        block_bytes=max(s.block_bytes for s in sections),
        slots_allocated=sum(s.slots_allocated for s in sections),
        slots_used=sum(s.slots_used for s in sections),
        block_states=b"".join(s.block_states for s in sections),
        blocks_per_cell=max(s.blocks_per_cell for s in sections),
    )
    if merged.num_blocks:
        merged.usage = sum(s.usage * s.num_blocks for s in sections) / merged.num_blocks
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


def merge_caches(per_engine: list[list[CacheSize]]) -> list[CacheSize]:
    """Summed by (process, cache): each engine's core and executor hold caches of their own,
    so the server's memory holds the sum of their entries, bounded by the sum of their
    bounds (no bound where one has none). /metrics shows each engine's apart."""
    by_key: dict[tuple[str, str], CacheSize] = {}
    for caches in per_engine:
        for c in caches:
            into = by_key.get((c.process, c.cache))
            if into is None:
                by_key[(c.process, c.cache)] = CacheSize(c.process, c.cache, c.entries, c.capacity)
                continue
            into.entries += c.entries
            if into.capacity is None or c.capacity is None:
                into.capacity = None
            else:
                into.capacity += c.capacity
    return list(by_key.values())


# Every section of EngineStats and how it merges (tests/test_engine_stats.py checks that each
# has its rule).
SECTION_MERGES: dict[str, Callable[[list[Any]], Any]] = {
    "status": merge_status,
    "load": sum_fields,
    "tokens": sum_fields,
    "prefix_cache": sum_fields,
    "steps": sum_fields,
    "kv_pool": merge_kv_pools,
    "pins": sum_fields,
    "tenants": merge_tenants,
    "spec": sum_fields,
    "lora": merge_lora,
    "kv_tiers": sum_fields,
    "kv_transfer": sum_fields,
    "stages": sum_fields,
    "caches": merge_caches,
}
