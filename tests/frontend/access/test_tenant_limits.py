"""Per-tenant limits (frontend/access/tenant_limits.py): `--tenant-max-concurrency` and
`--tenant-max-requests-per-second`, or a tenant's own in --tenant-weights; 429 with
Retry-After, counted per tenant in /metrics."""

from __future__ import annotations

import argparse
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest
from openai.types import Completion
from prometheus_client import CollectorRegistry
from servers import Server, metric, wait_until

from zllm.config.engine_args import EngineArgs
from zllm.config.tenants import TenantLimit, TenantPolicy, parse_tenant_weights
from zllm.frontend.access.tenant_limits import TenantLimits


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
    from zllm.frontend.access.tenant_limits import MAX_BUCKETS

    clock = Clock()
    limits = TenantLimits(None, 1.0, CollectorRegistry(), clock)
    assert limits.enter("t0") is None and limits.enter("t0") is not None  # t0's one is used
    for i in range(1, 5 * MAX_BUCKETS):
        clock.now += 0.01
        assert limits.enter(f"t{i}") is None
        limits.leave(f"t{i}")
    assert len(limits._buckets) <= MAX_BUCKETS
    assert limits.enter("t0") is None  # refilled long ago: full, as a new one
    limits.leave("t0")
    assert limits.enter(f"t{5 * MAX_BUCKETS - 1}") is not None  # a recent one is kept


def test_buckets_stay_bounded_when_every_tenant_is_recent():
    """More tenants than the bound, all within one refill (none full to forget): the least
    recently used bucket gives way, so the table never passes its bound (issue 56)."""
    from zllm.frontend.access.tenant_limits import MAX_BUCKETS

    clock = Clock()
    limits = TenantLimits(None, 0.001, CollectorRegistry(), clock)  # a token every 1,000 s
    for i in range(3 * MAX_BUCKETS):
        clock.now += 0.001
        assert limits.enter(f"t{i}") is None
        limits.leave(f"t{i}")
        assert len(limits._buckets) <= MAX_BUCKETS
    assert limits.enter(f"t{3 * MAX_BUCKETS - 1}") is not None  # the newest: kept, empty


def test_limited_series_of_many_tenants_stay_bounded():
    """Each refused tenant gets a /metrics series; past the bound the least recently limited
    go, so tenant names from X-Tenant cannot grow /metrics either."""
    from zllm.frontend.access.tenant_limits import MAX_LIMITED_SERIES

    registry = CollectorRegistry()
    limits = TenantLimits(1, None, registry, Clock())
    for i in range(3 * MAX_LIMITED_SERIES):
        assert limits.enter(f"t{i}") is None and limits.enter(f"t{i}") is not None
        limits.leave(f"t{i}")
    series = [s for m in registry.collect() for s in m.samples if s.name.endswith("_total")]
    assert len(series) == MAX_LIMITED_SERIES
    assert limited_count(registry, "t0", "concurrency") == 0  # forgotten
    assert limited_count(registry, f"t{3 * MAX_LIMITED_SERIES - 1}", "concurrency") == 1


def test_no_limits_by_default():
    limits = TenantLimits(None, None, CollectorRegistry())
    assert not limits.enabled
    assert all(limits.enter("a") is None for _ in range(1000))


def completion(server: Server, key: str, max_tokens: int = 2) -> Completion:
    """One completion through the openai client (a 429 raises openai.RateLimitError)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    return client.completions.create(
        model=server.config()["engine"]["model"], prompt="Hi", max_tokens=max_tokens
    )


@contextmanager
def in_flight(server: Server, *keys: str) -> Iterator[list[Future[Completion]]]:
    """One completion per key, sent while the executor is paused (SIGSTOP, far under
    --executor-timeout): all are in flight at the door until the block ends, however fast
    the model is (a stream of the tiny model ends in a third of a second). Their futures
    are done after the block."""
    executor = server.children()["executor"]
    with ThreadPoolExecutor(len(keys)) as pool:
        os.kill(executor, signal.SIGSTOP)
        try:
            futures = [pool.submit(completion, server, key) for key in keys]

            def counted() -> float:
                return metric(server.get("/metrics").text, "zllm:num_requests_in_flight")

            assert wait_until(lambda: counted() == len(keys), 30), counted()
            yield futures
        finally:
            os.kill(executor, signal.SIGCONT)


@pytest.mark.e2e
def test_tenant_limits_through_the_openai_client(tiny_llama_dir, engine_pool, tmp_path):
    """Two API keys (tenants key-1, key-2), at most 1 request in flight and one start per 10
    s each: key-1's second request while its first runs gets 429 (concurrency) while key-2's
    is let in; key-1's next one after the first ends gets 429 (rate) with Retry-After."""
    with engine_pool.serve(
        tiny_llama_dir, tmp_path / "serve.log",
        "--api-key", "k1", "--api-key", "k2",
        "--tenant-max-concurrency", "1", "--tenant-max-requests-per-second", "0.1",
    ) as server:  # fmt: skip
        with in_flight(server, "k1", "k2") as running:
            with pytest.raises(openai.RateLimitError) as refused:
                completion(server, "k1")
            assert refused.value.response.headers["retry-after"] == "1"
            assert "--tenant-max-concurrency" in refused.value.message
        assert [f.result().usage.completion_tokens for f in running] == [2, 2]
        with pytest.raises(openai.RateLimitError) as refused:  # within 10 s of the first
            completion(server, "k1")
        assert 1 <= int(refused.value.response.headers["retry-after"]) <= 10
        assert "--tenant-max-requests-per-second" in refused.value.message
        text = server.get("/metrics", headers={"Authorization": "Bearer k1"}).text
        for limit in ("concurrency", "rate"):
            labels = f'limit="{limit}",tenant="key-1"'  # labels come sorted
            assert metric(text, "zllm:tenant_requests_limited_total", labels) == 1
        limited = [x for x in text.splitlines() if x.startswith("zllm:tenant_requests_limited")]
        assert limited and not [x for x in limited if 'tenant="key-2"' in x]  # never limited


