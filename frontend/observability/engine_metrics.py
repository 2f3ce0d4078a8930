"""/metrics' engine series: the latest core heartbeat of each engine (`engine` label) and the
supervisor's process table, read at scrape time by `EngineCollector`, which frontend/observability/metrics.py
registers beside the frontend's own request metrics (the table there lists every series)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from zllm.kv.tiers import TIER_NAMES
from zllm.protocol import EngineStats, KVRejection
from zllm.runtime.engine_client import EngineClient

# (name, help) of the heartbeat's gauges and counters, and what each reads of EngineStats.
_GAUGES = (
    ("vllm:num_requests_running", "Requests in the running batch.",
     lambda s: s.load.num_running),
    ("vllm:num_requests_waiting", "Requests queued for the scheduler.",
     lambda s: s.load.num_waiting),
    ("vllm:kv_cache_usage_perc", "Share of KV blocks held by requests (1 = full).",
     lambda s: s.kv_pool.usage),
)  # fmt: skip
_COUNTERS = (
    ("vllm:prompt_tokens", "Prompt tokens of admitted requests.", lambda s: s.tokens.prompt),
    ("vllm:generation_tokens", "Tokens generated.", lambda s: s.tokens.generated),
    ("vllm:num_preemptions", "Requests preempted by the scheduler.",
     lambda s: s.load.num_preemptions),
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.prefix_cache.queries),
    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda s: s.prefix_cache.hits),
    ("zllm:engine_steps", "Steps the executor finished.", lambda s: s.steps.count),
    ("zllm:executor_overlapped_steps",
     "Steps launched before the step ahead of them had finished (--async-executor).",
     lambda s: s.steps.overlapped),
    ("zllm:executor_busy_seconds", "Seconds the executor spent computing steps.",
     lambda s: s.steps.executor_busy_s),
    ("zllm:executor_idle_seconds", "Seconds the executor waited for its next step.",
     lambda s: s.steps.executor_idle_s),
    ("zllm:executor_prepare_seconds",
     "Seconds the executor spent preparing step inputs and attention metadata.",
     lambda s: s.steps.executor_prepare_s),
    ("zllm:executor_forward_seconds",
     "Seconds the executor spent in the model forward (on a GPU: enqueueing it).",
     lambda s: s.steps.executor_forward_s),
    ("zllm:executor_sample_seconds",
     "Seconds the executor spent on logits, sampling and building step outputs.",
     lambda s: s.steps.executor_sample_s),
    ("zllm:gpu_idle_seconds",
     "Seconds the GPU had no kernel between steps (CUDA events; 0 on CPU).",
     lambda s: s.steps.gpu_idle_s),
    ("zllm:core_schedule_seconds", "Seconds the core spent in the scheduler choosing steps.",
     lambda s: s.steps.core_schedule_s),
    ("zllm:core_output_seconds",
     "Seconds the core spent applying step outputs (stops, publishing, freeing blocks).",
     lambda s: s.steps.core_output_s),
)  # fmt: skip


# Speculative decoding (only when the engine speculates: EngineStats.spec, whose per-
# position list has one entry per proposal position).
_SPEC_COUNTERS = (
    (
        "vllm:spec_decode_num_drafts",
        "Request steps that verified proposed tokens.",
        "num_drafts",
    ),
    ("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", "num_draft_tokens"),
    (
        "vllm:spec_decode_num_accepted_tokens",
        "Proposed tokens accepted.",
        "num_accepted_tokens",
    ),
)


class EngineCollector:
    """Reads the latest engine heartbeat and the process table at scrape time."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        client = self.client
        # One label set per engine (a data-parallel replica), each from its latest heartbeat.
        engines = [
            ([self.model_name, str(e)], client.engine_stats.get(e) or EngineStats())
            for e in range(client.num_engines)
        ]
        yield from _per_engine(GaugeMetricFamily, _GAUGES, engines, _read)
        g = GaugeMetricFamily(
            "zllm:num_requests_in_flight",
            "Engine requests (one per prompt) this frontend is serving.",
            labels=["model_name"],
        )
        g.add_metric([self.model_name], client.num_in_flight)
        yield g
        yield from _per_engine(CounterMetricFamily, _COUNTERS, engines, _read)
        yield from _pin_metrics(engines)
        yield from _tenant_metrics(engines)
        # A feature's section, exported while some engine has it on.
        for section, export in _SECTION_METRICS:
            present = [(label, s) for label, s in engines if getattr(s, section) is not None]
            if present:
                yield from export(present)
        up = GaugeMetricFamily(
            "zllm:process_up",
            "1 while the process (role, index; engine for a core or executor rank) runs, 0 "
            "while it is down.",
            labels=["model_name", "role", "index", "engine"],
        )
        for key, alive in sorted(client.processes.items()):
            engine = str(key[2]) if len(key) > 2 else ""
            up.add_metric([self.model_name, key[0], str(key[1]), engine], 1.0 if alive else 0.0)
        yield up


