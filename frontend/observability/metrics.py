"""Prometheus metrics of the server, with vLLM's names, in a registry of the frontend's own.

    where it comes from        metrics
    core heartbeat (0.5 s)     vllm:num_requests_running, vllm:num_requests_waiting,
                               vllm:kv_cache_usage_perc (gauges, read at scrape time);
                               vllm:prompt_tokens_total, vllm:generation_tokens_total,
                               vllm:num_preemptions_total, vllm:prefix_cache_queries_total,
                               vllm:prefix_cache_hits_total (tokens),
                               zllm:executor_busy_seconds_total,
                               zllm:executor_idle_seconds_total, zllm:engine_steps_total,
                               zllm:executor_{prepare,forward,sample}_seconds_total,
                               zllm:core_{schedule,output}_seconds_total (goal 4's split);
                               with pipeline stages, per stage:
                               zllm:pipeline_stage_{busy,idle}_seconds_total;
                               with --kv-transfer-config: zllm:kv_transfer_sent_blocks_total,
                               zllm:kv_transfer_wait_timeouts_total,
                               zllm:kv_transfer_rejected_blocks_total{reason}
                               per tenant: zllm:tenant_requests_{running,waiting},
                               zllm:tenant_weight, zllm:tenant_{requests,computed_tokens,
                               generation_tokens,preemptions}_total
    supervisor events          zllm:process_up{role,index,engine}
    this frontend              vllm:request_success_total{finished_reason},
                               vllm:time_to_first_token_seconds,
                               vllm:inter_token_latency_seconds,
                               vllm:e2e_request_latency_seconds,
                               vllm:request_queue_time_seconds,
                               vllm:request_prompt_tokens, vllm:request_generation_tokens,
                               zllm:tenant_requests_limited_total{tenant,limit}
                               (frontend/access/tenant_limits.py),
                               zllm:tenant_prefix_cache_{queries,hits}_total{tenant}
                               (frontend/observability/tenant_prefix_hits.py)
    bounded caches             zllm:cache_entries, zllm:cache_capacity {process,cache,engine}:
                               this frontend's, and each engine's from its heartbeat
                               (frontend/observability/cache_sizes.py)

Per-request numbers are observed per engine request (one prompt; a multi-prompt HTTP request
is several), as the frontend receives its outputs:

- TTFT when its first token arrives, the queue time (which the core measured) with it;
- one inter-token latency per later token of each sample (a delta holding k tokens counts
  k intervals of a k-th of the gap), so the count is generated tokens minus samples;
- when it ends: one `request_success_total` by reason, and, for a request the engine
  finished (not one cut off by its client leaving or by a failure), e2e latency and its
  prompt and generation token counts. For `n > 1` the generation tokens are those of all
  samples and the reason is that of the last sample to finish (abort or error win).

A request refused as invalid (a 4xx from the tokenizer or the core, such as a prompt that is
too long) never ran and counts nowhere; it is still logged, as "rejected".

Who reads /metrics decides which tenants' series it shows (frontend/access/permissions.py).

The core-heartbeat metrics carry an `engine` label (as vLLM's do): one series per
data-parallel engine ("0" with one). The frontend's own request metrics are the whole
server's.

Every series exists, at 0, from the start. Counters that come from the core start again
from 0 if the engine restarts, which Prometheus' `rate()` reads as a counter reset.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

from zllm.frontend.observability.cache_sizes import CacheSizes
from zllm.frontend.observability.dashboard import Dashboard, LatencyWindow, Timeline
from zllm.frontend.observability.engine_metrics import EngineCollector
from zllm.frontend.observability.tenant_prefix_hits import TenantPrefixHits
from zllm.protocol import DEFAULT_TENANT, RequestOutputDelta, RequestTiming, TokenizeRequest
from zllm.runtime.engine_client import EngineClient
from zllm.text.tokenizer import compiled_templates

FINISHED_REASONS = ("stop", "length", "abort", "error")


def steps_125(low_exp: int, high: float, multipliers=(1, 2.5, 5)) -> list[float]:
    """Bucket bounds 1, 2.5, 5 (or `multipliers`) times each power of ten from
    10**low_exp, up to the first bound at or above `high`."""
    bounds: list[float] = []
    exp = low_exp
    while True:
        for m in multipliers:
            bounds.append(float(f"{m}e{exp}"))
            if bounds[-1] >= high:
                return bounds
        exp += 1


# Seconds: from 1 ms (CPU steps of a small model) to the longest requests.
TTFT_BUCKETS = steps_125(-3, 1000.0)
ITL_BUCKETS = steps_125(-3, 100.0)
REQUEST_BUCKETS = steps_125(-2, 5000.0)


def token_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the first value at or above `max_len`."""
    return steps_125(0, max_len, (1, 2, 5))


