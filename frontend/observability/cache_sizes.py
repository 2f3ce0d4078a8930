"""/metrics' bounded caches (issue 56): `zllm:cache_entries` is the entries a cache that is
meant to grow holds now, `zllm:cache_capacity` its bound, one series per (process, cache,
engine). docs/observability.md has the table: what each cache holds, its bound, and where the
bound is set.

The frontend's own caches are read at scrape time through probes (`CacheSizes.watch`), with
engine "". The core's and its executor's come with each engine's heartbeat
(EngineStats.caches), labelled with the engine; the executor's reach the core with its step
outputs, so they show once it has run a step. A cache without a bound (CacheSize.capacity
None) would have no capacity series; every cache listed has one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from zllm.frontend.access.tenant_limits import MAX_BUCKETS, MAX_LIMITED_SERIES, TenantLimits
from zllm.frontend.lora_adapters import MAX_REGISTERED_ADAPTERS, LoRAAdapters
from zllm.protocol import CacheSize
from zllm.runtime.engine_client import EngineClient

CacheProbe = Callable[[], CacheSize]
LABELS = ["model_name", "process", "cache", "engine"]


class CacheSizes:
    """A Prometheus collector of every bounded cache: this frontend's probes, and each
    engine's caches from its latest heartbeat."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        self.probes: list[CacheProbe] = []

    def watch(self, cache: str, entries: Callable[[], int], capacity: int | None) -> None:
        """Show a cache of this frontend: `entries` reads its size at each scrape."""
        self.probes.append(lambda: CacheSize("frontend", cache, entries(), capacity))

    def rows(self) -> list[tuple[str, CacheSize]]:
        """(engine label, cache) of every cache: the frontend's first (engine "")."""
        rows = [("", probe()) for probe in self.probes]
        for engine in range(self.client.num_engines):
            stats = self.client.engine_stats.get(engine)
            if stats is not None:
                rows += [(str(engine), cache) for cache in stats.caches]
        return rows

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        entries = GaugeMetricFamily(
            "zllm:cache_entries",
            "Entries a cache that is meant to grow holds now (docs/observability.md lists them).",
            labels=LABELS,
        )
        capacity = GaugeMetricFamily(
            "zllm:cache_capacity",
            "The most entries the cache keeps (absent: it has no bound).",
            labels=LABELS,
        )
        for engine, cache in self.rows():
            labels = [self.model_name, cache.process, cache.cache, engine]
            entries.add_metric(labels, cache.entries)
            if cache.capacity is not None:
                capacity.add_metric(labels, cache.capacity)
        yield entries
        yield capacity


def watch_server_caches(caches: CacheSizes, limits: TenantLimits, adapters: LoRAAdapters) -> None:
    """The caches the server holds beside its metrics: the per-tenant limits' token buckets
    and limited series (bounds in frontend/access/tenant_limits.py), and the registered LoRA
    adapters (frontend/lora_adapters.py)."""
    # (Read by their private names: tenant_limits.py offers no size of its own yet.)
    caches.watch("tenant_rate_buckets", lambda: limits.num_buckets, MAX_BUCKETS)
    caches.watch("tenant_limited_series", lambda: limits.num_limited_series, MAX_LIMITED_SERIES)
    caches.watch("lora_adapters", lambda: len(adapters.by_name), MAX_REGISTERED_ADAPTERS)