# Per engine: what each series of an EngineStats-derived metric is labelled with.
ENGINE_LABELS = ["model_name", "engine"]
PerEngine = list[tuple[list[str], EngineStats]]


def _per_engine(
    family: type, specs: tuple, engines: PerEngine, value: Callable[[EngineStats, Any], float]
) -> Iterator[Metric]:
    """A metric of one series per engine for each (name, doc, key) of `specs`: the series'
    value is value(engine's stats, key)."""
    for name, doc, key in specs:
        metric = family(name, doc, labels=ENGINE_LABELS)
        for label, s in engines:
            metric.add_metric(label, value(s, key))
        yield metric


def _read(s: EngineStats, read: Callable[[EngineStats], float]) -> float:
    """A spec's reader applied to an engine's stats (`_per_engine`'s value)."""
    return read(s)


def _pin_metrics(engines: PerEngine) -> Iterator[Metric]:
    """Prefix pinning: what is pinned now and the bound (--max-pinned-bytes)."""
    pins = (
        ("zllm:kv_pinned_blocks", "KV blocks pinned by requests' cache_control.",
         lambda s: s.pins.pinned_blocks),
        ("zllm:kv_pinned_bytes", "KV cache bytes pinned by requests' cache_control.",
         lambda s: s.pins.pinned_blocks * s.kv_pool.block_bytes),
        ("zllm:kv_max_pinned_bytes", "The most KV cache bytes requests may pin.",
         lambda s: s.pins.max_pinned_blocks * s.kv_pool.block_bytes),
    )  # fmt: skip
    yield from _per_engine(GaugeMetricFamily, pins, engines, _read)


# Per tenant (EngineStats.tenants; zllm/config/tenants.py): (name, doc, TenantStats attribute).
_TENANT_GAUGES = (
    ("zllm:tenant_requests_running", "Sequences of the tenant running now.", "num_running"),
    ("zllm:tenant_requests_waiting", "Sequences of the tenant waiting now.", "num_waiting"),
    ("zllm:tenant_weight", "The tenant's weight under --scheduling-policy fair.", "weight"),
)
_TENANT_COUNTERS = (
    ("zllm:tenant_requests", "Engine requests (one per prompt) the tenant sent.",
     "num_requests"),
    ("zllm:tenant_computed_tokens",
     "Tokens the engine computed for the tenant (prompt chunks and decodes): what fair "
     "share weighs.", "num_computed_tokens"),
    ("zllm:tenant_generation_tokens", "Tokens generated for the tenant.",
     "num_generation_tokens"),
    ("zllm:tenant_preemptions", "Sequences of the tenant preempted.", "num_preemptions"),
)  # fmt: skip


def _tenant_metrics(engines: PerEngine) -> Iterator[Metric]:
    """One series per tenant each core remembers (active ones, and the most recently active
    idle ones: core/fair_share.py MAX_IDLE_TENANTS)."""
    for family, specs in (
        (GaugeMetricFamily, _TENANT_GAUGES),
        (CounterMetricFamily, _TENANT_COUNTERS),
    ):
        for name, doc, attr in specs:
            metric = family(name, doc, labels=[*ENGINE_LABELS, "tenant"])
            for label, s in engines:
                for tenant in s.tenants:
                    metric.add_metric([*label, tenant.name], getattr(tenant, attr))
            yield metric


# KV offload, one series per tier (KVTierStats, zllm/kv/tiers.py's tier order).
_TIER_COUNTERS = (
    ("zllm:kv_offload_hits", "Prompt tokens loaded from the tier instead of computed.",
     "hits"),
    ("zllm:kv_offload_stored_blocks",
     "Blocks stored in the tier: evicted from the KV pool (cpu, disk), received from a "
     "prefill instance (remote).", "stores"),
    ("zllm:kv_offload_load_failures",
     "Blocks the tier could not load (missing or corrupt), recomputed instead.",
     "load_failures"),
)  # fmt: skip
_TIER_GAUGES = (
    ("zllm:kv_offload_blocks", "Blocks the tier holds.", "blocks"),
    ("zllm:kv_offload_capacity_blocks", "Blocks the tier can hold.", "capacity"),
)


