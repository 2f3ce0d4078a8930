"""Each tenant's prefix-cache hits, as its responses report them.

`zllm:tenant_prefix_cache_queries_total{tenant}` counts the prompt tokens of the tenant's
engine requests (one per prompt, once it is scheduled) and
`zllm:tenant_prefix_cache_hits_total{tenant}` the tokens of those found cached: what its
responses' `usage.prompt_tokens_details.cached_tokens` add up to, so a tenant can check
one against the other. The whole engine's `vllm:prefix_cache_{queries,hits}_total` count
every lookup of every tenant (a preempted request's again); under tenant isolation a
tenant's own view of /metrics has only these (frontend/access/permissions.py).

The frontend counts them, since it knows each request's tenant and cached tokens; the
most recently counted `MAX_TENANTS` are kept (a tenant forgotten and back starts again
from 0, which Prometheus reads as a counter reset), so tenant names from X-Tenant cannot
grow the frontend's memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric

MAX_TENANTS = 256


@dataclass(slots=True)
class PrefixHits:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class TenantPrefixHits:
    """A Prometheus collector of each tenant's `PrefixHits` (least recently counted first)."""

    def __init__(self, model_name: str, max_tenants: int = MAX_TENANTS) -> None:
        self.model_name = model_name
        self.max_tenants = max_tenants
        self.tenants: OrderedDict[str, PrefixHits] = OrderedDict()

    def count(self, tenant: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """One engine request of `tenant` was scheduled, with this many of its prompt's
        tokens cached."""
        hits = self.tenants.get(tenant)
        if hits is None:
            if len(self.tenants) >= self.max_tenants:
                self.tenants.popitem(last=False)
            hits = self.tenants[tenant] = PrefixHits()
        else:
            self.tenants.move_to_end(tenant)
        hits.queries += num_prompt_tokens
        hits.hits += num_cached_tokens

    def of(self, tenant: str) -> PrefixHits:
        return self.tenants.get(tenant) or PrefixHits()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name, doc, attr in (
            ("zllm:tenant_prefix_cache_queries",
             "Prompt tokens of the tenant's requests looked up in the prefix cache.", "queries"),
            ("zllm:tenant_prefix_cache_hits",
             "Prompt tokens of the tenant's requests found in the prefix cache (its usage's "
             "cached_tokens).", "hits"),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=["model_name", "tenant"])
            for tenant, hits in sorted(self.tenants.items()):
                family.add_metric([self.model_name, tenant], getattr(hits, attr))
            yield family
