"""--otlp-traces-endpoint: a real server exports, through the OpenTelemetry SDK's OTLP/HTTP
exporter, one span tree per request to an OTLP receiver this test runs (protobuf bodies
decoded with opentelemetry-proto): the request span (under the client's `traceparent` when
it sends one) with tokenize, queue, prefill, decode and detokenize spans in time order
inside it, and vLLM's gen_ai.* attributes equal to what the client asked and got back.
Without the flag no process imports OpenTelemetry at all."""

from __future__ import annotations

import gzip
import os
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from servers import start_server, stop_server, wait_until

STAGES = ["tokenize", "queue", "prefill", "decode", "detokenize"]


class Receiver:
    """An OTLP/HTTP traces receiver on loopback: every span it was sent, by span id."""

    def __init__(self) -> None:
        self.spans: dict[bytes, Span] = {}
        self.attributes: dict[bytes, dict] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}/v1/traces"

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans[span.span_id] = span
                        self.attributes[span.span_id] = {
                            a.key: _value(a.value) for a in span.attributes
                        }

    def request_span(self, request_id: str) -> Span | None:
        with self.lock:
            for span_id, attrs in self.attributes.items():
                if attrs.get("gen_ai.request.id") == request_id:
                    return self.spans[span_id]
        return None

    def children(self, parent: Span) -> dict[str, Span]:
        with self.lock:
            return {s.name: s for s in self.spans.values() if s.parent_span_id == parent.span_id}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, engine_pool, tmp_path_factory, receiver):
    # Export within 50 ms of a span's end, not the SDK's default 5 s (read as the app makes
    # its exporter).
    old = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"
    try:
        log = tmp_path_factory.mktemp("tracing") / "serve.log"
        with engine_pool.serve(tiny_llama_dir, log, "--otlp-traces-endpoint", receiver.url) as s:
            yield s
    finally:
        if old is None:
            del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = old


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def span_tree(receiver: Receiver, request_id: str) -> tuple[Span, dict, dict[str, Span]]:
    """The request's span, its attributes and its children, once all have arrived."""
    assert wait_until(
        lambda: (
            (s := receiver.request_span(request_id)) is not None
            and len(receiver.children(s)) == len(STAGES)
        ),
        timeout=30,
    ), f"no complete span tree for {request_id}: {list(receiver.attributes.values())}"
    root = receiver.request_span(request_id)
    return root, receiver.attributes[root.span_id], receiver.children(root)


def check_tree(root: Span, children: dict[str, Span]) -> None:
    """The stages in time order, each inside the request's span and under it."""
    assert root.name == "llm_request" and root.kind == Span.SPAN_KIND_SERVER
    assert list(children) != [] and sorted(children) == sorted(STAGES)
    stages = [children[name] for name in STAGES]
    for span in stages:
        assert span.trace_id == root.trace_id
        assert root.start_time_unix_nano <= span.start_time_unix_nano
        assert span.start_time_unix_nano <= span.end_time_unix_nano <= root.end_time_unix_nano
    starts = [s.start_time_unix_nano for s in stages]
    assert starts == sorted(starts), dict(zip(STAGES, starts, strict=True))
    tokenize, queue, prefill, decode, detokenize = stages
    assert tokenize.end_time_unix_nano <= queue.start_time_unix_nano  # sent, then taken
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert decode.start_time_unix_nano <= detokenize.start_time_unix_nano
    assert decode.end_time_unix_nano <= detokenize.end_time_unix_nano


@pytest.mark.e2e
def test_a_request_under_the_clients_traceparent(server, receiver):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    resp = client(server).chat.completions.create(
        model=_model(server),
        messages=[{"role": "user", "content": "Hello there, how are you today?"}],
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    root, attrs, children = span_tree(receiver, resp.id)
    assert root.trace_id.hex() == trace_id
    assert root.parent_span_id.hex() == parent_id
    check_tree(root, children)
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.request.temperature"] == 0.7
    assert attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["gen_ai.request.n"] == 1
    assert attrs["gen_ai.response.model"] == resp.model
    assert attrs["gen_ai.usage.prompt_tokens"] == resp.usage.prompt_tokens
    assert attrs["gen_ai.usage.completion_tokens"] == resp.usage.completion_tokens
    assert attrs["gen_ai.response.finish_reasons"] == [resp.choices[0].finish_reason]
    e2e = (root.end_time_unix_nano - root.start_time_unix_nano) / 1e9
    assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert abs(attrs["gen_ai.latency.e2e"] - e2e) < 1e-3
    for name, key in [
        ("queue", "gen_ai.latency.time_in_queue"),
        ("prefill", "gen_ai.latency.time_in_model_prefill"),
        ("decode", "gen_ai.latency.time_in_model_decode"),
    ]:
        span = children[name]
        assert abs(attrs[key] - (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9) < 1e-6


@pytest.mark.e2e
def test_a_streamed_request_starts_its_own_trace(server, receiver):
    stream = client(server).completions.create(
        model=_model(server),
        prompt="The quick brown fox",
        max_tokens=8,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    root, attrs, children = span_tree(receiver, chunks[0].id)
    assert root.parent_span_id == b""  # no traceparent: a trace of its own
    assert root.trace_id != b"\x00" * 16
    check_tree(root, children)
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.completion_tokens"] == usage.completion_tokens
    assert attrs["gen_ai.response.model"] == chunks[0].model


@pytest.mark.e2e
def test_a_malformed_traceparent_starts_a_new_trace(server, receiver):
    resp = client(server).completions.create(
        model=_model(server),
        prompt="Hi",
        max_tokens=2,
        extra_headers={"traceparent": "00-not-a-trace-01"},
    )
    root, _, children = span_tree(receiver, resp.id)
    assert root.parent_span_id == b""
    check_tree(root, children)


@pytest.mark.e2e
def test_without_the_flag_no_process_imports_opentelemetry(tiny_llama_dir, tmp_path):
    """A stand-in `opentelemetry` package first on every process's path records who imports
    it; a server without the flag serves a request and nobody has."""
    fake = tmp_path / "fake" / "opentelemetry"
    fake.mkdir(parents=True)
    marker = tmp_path / "imported"
    (fake / "__init__.py").write_text(
        f"import os, sys\nopen({str(marker)!r}, 'a').write(' '.join(sys.argv) + '\\n')\n"
    )
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fake.parent), old]))
    try:
        server = start_server(tiny_llama_dir, tmp_path / "serve.log")
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    try:
        resp = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True})
        assert resp.status_code == 200
        titles = " ".join(server.children())
        assert all(role in titles for role in ("frontend", "core", "tokenizer", "detokenizer"))
    finally:
        stop_server(server)
    assert not marker.exists(), marker.read_text()


def _model(server) -> str:
    return client(server).models.list().data[0].id


def test_the_stage_spans_of_a_timing():
    """Stages not reached (a request that failed in the queue) make no span."""
    from zllm.frontend.observability.tracing import _stages
    from zllm.protocol import RequestTiming

    t = RequestTiming(tokenize_start=1.0, tokenize_end=1.5, core_arrival=1.6)
    assert [s[0] for s in _stages(t)] == ["tokenize"]
    full = RequestTiming(1.0, 1.5, 1.6, 2.0, 3.0, 3.1, 4.0, 4.2)
    assert _stages(full) == [
        ("tokenize", 1.0, 1.5),
        ("queue", 1.6, 2.0),
        ("prefill", 2.0, 3.0),
        ("decode", 3.0, 4.0),
        ("detokenize", 3.1, 4.2),
    ]
