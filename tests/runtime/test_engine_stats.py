"""EngineStats, the core's heartbeat: every field a section, each merged across data-parallel
engines by its own rule (zllm/runtime/engine_stats.py), and read by /metrics section by
section (frontend/observability/engine_metrics.py)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from zllm.frontend.observability.engine_metrics import EngineCollector
from zllm.protocol import (
    CacheSize,
    EngineStats,
    EngineStatus,
    FrontendInput,
    KVPoolStats,
    LoRAStats,
    PinStats,
    PrefixCacheStats,
    SchedulerLoad,
    SpecDecodeStats,
    StepTimings,
    TenantStats,
    TokenCounts,
)
from zllm.runtime.engine_stats import SECTION_MERGES, merge_stats


def test_every_field_is_a_section_with_its_merge_rule():
    """No engine-wide number sits loose in EngineStats: each field is a section (a Struct, or
    the tenants' list), and merge_stats knows how to merge every one."""
    assert list(SECTION_MERGES) == list(EngineStats.__struct_fields__)
    for field in msgspec.structs.fields(EngineStats):
        kinds = getattr(field.type, "__args__", (field.type,))
        sections = [k for k in kinds if k is not type(None)]
        assert len(sections) == 1, field.name
        section = sections[0]
        if getattr(section, "__origin__", None) is list:
            section = section.__args__[0]
        assert issubclass(section, msgspec.Struct), field.name


def test_merged_stats_sum_the_engines():
    one = EngineStats(
        status=EngineStatus(engine_index=0, time=5.0),
        load=SchedulerLoad(num_running=2, num_waiting=1),
        prefix_cache=PrefixCacheStats(queries=20, hits=10),
        steps=StepTimings(count=3, executor_busy_s=1.5),
        kv_pool=KVPoolStats(num_blocks=100, usage=0.5, block_states=b"\x01\x00"),
        spec=SpecDecodeStats(accepted_per_pos=[3, 1]),
        tenants=[TenantStats("t", 2.0, num_running=2, num_requests=5)],
    )
    two = EngineStats(
        status=EngineStatus(engine_index=1, time=7.0),
        load=SchedulerLoad(num_running=1),
        prefix_cache=PrefixCacheStats(queries=8, hits=4),
        steps=StepTimings(count=2, executor_busy_s=0.5),
        kv_pool=KVPoolStats(num_blocks=300, usage=0.0, block_states=b"\x02"),
        spec=SpecDecodeStats(accepted_per_pos=[2]),
        tenants=[TenantStats("t", 2.0, num_requests=1), TenantStats("u")],
    )
    merged = merge_stats([one, two])
    assert (merged.load.num_running, merged.load.num_waiting) == (3, 1)
    assert (merged.prefix_cache.queries, merged.prefix_cache.hits) == (28, 14)
    assert (merged.steps.count, merged.steps.executor_busy_s) == (5, 2.0)
    assert merged.kv_pool.usage == pytest.approx(0.125)  # 50 of 400 blocks
    assert merged.kv_pool.num_blocks == 400 and merged.status.time == 7.0
    assert merged.kv_pool.block_states == b"\x01\x00\x02"
    assert merged.spec.accepted_per_pos == [5, 1] and merged.lora is None
    tenants = {t.name: t for t in merged.tenants}
    assert tenants["t"].num_requests == 6 and tenants["t"].weight == 2.0
    assert set(tenants) == {"t", "u"}
    assert merge_stats([one]) is one


def test_merged_status_and_kv_pools_follow_their_own_rules():
    """Asleep only when every engine is, no one engine's index; the widest block and cell
    sizes; and usage 0 (not a division by zero) before any pool is sized."""
    asleep = EngineStats(
        status=EngineStatus(engine_index=2, time=3.0, asleep=True),
        kv_pool=KVPoolStats(block_bytes=4096, blocks_per_cell=1),
        lora=LoRAStats(["b"], [], 2),
    )
    awake = EngineStats(
        status=EngineStatus(engine_index=1, time=4.0),
        kv_pool=KVPoolStats(block_bytes=8192, blocks_per_cell=3),
        lora=LoRAStats(["a"], ["c"], 1),
    )
    merged = merge_stats([asleep, awake])
    assert merged.status == EngineStatus(engine_index=0, time=4.0, asleep=False)
    assert (merged.kv_pool.block_bytes, merged.kv_pool.blocks_per_cell) == (8192, 3)
    assert merged.kv_pool.usage == 0.0
    assert merged.lora == LoRAStats(["a", "b"], ["c"], 2)
    awake.status.asleep = True
    assert merge_stats([asleep, awake]).status.asleep


def test_merged_caches_sum_each_cache_across_engines():
    """Each engine's core and executor hold their own caches: the server's entries and bound
    are the sums, by (process, cache); one engine without a bound leaves the sum without."""
    one = EngineStats(
        caches=[
            CacheSize("core", "tenant_ledger", 3, 258),
            CacheSize("executor", "structured_output_grammars", 5, 256),
            CacheSize("executor", "odd", 1, None),
        ]
    )
    two = EngineStats(
        caches=[
            CacheSize("executor", "structured_output_grammars", 2, 256),
            CacheSize("core", "tenant_ledger", 1, 257),
            CacheSize("executor", "odd", 4, 9),
            CacheSize("executor", "lora_weights", 1, 2),
        ]
    )
    merged = merge_stats([one, two])
    assert merged.caches == [
        CacheSize("core", "tenant_ledger", 4, 515),
        CacheSize("executor", "structured_output_grammars", 7, 512),
        CacheSize("executor", "odd", 5, None),
        CacheSize("executor", "lora_weights", 1, 2),
    ]
    assert one.caches[0] == CacheSize("core", "tenant_ledger", 3, 258)  # the inputs unchanged
    assert merge_stats([EngineStats(), EngineStats()]).caches == []


def test_a_heartbeat_crosses_the_wire_whole():
    stats = EngineStats(
        status=EngineStatus(engine_index=1, time=12.5, asleep=True),
        load=SchedulerLoad(4, 2, 1),
        tokens=TokenCounts(prompt=100, generated=7),
        kv_pool=KVPoolStats(num_blocks=16, num_free_blocks=9, block_states=b"\x00\x01"),
        pins=PinStats(3, 8),
        caches=[CacheSize("core", "prefix_pins", 2, 10), CacheSize("frontend", "x", 1)],
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=FrontendInput)
    assert decoded == stats


def _scrape(stats: EngineStats) -> dict[str, float]:
    """What /metrics' engine collector exports for one engine: name -> value (the engine's
    single series of each metric that has one)."""
    client = SimpleNamespace(engine_stats={0: stats}, num_engines=1, num_in_flight=0, processes={})
    samples = {}
    for metric in EngineCollector(client, "m").collect():  # type: ignore[arg-type]
        for sample in metric.samples:
            if sample.labels.get("engine") == "0" and len(sample.labels) == 2:
                samples[sample.name] = sample.value
    return samples


def test_metrics_read_each_number_from_its_section():
    """Each engine series reads its own field (distinct values, so a swapped reader shows)."""
    stats = EngineStats(
        load=SchedulerLoad(num_running=3, num_waiting=5, num_preemptions=7),
        tokens=TokenCounts(prompt=11, generated=13),
        prefix_cache=PrefixCacheStats(queries=17, hits=19),
        steps=StepTimings(23, 29, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5),
        kv_pool=KVPoolStats(num_blocks=40, usage=0.25, block_bytes=1024),
        pins=PinStats(pinned_blocks=2, max_pinned_blocks=6),
    )
    assert _scrape(stats) == {
        "vllm:num_requests_running": 3,
        "vllm:num_requests_waiting": 5,
        "vllm:kv_cache_usage_perc": 0.25,
        "vllm:prompt_tokens_total": 11,
        "vllm:generation_tokens_total": 13,
        "vllm:num_preemptions_total": 7,
        "vllm:prefix_cache_queries_total": 17,
        "vllm:prefix_cache_hits_total": 19,
        "zllm:engine_steps_total": 23,
        "zllm:executor_overlapped_steps_total": 29,
        "zllm:executor_busy_seconds_total": 1.5,
        "zllm:executor_idle_seconds_total": 2.5,
        "zllm:executor_prepare_seconds_total": 3.5,
        "zllm:executor_forward_seconds_total": 4.5,
        "zllm:executor_sample_seconds_total": 5.5,
        "zllm:gpu_idle_seconds_total": 6.5,
        "zllm:core_schedule_seconds_total": 7.5,
        "zllm:core_output_seconds_total": 8.5,
        "zllm:kv_pinned_blocks": 2,
        "zllm:kv_pinned_bytes": 2 * 1024,
        "zllm:kv_max_pinned_bytes": 6 * 1024,
    }
