"""Per-tenant limits (frontend/tenant_limits.py): `--tenant-max-concurrency` and
`--tenant-max-requests-per-second`, 429 with Retry-After, counted per tenant in /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from servers import metric, start_server, stop_server

from zllm.frontend.tenant_limits import TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limited_count(registry: CollectorRegistry, tenant: str, limit: str) -> float:
    value = registry.get_sample_value(
        "zllm:tenant_requests_limited_total", {"tenant": tenant, "limit": limit}
    )
    return value or 0.0


def test_concurrency_limit_is_per_tenant():
    registry = CollectorRegistry()
    limits = TenantLimits(2, None, registry, Clock())
    assert limits.enter("a") is None and limits.enter("a") is None
    refusal = limits.enter("a")
    assert refusal is not None and refusal.status == 429
    assert refusal.headers == {"Retry-After": "1"} and "--tenant-max-concurrency" in refusal.message
    assert limits.enter("b") is None  # another tenant is not held back
    limits.leave("a")
    assert limits.enter("a") is None  # a slot came free
    assert limits.in_flight == {"a": 2, "b": 1}
    for tenant in ("a", "a", "b"):
        limits.leave(tenant)
    assert limits.in_flight == {}
    assert limited_count(registry, "a", "concurrency") == 1
    assert limited_count(registry, "b", "concurrency") == 0


@pytest.mark.parametrize(("rate", "burst", "retry_after"), [(2.0, 2, "1"), (0.25, 1, "4")])
def test_rate_limit_is_a_token_bucket_per_tenant(rate, burst, retry_after):
    registry, clock = CollectorRegistry(), Clock()
    limits = TenantLimits(None, rate, registry, clock)
    for _ in range(burst):  # a burst of max(1, rate) at once
        assert limits.enter("a") is None
        limits.leave("a")
    refusal = limits.enter("a")
    assert refusal is not None and refusal.status == 429
    assert refusal.headers == {"Retry-After": retry_after}
    assert limits.enter("b") is None  # b's bucket is its own
    clock.now += 1.0 / rate - 1e-6  # just short of one token
    assert limits.enter("a") is not None
    clock.now += 2e-6
    assert limits.enter("a") is None
    clock.now += 3600  # refills up to the burst, no further
    for _ in range(burst):
        assert limits.enter("a") is None
    assert limits.enter("a") is not None
    assert limited_count(registry, "a", "rate") == 3


def test_buckets_of_idle_tenants_are_forgotten():
    """Many tenant names (X-Tenant is anyone's to choose) do not grow the buckets past the
    bound; a forgotten tenant's bucket was full, so it gets its whole burst again."""
    from zllm.frontend.tenant_limits import MAX_IDLE_BUCKETS

    clock = Clock()
    limits = TenantLimits(None, 1.0, CollectorRegistry(), clock)
    assert limits.enter("t0") is None and limits.enter("t0") is not None  # t0's one is used
    for i in range(1, 5 * MAX_IDLE_BUCKETS):
        clock.now += 0.01
        assert limits.enter(f"t{i}") is None
        limits.leave(f"t{i}")
    assert len(limits._buckets) <= MAX_IDLE_BUCKETS
    assert limits.enter("t0") is None  # refilled long ago: full, as a new one
    limits.leave("t0")
    assert limits.enter(f"t{5 * MAX_IDLE_BUCKETS - 1}") is not None  # a recent one is kept


def test_no_limits_by_default():
    limits = TenantLimits(None, None, CollectorRegistry())
    assert not limits.enabled
    assert all(limits.enter("a") is None for _ in range(1000))


@pytest.mark.e2e
def test_tenant_limits_through_the_openai_client(tiny_llama_dir, tmp_path):
    """Two API keys (tenants key-1, key-2), at most 1 request in flight and one start per 4 s
    each: key-1's second request while its first streams gets 429 (concurrency), its next
    one after the first ends gets 429 (rate) with Retry-After; key-2 is served meanwhile."""
    server = start_server(
        tiny_llama_dir, tmp_path / "serve.log",
        "--api-key", "k1", "--api-key", "k2",
        "--tenant-max-concurrency", "1", "--tenant-max-requests-per-second", "0.25",
    )  # fmt: skip
    try:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)

        model = client("k1").models.list().data[0].id
        long = {"model": model, "prompt": "Once", "max_tokens": 200, "ignore_eos": True,
                "stream": True}  # fmt: skip
        headers = {"Authorization": "Bearer k1"}
        with httpx.stream("POST", server.url + "/v1/completions", json=long, headers=headers,
                          timeout=60) as streaming:  # fmt: skip
            assert streaming.status_code == 200
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it is running
            with pytest.raises(openai.RateLimitError) as refused:
                client("k1").completions.create(model=model, prompt="Hi", max_tokens=2)
            assert refused.value.response.headers["retry-after"] == "1"
            assert "--tenant-max-concurrency" in refused.value.message
            served = client("k2").completions.create(model=model, prompt="Hi", max_tokens=2)
            assert served.usage.completion_tokens == 2
            for _ in lines:  # the first request runs to its end
                pass
        with pytest.raises(openai.RateLimitError) as refused:  # within 4 s of the first
            client("k1").completions.create(model=model, prompt="Hi", max_tokens=2)
        assert 1 <= int(refused.value.response.headers["retry-after"]) <= 4
        assert "--tenant-max-requests-per-second" in refused.value.message
        text = server.get("/metrics", headers={"Authorization": "Bearer k1"}).text
        for limit in ("concurrency", "rate"):
            labels = f'limit="{limit}",tenant="key-1"'  # labels come sorted
            assert metric(text, "zllm:tenant_requests_limited_total", labels) == 1
        limited = [x for x in text.splitlines() if x.startswith("zllm:tenant_requests_limited")]
        assert limited and not [x for x in limited if 'tenant="key-2"' in x]  # never limited
    finally:
        stop_server(server)
