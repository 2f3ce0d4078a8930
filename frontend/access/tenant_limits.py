"""Per-tenant limits at the door: `--tenant-max-concurrency` and
`--tenant-max-requests-per-second`, answered with 429 and Retry-After.

A tenant (zllm/config/tenants.py: its API key's, else its X-Tenant header's, else
"default") may have at most `max_concurrency` generation requests (HTTP requests, however
many prompts each holds) in flight, and start at most `rate` per second, with a burst of
max(1, rate): a token bucket per tenant, refilled continuously. Both are checked before the
request's body is parsed, after the server-wide admission limit (503); a refused request
never reaches the engine and is counted in `zllm:tenant_requests_limited_total{tenant,
limit}`. Other tenants are not slowed: one tenant at its limit costs them nothing.

A tenant's own limits (an object in --tenant-weights: zllm/config/tenants.py) replace the
global ones for it, each limit on its own: `{"key-1": {"max_concurrency": 8}}` gives key-1
8 requests in flight and the global rate.

Limits bind authenticated tenants (API keys); an X-Tenant header without keys is a label
anyone can change, so under it the limits shape well-behaved clients only.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from zllm.config.tenants import TenantLimit
from zllm.errors import RequestError

CONCURRENCY_RETRY_AFTER_S = 1
# Buckets kept at most. Past it the full ones are forgotten first (a full bucket is what a
# tenant without one gets, so dropping it changes nothing), then, when more tenants than
# this were limited within one refill, the least recently used: that tenant starts again
# from a full bucket, as any new X-Tenant name does, and tenant names cannot grow memory.
MAX_BUCKETS = 256
# The zllm:tenant_requests_limited_total series kept (tenant, limit pairs; see _refuse).
MAX_LIMITED_SERIES = 256


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


@dataclass(frozen=True, slots=True)
class _Limits:
    """One tenant's limits in force, and the flag each comes from (for the 429's message)."""

    max_concurrency: int | None
    rate: float | None
    concurrency_flag: str
    rate_flag: str

    @property
    def burst(self) -> float:
        return max(1.0, self.rate) if self.rate else 0.0


_OWN = "its {} in --tenant-weights"


def _limits(default: TenantLimit, own: TenantLimit | None) -> _Limits:
    """A tenant's own limits where it has them, the global flags' elsewhere."""
    own = own or TenantLimit()
    concurrency, rate = own.max_concurrency, own.max_requests_per_second
    return _Limits(
        default.max_concurrency if concurrency is None else concurrency,
        default.max_requests_per_second if rate is None else rate,
        "--tenant-max-concurrency" if concurrency is None else _OWN.format("max_concurrency"),
        "--tenant-max-requests-per-second"
        if rate is None
        else _OWN.format("max_requests_per_second"),
    )


class TenantLimits:
    def __init__(
        self,
        max_concurrency: int | None,
        rate: float | None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        per_tenant: Mapping[str, TenantLimit] | None = None,
    ) -> None:
        default = TenantLimit(max_concurrency, rate)
        self.default = _limits(default, None)
        # Decided once per configured tenant; every other tenant has the defaults.
        self.per_tenant = {name: _limits(default, own) for name, own in (per_tenant or {}).items()}
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._limited_series: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.limited = Counter(
            "zllm:tenant_requests_limited",
            "Generation requests refused with 429 by a per-tenant limit "
            "(--tenant-max-concurrency, --tenant-max-requests-per-second).",
            ["tenant", "limit"],
            registry=registry,
        )

    @property
    def enabled(self) -> bool:
        return any(
            limits.max_concurrency is not None or limits.rate is not None
            for limits in (self.default, *self.per_tenant.values())
        )

    @property
    def num_buckets(self) -> int:
        """Rate buckets held (at most MAX_BUCKETS; /metrics' tenant_rate_buckets)."""
        return len(self._buckets)

    @property
    def num_limited_series(self) -> int:
        """Limited-request series kept (at most MAX_LIMITED_SERIES)."""
        return len(self._limited_series)

    def limits_of(self, tenant: str) -> _Limits:
        return self.per_tenant.get(tenant, self.default)

    def enter(self, tenant: str) -> RequestError | None:
        """Count a request of `tenant` in, or return the 429 to answer (nothing counted)."""
        limits = self.limits_of(tenant)
        running = self.in_flight.get(tenant, 0)
        if limits.max_concurrency is not None and running >= limits.max_concurrency:
            return self._refuse(
                tenant,
                "concurrency",
                f"Tenant {tenant!r} has {running} requests in flight, its limit "
                f"({limits.concurrency_flag}).",
                CONCURRENCY_RETRY_AFTER_S,
            )
        if limits.rate is not None:
            wait_s = self._take(tenant, limits)
            if wait_s > 0:
                return self._refuse(
                    tenant,
                    "rate",
                    f"Tenant {tenant!r} is over its rate of {limits.rate:g} requests per "
                    f"second ({limits.rate_flag}).",
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

    def _take(self, tenant: str, limits: _Limits) -> float:
        """Take one token of the tenant's bucket: 0, or the seconds until one is there."""
        rate, burst = limits.rate, limits.burst
        assert rate is not None
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._forget_full_buckets(now)
            while len(self._buckets) >= MAX_BUCKETS:
                oldest = min(self._buckets, key=lambda name: self._buckets[name].updated)
                del self._buckets[oldest]
            bucket = self._buckets[tenant] = _Bucket(burst, now)
        bucket.tokens = min(burst, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / rate

    def _forget_full_buckets(self, now: float) -> None:
        for name, b in list(self._buckets.items()):
            limits = self.limits_of(name)
            assert limits.rate is not None  # only rate-limited tenants have buckets
            if b.tokens + (now - b.updated) * limits.rate >= limits.burst:
                del self._buckets[name]

    def _refuse(self, tenant: str, limit: str, message: str, retry_s: int) -> RequestError:
        self.limited.labels(tenant, limit).inc()
        # Series of the most recently limited MAX_LIMITED_SERIES (tenant, limit) pairs are
        # kept: tenant names from X-Tenant cannot grow /metrics (a forgotten series that
        # comes back starts from 0, which Prometheus reads as a counter reset).
        self._limited_series[(tenant, limit)] = None
        self._limited_series.move_to_end((tenant, limit))
        if len(self._limited_series) > MAX_LIMITED_SERIES:
            oldest, _ = self._limited_series.popitem(last=False)
            self.limited.remove(*oldest)
        return RequestError(
            f"{message} Retry after {retry_s} s.",
            status=429,
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_s)},
        )
