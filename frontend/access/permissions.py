"""Who may call a route (`Access`, the route table's column: frontend/routes.py), and what a
reader of the observability routes (/metrics, /dashboard/stats) sees (`Viewer`).

Under `--prefix-cache-isolation tenant` no tenant reuses another's cached prefixes; where
the observability routes are protected, no tenant sees another's hits there either:

    the reader (the Gate decides: frontend/access/middleware.py)      sees
    anyone, where the routes are open (no --protect-metrics)   every series
    an --api-key under --prefix-cache-isolation none           every series
    a --metrics-api-key                                        every series
    an --api-key under --prefix-cache-isolation tenant         its tenant's view

A tenant's view keeps the series without a `tenant` label (load, latency, KV usage: the
engine's as a whole), keeps the `tenant`-labelled series of its own tenant only, and drops
the engine's prefix-cache and tier hit counters, which sum every tenant's hits: its own
are `zllm:tenant_prefix_cache_{queries,hits}_total` (frontend/observability/tenant_prefix_hits.py). Open
routes show everything to everyone (a tenant could always leave its key off), so keeping
tenants' hits apart takes --protect-metrics.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric


class Access(enum.Enum):
    """Which key a route needs (frontend/access/middleware.py)."""

    API = "api"  # an --api-key, when keys are set
    # Open, or with --protect-metrics an --api-key (under tenant isolation: its tenant's
    # view) or a --metrics-api-key (every tenant's).
    OBSERVABILITY = "observability"
    PUBLIC = "public"  # never a key: /health, which load balancers probe without one


VIEWER_KEY = "zllm.viewer"  # where the Gate puts an observability request's Viewer

# The engine's own hit counters: every tenant's hits summed (names without `_total`).
CROSS_TENANT_METRICS = frozenset(
    {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "zllm:kv_offload_hits"}
)


@dataclass(frozen=True, slots=True)
class Viewer:
    """A reader of the observability routes: one tenant, or None for every tenant's."""

    tenant: str | None = None

    @property
    def sees_all(self) -> bool:
        return self.tenant is None

    def sees(self, tenant: str) -> bool:
        return self.tenant is None or tenant == self.tenant


EVERYONE = Viewer()


class RegistryView:
    """A registry as `viewer` may see it (a collector for prometheus_client's exposition)."""

    def __init__(self, registry: CollectorRegistry, viewer: Viewer) -> None:
        self.registry = registry
        self.viewer = viewer

    def collect(self) -> Iterator[Metric]:
        viewer = self.viewer
        for metric in self.registry.collect():
            if viewer.sees_all:
                yield metric
                continue
            if metric.name in CROSS_TENANT_METRICS:
                continue
            seen = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            seen.samples = [
                s
                for s in metric.samples
                if "tenant" not in s.labels or viewer.sees(s.labels["tenant"])
            ]
            yield seen  # (with no sample left, its HELP and TYPE lines tell nothing)
