"""zllm:cache_entries / zllm:cache_capacity (frontend/observability/cache_sizes.py): every
cache meant to grow, its entries now and its bound, the frontend's read at scrape time and
each engine's from its heartbeat, the executor's loaded LoRA weights among them. (The
compiled grammars: tests/test_structured_outputs.py; the served check: tests/test_metrics.py;
the section's merge: tests/test_engine_stats.py.)"""

from __future__ import annotations

from types import SimpleNamespace

from lora_adapters import ADAPTERS, make_adapter
from prometheus_client import CollectorRegistry
from tiny_models import write_tiny_model

from zllm import LLM, LoRARequest, SamplingParams
from zllm.frontend.access.tenant_limits import TenantLimits
from zllm.frontend.observability.cache_sizes import CacheSizes, watch_server_caches
from zllm.frontend.observability.metrics import Metrics
from zllm.protocol import CacheSize, EngineStats
from zllm.text.tokenizer import compiled_templates

MODEL = "m"


def fake_client(engine_stats: dict[int, EngineStats] | None = None) -> SimpleNamespace:
    scheduler = SimpleNamespace(max_model_len=512)
    return SimpleNamespace(
        config=SimpleNamespace(engine=SimpleNamespace(scheduler=scheduler)),
        engine_stats=engine_stats or {},
        num_engines=max(1, len(engine_stats or {})),
        stats=None,
        processes={},
        num_in_flight=0,
    )


def sizes(registry: CollectorRegistry | CacheSizes) -> dict[tuple[str, str, str], tuple]:
    """(process, cache, engine) -> (entries, capacity or None), as /metrics has them."""
    found: dict[tuple[str, str, str], list] = {}
    for metric in registry.collect():
        if metric.name not in ("zllm:cache_entries", "zllm:cache_capacity"):
            continue
        for s in metric.samples:
            assert s.labels["model_name"] == MODEL
            key = (s.labels["process"], s.labels["cache"], s.labels["engine"])
            row = found.setdefault(key, [None, None])
            row[metric.name == "zllm:cache_capacity"] = s.value
    return {key: tuple(row) for key, row in found.items()}


def test_the_frontend_metrics_show_their_caches_and_bounds():
    metrics = Metrics(fake_client(), MODEL)  # type: ignore[arg-type]
    templates = compiled_templates()
    assert sizes(metrics.registry) == {
        ("frontend", "tenant_prefix_hits", ""): (0, 256),
        ("frontend", "ttft_window", ""): (0, 8192),
        ("frontend", "itl_window", ""): (0, 8192),
        ("frontend", "dashboard_timeline", ""): (0, 600),
        ("frontend", "chat_templates", ""): templates,
    }
    assert templates[1] == 16
    for tenant in ("a", "b", "a"):
        metrics.prefix_hits.count(tenant, 10, 5)
    for i in range(3):
        metrics.itl_window.add(float(i), 0.01)
    now = sizes(metrics.registry)
    assert now[("frontend", "tenant_prefix_hits", "")] == (2, 256)
    assert now[("frontend", "itl_window", "")] == (3, 8192)
    assert now[("frontend", "ttft_window", "")] == (0, 8192)


def test_each_engine_heartbeat_caches_carry_its_engine_and_an_unbounded_cache_no_capacity():
    engines = {
        0: EngineStats(caches=[CacheSize("core", "tenant_ledger", 2, 257)]),
        1: EngineStats(
            caches=[
                CacheSize("core", "tenant_ledger", 1, 256),
                CacheSize("executor", "structured_output_grammars", 4, 256),
            ]
        ),
    }
    caches = CacheSizes(fake_client(engines), MODEL)  # type: ignore[arg-type]
    held = {"n": 3}
    caches.watch("registry", lambda: held["n"], None)
    held["n"] = 5  # read at scrape time, not when watched
    assert sizes(caches) == {
        ("frontend", "registry", ""): (5, None),
        ("core", "tenant_ledger", "0"): (2, 257),
        ("core", "tenant_ledger", "1"): (1, 256),
        ("executor", "structured_output_grammars", "1"): (4, 256),
    }


def test_an_engine_without_a_heartbeat_yet_has_no_rows():
    client = fake_client({0: EngineStats(caches=[CacheSize("core", "prefix_pins", 0, 9)])})
    client.num_engines = 2  # engine 1 has not sent its first heartbeat
    assert sizes(CacheSizes(client, MODEL)) == {("core", "prefix_pins", "0"): (0, 9)}  # type: ignore[arg-type]


def test_the_server_caches_tenant_limits_and_registered_adapters():
    registry = CollectorRegistry(auto_describe=False)
    caches = CacheSizes(fake_client(), MODEL)  # type: ignore[arg-type]
    registry.register(caches)
    clock = SimpleNamespace(now=0.0)
    limits = TenantLimits(None, 1.0, registry, clock=lambda: clock.now)
    adapters = SimpleNamespace(by_name={"a": object(), "b": object()})
    watch_server_caches(caches, limits, adapters)  # type: ignore[arg-type]
    for tenant in ("t1", "t2", "t2"):  # t2's second request is over its rate: refused
        limits.enter(tenant)
    assert sizes(registry) == {
        ("frontend", "tenant_rate_buckets", ""): (2, 256),
        ("frontend", "tenant_limited_series", ""): (1, 256),
        ("frontend", "lora_adapters", ""): (2, 1024),
    }


def test_loaded_lora_weights_stay_within_max_loras_beside_the_live(tmp_path):
    """The executor's loaded adapters (zllm:cache_entries{cache="lora_weights"}): at most
    --max-loras idle ones beside those live requests use, as the heartbeat reports them."""
    base = str(write_tiny_model(tmp_path / "base"))
    llm = LLM(base, enable_lora=True, max_loras=1, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    seen = []
    for i, (name, config) in enumerate(ADAPTERS.items(), start=1):
        lora = LoRARequest(name, i, str(make_adapter(base, tmp_path / name, seed=i, **config)))
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False, lora_request=lora)
        (weights,) = [c for c in llm.engine.heartbeat().caches if c.cache == "lora_weights"]
        assert weights.process == "executor"
        assert weights.capacity is not None and weights.entries <= weights.capacity, weights
        seen.append(weights.entries)
    # One idle adapter kept (max_loras), and the last request's, whose end the executor
    # hears of with the next step: never the three.
    assert seen == [1, 2, 2]