def test_tenant_weights_objects_give_a_tenants_own_limits(tiny_llama_dir):
    """--tenant-weights' JSON form: a value is a weight or an object with weight and limits;
    the weights go to the scheduler (and need the fair policy), the limits to the door (and
    need no policy)."""
    text = (
        '{"key-1": {"weight": 3, "max_concurrency": 4, "max_requests_per_second": 0.5},'
        ' "alice": 2, "bob": {"max_concurrency": 1}}'
    )
    policies = parse_tenant_weights(text)
    assert policies == {
        "key-1": TenantPolicy(weight=3.0, max_concurrency=4, max_requests_per_second=0.5),
        "alice": TenantPolicy(weight=2.0),
        "bob": TenantPolicy(max_concurrency=1),
    }
    for bad, why in [
        ('{"a": {"wieght": 2}}', "unknown field `wieght`"),
        ('{"a": {"max_concurrency": 0}}', "max_concurrency must be a positive number"),
        ('{"a": {"max_concurrency": 1.5}}', "Expected `int | null`, got `float`"),
        ('{"a": {"max_requests_per_second": -1}}', "max_requests_per_second must be a positive"),
        ('{"a": ["x"]}', "the weight must be a positive number"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(why)):
            parse_tenant_weights(bad)
    fair = EngineArgs(tiny_llama_dir, scheduling_policy="fair", tenant_weights=policies)
    scheduler = fair.create_engine_config().scheduler
    assert scheduler.tenant_weights == {"key-1": 3.0, "alice": 2.0}
    assert scheduler.tenant_limits == {
        "key-1": TenantLimit(4, 0.5),
        "bob": TenantLimit(max_concurrency=1),
    }
    with pytest.raises(ValueError, match="needs --scheduling-policy fair for weights"):
        EngineArgs(tiny_llama_dir, tenant_weights=policies).create_engine_config()
    # The Python API takes the same objects as dicts; limits alone need no fair policy.
    limits_only = EngineArgs(tiny_llama_dir, tenant_weights={"bob": {"max_concurrency": 1}})
    scheduler = limits_only.create_engine_config().scheduler
    assert scheduler.tenant_weights == {} and scheduler.tenant_limits == {"bob": TenantLimit(1)}


def test_a_tenants_own_limits_replace_the_global_ones():
    """Global: 1 in flight and no rate. a: 2 in flight (its own); b: the global 1 in flight
    and its own rate of 0.5/s; c: the globals. Each 429 names the flag that set its limit."""
    registry, clock = CollectorRegistry(), Clock()
    own = {"a": TenantLimit(max_concurrency=2), "b": TenantLimit(max_requests_per_second=0.5)}
    limits = TenantLimits(1, None, registry, clock, per_tenant=own)
    assert limits.enabled and TenantLimits(None, None, per_tenant=own).enabled
    assert limits.enter("a") is None and limits.enter("a") is None
    refusal = limits.enter("a")
    assert refusal is not None and "its max_concurrency in --tenant-weights" in refusal.message
    assert limits.enter("b") is None
    refusal = limits.enter("b")
    assert refusal is not None and "(--tenant-max-concurrency)" in refusal.message
    limits.leave("b")
    refusal = limits.enter("b")  # a slot, but its bucket (burst 1) is empty for 2 s
    assert refusal is not None and refusal.headers == {"Retry-After": "2"}
    assert "0.5 requests per second (its max_requests_per_second in --tenant-weights)" in (
        refusal.message
    )
    for _ in range(50):  # c has no rate at all
        assert limits.enter("c") is None
        limits.leave("c")
    assert limits.enter("c") is None and limits.enter("c") is not None
    clock.now += 2.0
    assert limits.enter("b") is None
    assert limited_count(registry, "a", "concurrency") == 1
    assert limited_count(registry, "b", "rate") == 1


@pytest.mark.e2e
def test_per_tenant_limits_from_tenant_weights_through_the_openai_client(
    tiny_llama_dir, engine_pool, tmp_path
):
    """--tenant-max-concurrency 1 for everyone, but key-1 may have 2 in flight (its own
    limit in --tenant-weights, which needs no fair policy): with two of key-1's requests
    and one of key-2's running, key-1's third and key-2's second get 429, each naming the
    flag that set its limit; key-2 is served again once its first ends."""
    with engine_pool.serve(
        tiny_llama_dir, tmp_path / "serve.log",
        "--api-key", "k1", "--api-key", "k2",
        "--tenant-max-concurrency", "1", "--tenant-weights", '{"key-1": {"max_concurrency": 2}}',
    ) as server:  # fmt: skip
        assert server.config()["engine"]["scheduler"]["tenant_limits"] == {
            "key-1": {"max_concurrency": 2}
        }
        with in_flight(server, "k1", "k1", "k2") as running:
            with pytest.raises(openai.RateLimitError) as refused:
                completion(server, "k1")
            assert "its max_concurrency in --tenant-weights" in refused.value.message
            with pytest.raises(openai.RateLimitError) as refused:
                completion(server, "k2")
            assert "(--tenant-max-concurrency)" in refused.value.message
        assert [f.result().usage.completion_tokens for f in running] == [2, 2, 2]
        assert completion(server, "k2").usage.completion_tokens == 2
        text = server.get("/metrics").text
        for tenant in ("key-1", "key-2"):
            labels = f'limit="concurrency",tenant="{tenant}"'
            assert metric(text, "zllm:tenant_requests_limited_total", labels) == 1
