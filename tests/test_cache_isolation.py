"""--prefix-cache-isolation: under `tenant` a tenant's prompts share cached KV blocks only with
its own (no tenant learns from its TTFT what another sent); under `none` one cache serves all."""

from __future__ import annotations

import openai
import pytest
from servers import start_server, stop_server

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
def test_a_tenant_reuses_only_its_own_cached_prefixes(tiny_llama_dir, tmp_path, isolation):
    """Two API keys (two tenants): by default each tenant's cache is its own, so key-2's
    copy of key-1's prompt finds nothing cached; with `none` it finds key-1's blocks."""
    extra = [] if isolation == "default" else ["--prefix-cache-isolation", isolation]
    server = start_server(
        tiny_llama_dir, tmp_path / "serve.log", "--api-key", "k1", "--api-key", "k2", *extra
    )
    try:
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
    finally:
        stop_server(server)
