"""Per-tenant limits at the door: `--tenant-max-concurrency` and
`--tenant-max-requests-per-second`, answered with 429 and Retry-After.

A tenant (zllm/runtime/tenants.py: its API key's, else its X-Tenant header's, else
"default") may have at most `max_concurrency` generation requests (HTTP requests, however
many prompts each holds) in flight, and start at most `rate` per second, with a burst of
max(1, rate): a token bucket per tenant, refilled continuously. Both are checked before the
request's body is parsed, after the server-wide admission limit (503); a refused request
never reaches the engine and is counted in `zllm:tenant_requests_limited_total{tenant,
limit}`. Other tenants are not slowed: one tenant at its limit costs them nothing.

Limits bind authenticated tenants (API keys); an X-Tenant header without keys is a label
anyone can change, so under it the limits shape well-behaved clients only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from zllm.errors import RequestError

CONCURRENCY_RETRY_AFTER_S = 1
# Buckets kept before the full ones are forgotten: a full bucket is what a tenant without
# one gets, so dropping it changes nothing, and tenant names (X-Tenant) cannot grow memory.
MAX_IDLE_BUCKETS = 256


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class TenantLimits:
    def __init__(
        self,
        max_concurrency: int | None,
        rate: float | None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_concurrency = max_concurrency
        self.rate = rate
        self.burst = max(1.0, rate) if rate else 0.0
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        self.limited = Counter(
            "zllm:tenant_requests_limited",
            "Generation requests refused with 429 by a per-tenant limit "
            "(--tenant-max-concurrency, --tenant-max-requests-per-second).",
            ["tenant", "limit"],
            registry=registry,
        )

    @property
    def enabled(self) -> bool:
        return self.max_concurrency is not None or self.rate is not None

    def enter(self, tenant: str) -> RequestError | None:
        """Count a request of `tenant` in, or return the 429 to answer (nothing counted)."""
        running = self.in_flight.get(tenant, 0)
        if self.max_concurrency is not None and running >= self.max_concurrency:
            return self._refuse(
                tenant,
                "concurrency",
                f"Tenant {tenant!r} has {running} requests in flight, its limit "
                f"(--tenant-max-concurrency).",
                CONCURRENCY_RETRY_AFTER_S,
            )
        if self.rate is not None:
            wait_s = self._take(tenant)
            if wait_s > 0:
                return self._refuse(
                    tenant,
                    "rate",
                    f"Tenant {tenant!r} is over its rate of {self.rate:g} requests per "
                    f"second (--tenant-max-requests-per-second).",
                    max(1, math.ceil(wait_s)),
                )
        self.in_flight[tenant] = running + 1
        return None

    def leave(self, tenant: str) -> None:
        """A request `enter` let in has finished (its response is sent, or it failed)."""
        left = self.in_flight.get(tenant, 0) - 1
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)

    def _take(self, tenant: str) -> float:
        """Take one token of the tenant's bucket: 0, or the seconds until one is there."""
        assert self.rate is not None
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= MAX_IDLE_BUCKETS:
                self._forget_full_buckets(now)
            bucket = self._buckets[tenant] = _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate

    def _forget_full_buckets(self, now: float) -> None:
        assert self.rate is not None
        for name, b in list(self._buckets.items()):
            if b.tokens + (now - b.updated) * self.rate >= self.burst:
                del self._buckets[name]

    def _refuse(self, tenant: str, limit: str, message: str, retry_s: int) -> RequestError:
        self.limited.labels(tenant, limit).inc()
        return RequestError(
            f"{message} Retry after {retry_s} s.",
            status=429,
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_s)},
        )