def _kv_offload_metrics(engines: PerEngine) -> Iterator[Metric]:
    """Per configured tier; its hit rate is zllm:kv_offload_hits over vllm:prefix_cache_
    queries, as the pool's is vllm:prefix_cache_hits over the same."""
    for family, specs in ((CounterMetricFamily, _TIER_COUNTERS), (GaugeMetricFamily, _TIER_GAUGES)):
        for name, doc, attr in specs:
            metric = family(name, doc, labels=[*ENGINE_LABELS, "tier"])
            for label, s in engines:
                values = getattr(s.kv_tiers, attr)
                for i, capacity in enumerate(s.kv_tiers.capacity):
                    if capacity:
                        metric.add_metric([*label, TIER_NAMES[i]], values[i])
            yield metric


def _pipeline_metrics(engines: PerEngine) -> Iterator[Metric]:
    """Pipeline parallel, per stage: seconds working on steps and waiting (for the step, and
    for the stage before); idle over idle + busy is the stage's bubble."""
    for name, doc, attr in (
        ("zllm:pipeline_stage_busy_seconds", "Seconds the pipeline stage worked on steps.",
         "busy_s"),
        ("zllm:pipeline_stage_idle_seconds",
         "Seconds the pipeline stage waited for a step or for the stage before.",
         "idle_s"),
    ):  # fmt: skip
        c = CounterMetricFamily(name, doc, labels=[*ENGINE_LABELS, "stage"])
        for label, s in engines:
            for stage, value in enumerate(getattr(s.stages, attr)):
                c.add_metric([*label, str(stage)], value)
        yield c


def _kv_transfer_metrics(engines: PerEngine) -> Iterator[Metric]:
    """Prefill/decode disaggregation (the consumer's received blocks and their hits are the
    kv_offload series with tier="remote")."""
    counters = (
        ("zllm:kv_transfer_sent_blocks",
         "Prompt KV blocks a prefill instance had its executor send (one its consumer does "
         "not take is dropped, and computed there).", "sent_blocks"),
        ("zllm:kv_transfer_wait_timeouts",
         "Requests a decode instance admitted before all their KV blocks came (it computed "
         "the rest).", "wait_timeouts"),
    )  # fmt: skip
    yield from _per_engine(
        CounterMetricFamily, counters, engines, lambda s, attr: getattr(s.kv_transfer, attr)
    )
    rejected = CounterMetricFamily(
        "zllm:kv_transfer_rejected_blocks",
        "KV blocks a decode instance refused (each executor rank's part counts): reason "
        '"layout" for another model, other weights or another KV layout (a misconfigured '
        'pair: each is logged as an error), "invalid" for a malformed message or an '
        "unreadable shared-memory file. Refused blocks are computed.",
        labels=[*ENGINE_LABELS, "reason"],
    )
    for label, s in engines:
        counts = s.kv_transfer.rejected_blocks
        for reason in KVRejection:
            count = counts[reason] if reason < len(counts) else 0
            rejected.add_metric([*label, str(reason)], count)
    yield rejected


def _lora_info(engines: PerEngine) -> Iterator[Metric]:
    """vLLM's vllm:lora_requests_info: the adapters in use as labels (comma-separated), the
    heartbeat's time as the value."""
    g = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running and waiting LoRA adapters (labels), as of the value's time.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters", "engine"],
    )
    for (_, engine), s in engines:
        lora = s.lora
        running, waiting = ",".join(lora.running_adapters), ",".join(lora.waiting_adapters)
        g.add_metric([str(lora.max_lora), running, waiting, engine], s.status.time)
    yield g


def _spec_decode_metrics(engines: PerEngine) -> Iterator[Metric]:
    yield from _per_engine(
        CounterMetricFamily, _SPEC_COUNTERS, engines, lambda s, attr: getattr(s.spec, attr)
    )
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted proposed tokens, by position in the proposal (0 = the first).",
        labels=[*ENGINE_LABELS, "position"],
    )
    for label, s in engines:
        for position, count in enumerate(s.spec.accepted_per_pos):
            per_pos.add_metric([*label, str(position)], count)
    yield per_pos


# EngineStats' feature sections and their exporters, in /metrics order.
_SECTION_METRICS = (
    ("kv_tiers", _kv_offload_metrics),
    ("spec", _spec_decode_metrics),
    ("lora", _lora_info),
    ("stages", _pipeline_metrics),
    ("kv_transfer", _kv_transfer_metrics),
)
