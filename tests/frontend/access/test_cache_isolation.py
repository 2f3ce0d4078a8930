"""--prefix-cache-isolation: under `tenant` a tenant's prompts share cached KV blocks only with
its own (no tenant learns from its TTFT what another sent); under `none` one cache serves all.
Each tenant's hits on /metrics and the dashboard, and what each key reads there
(frontend/observability/tenant_prefix_hits.py, frontend/access/permissions.py)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from servers import metric, wait_until

from zllm.frontend.access.permissions import EVERYONE, RegistryView, Viewer
from zllm.frontend.observability.tenant_prefix_hits import PrefixHits, TenantPrefixHits
from zllm.kv.block_hash import cache_salt, hash_full_blocks
from zllm.protocol import RequestOptions


def test_tenant_isolation_salts_each_tenants_blocks():
    def salt(tenant: str, isolate: bool, user_salt: str | None = None):
        options = RequestOptions(tenant=tenant, isolate_tenant_cache=isolate, cache_salt=user_salt)
        return cache_salt(options)

    assert salt("a", False) is None and salt("b", False) is None  # one shared cache
    assert salt("a", True) != salt("b", True)
    assert salt("a", True) == salt("a", True) and salt("default", True) is not None
    # A request's own cache_salt narrows further inside its tenant, never across tenants.
    assert salt("a", True, "x") not in (
        salt("a", True),
        salt("b", True, "x"),
        salt("a", False, "x"),
    )
    tokens = list(range(64))
    chains = {hash_full_blocks(tokens, 16, salt=salt(t, True))[0] for t in ("a", "b", "default")}
    assert len(chains) == 3  # the same tokens, three tenants: three first blocks


@pytest.mark.e2e
@pytest.mark.parametrize("isolation", ["default", "none"])
def test_a_tenant_reuses_only_its_own_cached_prefixes(
    tiny_llama_dir, engine_pool, tmp_path, isolation
):
    """Two API keys (two tenants): by default each tenant's cache is its own, so key-2's
    copy of key-1's prompt finds nothing cached; with `none` it finds key-1's blocks."""
    extra = [] if isolation == "default" else ["--prefix-cache-isolation", isolation]
    log = tmp_path / "serve.log"
    with engine_pool.serve(
        tiny_llama_dir, log, "--api-key", "k1", "--api-key", "k2", *extra
    ) as server:
        prompt = [(7 * i) % 300 + 3 for i in range(80)]  # five full blocks of 16

        def cached(key: str) -> int:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            done = client.completions.create(model=tiny_llama_dir, prompt=prompt, max_tokens=1)
            details = done.usage.prompt_tokens_details
            return 0 if details is None else details.cached_tokens or 0

        assert server.config()["prefix_cache_isolation"] == (
            "tenant" if isolation == "default" else "none"
        )
        assert cached("k1") == 0
        assert cached("k1") >= 64  # a tenant's own prefix comes back
        other = cached("k2")
        assert other == 0 if isolation == "default" else other >= 64


def test_each_tenants_prefix_hits_are_counted_and_bounded():
    hits = TenantPrefixHits("tiny", max_tenants=2)
    hits.count("a", 80, 0)
    hits.count("a", 80, 64)
    hits.count("b", 10, 0)
    assert hits.of("a") == PrefixHits(160, 64) and hits.of("a").hit_rate == 0.4
    assert hits.of("nobody") == PrefixHits()
    hits.count("a", 1, 0)  # a counted last: b is the least recent
    hits.count("c", 5, 5)
    assert list(hits.tenants) == ["a", "c"]  # b forgotten, the bound kept
    registry = CollectorRegistry()
    registry.register(hits)
    labels = {"model_name": "tiny", "tenant": "a"}
    assert registry.get_sample_value("zllm:tenant_prefix_cache_queries_total", labels) == 161
    assert registry.get_sample_value("zllm:tenant_prefix_cache_hits_total", labels) == 64


def test_a_tenants_view_of_metrics_has_only_its_own_tenant_and_no_shared_hits():
    registry = CollectorRegistry()
    hits = TenantPrefixHits("tiny")
    registry.register(hits)
    hits.count("key-1", 80, 64)
    hits.count("key-2", 80, 0)
    Counter("vllm:prefix_cache_hits", "every tenant's", registry=registry).inc(64)
    Counter("vllm:prompt_tokens", "load", registry=registry).inc(160)
    limited = Counter("zllm:tenant_requests_limited", "x", ["tenant", "limit"], registry=registry)
    limited.labels("key-2", "rate").inc()

    def text(viewer: Viewer) -> str:
        return generate_latest(RegistryView(registry, viewer)).decode()  # type: ignore[arg-type]

    everyone, own = text(EVERYONE), text(Viewer("key-1"))
    assert everyone == generate_latest(registry).decode()
    assert 'tenant="key-2"' in everyone and "vllm:prefix_cache_hits_total 64.0" in everyone
    assert 'tenant="key-2"' not in own and "vllm:prefix_cache_hits_total" not in own
    assert 'zllm:tenant_prefix_cache_hits_total{model_name="tiny",tenant="key-1"} 64.0' in own
    assert "vllm:prompt_tokens_total 160.0" in own  # the engine's load is no tenant's secret
    assert "# TYPE zllm:tenant_requests_limited_total counter" in own  # with no series


@pytest.mark.e2e
def test_each_tenant_sees_only_its_own_cache_hits(tiny_llama_dir, engine_pool, tmp_path):
    """Two API keys under tenant isolation with --protect-metrics and a metrics key: each
    key's /metrics and /dashboard/stats show its own tenant's prefix-cache hits (what its
    usage's cached_tokens add up to) and no other tenant's series, nor the engine's hit
    counters; the metrics key sees every tenant and the engine's hits, and can generate
    nothing; /health needs no key."""
    with engine_pool.serve(
        tiny_llama_dir, tmp_path / "serve.log",
        "--api-key", "k1", "--api-key", "k2", "--protect-metrics", "--metrics-api-key", "m",
    ) as server:  # fmt: skip
        prompt = [(7 * i) % 300 + 3 for i in range(80)]  # five full blocks of 16

        def usage(key: str, tokens: list[int]) -> tuple[int, int]:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            done = client.completions.create(model=tiny_llama_dir, prompt=tokens, max_tokens=1)
            details = done.usage.prompt_tokens_details
            return done.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0

        def read(path: str, key: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return server.get(path, headers=headers)

        k1 = [usage("k1", prompt), usage("k1", prompt)]
        k2 = [usage("k2", prompt[::-1])]
        assert k1[1][1] >= 64 and k2[0][1] == 0  # key-1's own prefix came back
        for key, tenant, other, sent in (
            ("k1", "key-1", "key-2", k1),
            ("k2", "key-2", "key-1", k2),
        ):
            text = read("/metrics", key).text
            own = f'tenant="{tenant}"'
            assert metric(text, "zllm:tenant_prefix_cache_queries_total", own) == sum(
                prompt_tokens for prompt_tokens, _ in sent
            )
            assert metric(text, "zllm:tenant_prefix_cache_hits_total", own) == sum(
                cached for _, cached in sent
            )
            assert f'tenant="{other}"' not in text
            assert "vllm:prefix_cache_hits_total" not in text
            assert wait_until(  # the engine's load stays visible; a heartbeat brings it to 0
                lambda key=key: (
                    metric(read("/metrics", key).text, "vllm:num_requests_running") == 0
                ),
                10,
            )
            stats = read("/dashboard/stats", key).json()
            assert stats["tenant"] == tenant
            assert stats["engine"]["prefix_cache_hits"] == sum(cached for _, cached in sent)
        assert wait_until(lambda: "key-2" in read("/metrics", "m").text, 10)
        text = read("/metrics", "m").text
        assert metric(text, "zllm:tenant_prefix_cache_hits_total", 'tenant="key-1"') >= 64
        assert metric(text, "zllm:tenant_prefix_cache_hits_total", 'tenant="key-2"') == 0
        assert wait_until(
            lambda: metric(read("/metrics", "m").text, "vllm:prefix_cache_hits_total") >= 64, 10
        )  # the engine's own count, once a heartbeat brings it
        stats = read("/dashboard/stats", "m").json()
        assert stats["tenant"] is None and stats["engine"]["prefix_cache_hits"] >= 64
        for path in ("/metrics", "/dashboard", "/dashboard/stats", "/version"):
            assert read(path, None).status_code == 401
        assert read("/health", None).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            usage("m", prompt)  # a scraper's key spends no compute