@dataclass(eq=False)
class RequestTrace:
    """One engine request as the frontend saw it (monotonic times)."""

    req_id: str
    n: int
    start: float
    tenant: str = DEFAULT_TENANT
    first_token: float | None = None
    end: float | None = None
    queue_time_s: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    last_token: dict[int, float] = field(default_factory=dict)  # per sample
    finish_reasons: dict[int, str] = field(default_factory=dict)  # per finished sample
    finish_reason: str | None = None  # the request's, once it ended
    # A traced request's stage times (wall clock), from its final delta (frontend/observability/tracing.py).
    timing: RequestTiming | None = None

    @property
    def finished_by_engine(self) -> bool:
        return len(self.finish_reasons) >= self.n

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e_s(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def log_line(self) -> str:
        """One `key=value` line, never any prompt or output text."""

        def secs(value: float | None) -> str:
            return "-" if value is None else f"{value:.4f}"

        return (
            f"request finished: id={self.req_id} prompt_tokens={self.num_prompt_tokens} "
            f"generation_tokens={self.num_generation_tokens} "
            f"cached_tokens={self.num_cached_tokens} ttft_s={secs(self.ttft_s)} "
            f"e2e_s={secs(self.e2e_s)} queue_s={secs(self.queue_time_s)} n={self.n} "
            f"finish_reason={self.finish_reason}"
        )


class Metrics:
    """The frontend's Prometheus registry, the per-request observations, and the rolling
    windows the dashboard reads (`self.dashboard`)."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        # vLLM's exposition has no `_created` series beside counters and histograms.
        prometheus_client.disable_created_metrics()
        self.client = client
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(client, model_name))
        self.prefix_hits = TenantPrefixHits(model_name)
        self.registry.register(self.prefix_hits)
        labels = ["model_name"]
        success = Counter(
            "vllm:request_success",
            "Finished requests (one per prompt) by how they ended.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self._add_histograms(labels, client.config.engine.scheduler.max_model_len)
        # What the dashboard shows beside the heartbeat: recent latencies and outcomes.
        self.ttft_window = LatencyWindow()
        self.itl_window = LatencyWindow()
        self.num_finished = dict.fromkeys(FINISHED_REASONS, 0)
        self.timeline = Timeline(client)
        self.dashboard = Dashboard(
            client,
            model_name,
            self.timeline,
            self.ttft_window,
            self.itl_window,
            self.num_finished,
            self.prefix_hits,
        )
        self.caches = CacheSizes(client, model_name)
        self.registry.register(self.caches)
        self._watch_caches()

    def _add_histograms(self, labels: list[str], max_len: int) -> None:
        """vLLM's per-request histograms, each labelled with this model's name."""

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets).labels(
                self.model_name
            )

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from arrival to the first token (per prompt).",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between consecutive tokens of a sample.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from arrival to the last output (per prompt).",
            REQUEST_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Seconds from arrival to first being scheduled.",
            REQUEST_BUCKETS,
        )
        self.prompt_tokens = histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per finished request.",
            token_buckets(max_len),
        )
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request (all samples).",
            token_buckets(max_len),
        )

    def _watch_caches(self) -> None:
        """The bounded caches the metrics keep (zllm:cache_entries), and the chat templates
        this process compiled (the tokenizer workers compile their own)."""
        caches, hits = self.caches, self.prefix_hits
        caches.watch("tenant_prefix_hits", lambda: len(hits.tenants), hits.max_tenants)
        for name, window in (("ttft_window", self.ttft_window), ("itl_window", self.itl_window)):
            caches.watch(name, lambda w=window: w.count, window.max_samples)
        points = self.timeline.points
        caches.watch("dashboard_timeline", lambda: len(points), points.maxlen)
        caches.watch("chat_templates", lambda: compiled_templates()[0], compiled_templates()[1])

    # ---- per engine request --------------------------------------------------------------
    def track(self, request: TokenizeRequest) -> RequestTrace:
        return RequestTrace(
            request.req_id, request.sampling_params.n, time.monotonic(), request.options.tenant
        )

    def on_output(self, trace: RequestTrace, delta: RequestOutputDelta) -> None:
        now = time.monotonic()
        num_tokens = len(delta.token_ids)
        if delta.num_prompt_tokens:
            if not trace.num_prompt_tokens:  # its first output: the prefix was looked up
                self.prefix_hits.count(
                    trace.tenant, delta.num_prompt_tokens, delta.num_cached_tokens
                )
            trace.num_prompt_tokens = delta.num_prompt_tokens
            trace.num_cached_tokens = delta.num_cached_tokens
        if num_tokens:
            trace.num_generation_tokens += num_tokens
            if trace.first_token is None:
                trace.first_token = now
                ttft = now - trace.start
                self.ttft.observe(ttft)
                self.ttft_window.add(now, ttft)
            if trace.queue_time_s is None and delta.index == 0:
                # Sample 0 is the request itself; forked samples carry no queue time.
                trace.queue_time_s = delta.queue_time_s
                self.queue_time.observe(delta.queue_time_s)
            last = trace.last_token.get(delta.index)
            gap = 0.0 if last is None else (now - last) / num_tokens
            for _ in range(num_tokens if last is not None else num_tokens - 1):
                self.itl.observe(gap)
                self.itl_window.add(now, gap)
            trace.last_token[delta.index] = now
        if delta.finish_reason is not None:
            trace.finish_reasons[delta.index] = str(delta.finish_reason)
        if delta.timing is not None:
            trace.timing = delta.timing

    def finish(self, trace: RequestTrace, interrupted: str) -> None:
        """The request's stream ended; `interrupted` is its reason if the engine had not
        finished every sample: "abort", "error", or "rejected" (refused as invalid, 4xx),
        which counts nowhere when it produced nothing: such a request never ran."""
        trace.end = time.monotonic()
        reasons = set(trace.finish_reasons.values())
        if interrupted == "rejected" and trace.first_token is None and not reasons:
            trace.finish_reason = "rejected"
            return
        if not trace.finished_by_engine:
            reason = "error" if interrupted == "rejected" else interrupted
        elif reasons & {"error", "abort"}:
            reason = "error" if "error" in reasons else "abort"
        else:
            reason = list(trace.finish_reasons.values())[-1]
        trace.finish_reason = reason if reason in self.success else "error"
        self.success[trace.finish_reason].inc()
        self.num_finished[trace.finish_reason] += 1
        if trace.finished_by_engine:
            self.e2e.observe(trace.end - trace.start)
            self.prompt_tokens.observe(trace.num_prompt_tokens)
            self.generation_tokens.observe(trace.num_generation_tokens)
