"""OpenTelemetry traces (--otlp-traces-endpoint): one span tree per engine request.

    llm_request                     frontend: arrival -> its stream ended (kind SERVER)
    ├── tokenize                    tokenizer worker: took it -> sent it to the core
    ├── queue                       core: took it -> first scheduled
    ├── prefill                     core: first scheduled -> built its first output
    ├── decode                      core's first output -> the detokenizer took the last
    └── detokenize                  detokenizer: took the first output -> sent the final delta

Only the frontend imports OpenTelemetry, and only with the flag (this module is imported
lazily, and imports the SDK inside `Tracer.__init__`): the other processes stamp wall-clock
times into the request's `RequestTiming` (zllm/protocol.py), which travels back to the
frontend with the final output, and the spans are built here with those times. Every time
is `time.time()` of the process that stamped it; processes on one host share that clock, so
the spans line up (to the resolution of the clock, and unless it is stepped mid-request).
The decode ends when the detokenizer took the last output (the core's own finish time would
cost a stamp per output). With `n > 1` the stages are those of the request's first sample
(forks carry none), the detokenize span ends with the last sample's final delta.

The request span's parent is the client's W3C `traceparent` header when it sends one (its
trace id, with the client's span as parent), else it starts a trace. Attributes follow
vLLM's `gen_ai.*` names (its vllm/tracing.py). Spans leave through the SDK's batch
processor (OTEL_BSP_* environment variables tune it), flushed when the frontend stops.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zllm.frontend.observability.metrics import RequestTrace
from zllm.protocol import RequestTiming, TokenizeRequest

NS = 1_000_000_000

# vLLM's span attribute names (gen_ai.*), as its SpanAttributes spells them.
REQUEST_ID = "gen_ai.request.id"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_N = "gen_ai.request.n"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
CACHED_TOKENS = "zllm.usage.cached_tokens"  # prompt tokens found in the prefix cache


class Tracer:
    """Exports the spans of finished requests to an OTLP/HTTP endpoint."""

    def __init__(self, endpoint: str, service_name: str = "zllm") -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("zllm.frontend")
        self.propagator = TraceContextTextMapPropagator()
        self.server_kind = SpanKind.SERVER
        self.in_context = set_span_in_context

    def parent(self, headers: Mapping[str, str]) -> Any:
        """The client's span (its `traceparent` header) as an OpenTelemetry context; an
        empty context (a new trace) without one or with a malformed one."""
        return self.propagator.extract(carrier={k.lower(): v for k, v in headers.items()})

    def export(
        self, request: TokenizeRequest, trace: RequestTrace, parent: Any, model: str, end: float
    ) -> None:
        """The span tree of one engine request that ended at `end` (wall clock)."""
        params = request.sampling_params
        timing = trace.timing
        attributes: dict[str, Any] = {
            REQUEST_ID: request.req_id,
            REQUEST_TEMPERATURE: params.temperature,
            REQUEST_TOP_P: params.top_p,
            REQUEST_N: params.n,
            RESPONSE_MODEL: model,
            USAGE_PROMPT_TOKENS: trace.num_prompt_tokens,
            USAGE_COMPLETION_TOKENS: trace.num_generation_tokens,
            USAGE_NUM_SEQUENCES: params.n,
            CACHED_TOKENS: trace.num_cached_tokens,
            LATENCY_E2E: end - request.arrival_time,
        }
        if params.max_tokens is not None:
            attributes[REQUEST_MAX_TOKENS] = params.max_tokens
        if trace.finish_reason is not None:
            attributes[RESPONSE_FINISH_REASONS] = [trace.finish_reason]
        if trace.ttft_s is not None:
            attributes[LATENCY_TIME_TO_FIRST_TOKEN] = trace.ttft_s
        stages = _stages(timing) if timing is not None else []
        for name, key in (
            ("queue", LATENCY_TIME_IN_QUEUE),
            ("prefill", LATENCY_TIME_IN_MODEL_PREFILL),
            ("decode", LATENCY_TIME_IN_MODEL_DECODE),
        ):
            for stage, start, stop in stages:
                if stage == name:
                    attributes[key] = stop - start
        root = self.tracer.start_span(
            "llm_request",
            context=parent,
            kind=self.server_kind,
            attributes=attributes,
            start_time=_ns(request.arrival_time),
        )
        inside = self.in_context(root)
        for name, start, stop in stages:
            span = self.tracer.start_span(name, context=inside, start_time=_ns(start))
            span.end(end_time=_ns(stop))
        root.end(end_time=_ns(end))

    def shutdown(self) -> None:
        """Send what is still batched (the frontend is stopping)."""
        self.provider.shutdown()


def _stages(t: RequestTiming) -> list[tuple[str, float, float]]:
    """(name, start, end) of each stage the request reached, in time order."""
    stages = [
        ("tokenize", t.tokenize_start, t.tokenize_end),
        ("queue", t.core_arrival, t.scheduled),
        ("prefill", t.scheduled, t.first_token),
        ("decode", t.first_token, t.last_output),
        ("detokenize", t.detokenize_start, t.detokenize_end),
    ]
    return [s for s in stages if s[1] > 0.0 and s[2] >= s[1]]


def _ns(seconds: float) -> int:
    return int(seconds * NS)
