"""Prometheus metrics of the server, in a registry of the frontend's own.

Engine-side numbers (running/waiting requests, KV usage, token and prefix-cache counters)
come from the core's heartbeat and are read at scrape time; per-request latencies are
observed by the frontend, which sees each request arrive, stream and finish.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from zllm.engine_client import EngineClient
from zllm.protocol import EngineStatus


class Metrics:
    """Prometheus metrics in a registry of this app's own (vLLM's names where they exist)."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(client, model_name))
        labels = ["model_name"]
        self.requests = Counter(
            "vllm:request_success",
            "HTTP generation requests by outcome (finished, abort, error).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from the request's arrival to its first output.",
            labels,
            registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from the request's arrival to its last output.",
            labels,
            registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        ).labels(model_name)


class EngineCollector:
    """Reads the latest engine heartbeat at scrape time."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def describe(self) -> list:
        return []

    def collect(self):
        s = self.client.status or EngineStatus(time=0.0)
        label = [self.model_name]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            yield g
        g = GaugeMetricFamily(
            "zllm:num_requests_in_flight",
            "HTTP generation requests this frontend is serving.",
            labels=["model_name"],
        )
        g.add_metric(label, self.client.num_in_flight)
        yield g
        for name, doc, value in (
            ("vllm:num_preemptions", "Preemptions by the scheduler.", s.num_preemptions),
            ("vllm:prompt_tokens", "Prompt tokens processed.", s.num_prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated.", s.num_generation_tokens),
            (
                "vllm:prefix_cache_queries",
                "Tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            ("vllm:prefix_cache_hits", "Tokens found in the prefix cache.", s.prefix_cache_hits),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            yield c
