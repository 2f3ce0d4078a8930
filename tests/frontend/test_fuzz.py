"""Fuzzing the real server (tiny random model): schemathesis generates valid and invalid
requests from the server's own /openapi.json, and a hand-written list of hostile inputs
follows. Nothing may get a 5xx but the documented 503, every 4xx carries OpenAI's error
shape with a message, and afterwards the server is healthy and a normal request works.

Bounded: 30 examples per operation and generation mode, derandomized (the same examples
every run, so CI does not flake; set ZLLM_FUZZ_RANDOM=1 to explore new ones), a 64-token
context so no generated request runs long, and a 60 s timeout on every call."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from servers import error_of

pytestmark = pytest.mark.e2e

MAX_EXAMPLES = 30
OPERATIONS = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /v1/embeddings",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /health",
    "GET /version",
]


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir, engine_pool, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    with engine_pool.serve(
        tiny_llama_dir, log, "--max-model-len", "64", "--request-timeout", "120"
    ) as server:
        yield server


def _schemathesis():
    if os.environ.get("CI"):  # CI installs the test extra: missing is a failure there
        import schemathesis
    else:
        schemathesis = pytest.importorskip("schemathesis")
    return schemathesis


@pytest.fixture(scope="module")
def schema(fuzz_server):
    return _schemathesis().openapi.from_url(fuzz_server.url + "/openapi.json")


def test_openapi_schema_describes_the_api(fuzz_server):
    spec = fuzz_server.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    assert {"/v1/messages", "/v1/messages/count_tokens", "/v1/responses"} <= set(spec["paths"])
    assert "/v1/embeddings" in spec["paths"]
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"maximum": 16, "minimum": 1, "type": "integer"}.items() <= props["n"].items()
    max_tokens = next(b for b in props["max_tokens"]["anyOf"] if b.get("type") == "integer")
    assert max_tokens["maximum"] == 64  # the server's context length
    # Structured outputs on both endpoints: OpenAI's response_format and vLLM's field.
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        fields = spec["components"]["schemas"][request]["properties"]
        assert {"response_format", "structured_outputs"} <= set(fields)
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "logit_bias"} <= set(chat)
    message = spec["components"]["schemas"]["ChatMessage"]["properties"]
    assert {"tool_calls", "tool_call_id"} <= set(message)
    structured = spec["components"]["schemas"]["StructuredOutputsParams"]["properties"]
    assert {"json", "json_object", "regex", "choice", "grammar"} <= set(structured)
    responses = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "413", "503", "504"} <= set(responses)


def _check_response(status: int, content_type: str, body: bytes, what: str) -> None:
    assert status < 500 or status == 503, f"{what}: {status} {body[:500]!r}"
    if status >= 400 and status != 405:
        assert content_type.startswith("application/json"), what
        error = json.loads(body)["error"]
        assert error["message"], what


# Invalid examples only where there is something to get wrong: a GET without parameters
# has no invalid form.
CASES = [(label, "positive") for label in OPERATIONS]
CASES += [(label, "negative") for label in OPERATIONS if label.startswith("POST")]


@pytest.mark.parametrize("label, mode", CASES)
def test_schemathesis(fuzz_server, schema, label, mode):
    from hypothesis import HealthCheck, Phase, given, settings

    generation_mode = _schemathesis().GenerationMode(mode)
    operation = schema.find_operation_by_label(label)
    statuses: list[int] = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=not os.environ.get("ZLLM_FUZZ_RANDOM"),
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=generation_mode))
    def check(case):
        response = case.call(base_url=fuzz_server.url, timeout=60)
        statuses.append(response.status_code)
        content_type = response.headers.get("content-type") or [""]  # a list per header
        _check_response(
            response.status_code,
            content_type[0] if isinstance(content_type, list) else content_type,
            response.content,
            f"{case.method} {case.path} body={case.body!r}"[:2000],
        )

    check()
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"\n{label} {mode}: {len(statuses)} calls, statuses {counts}")
    assert len(statuses) >= (10 if label.startswith("POST") else 1)
    assert fuzz_server.healthy(), fuzz_server.log_tail()


_MESSAGES = [{"role": "user", "content": "hi"}]
_WIDE_INT_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"x": [1, 10**30]}}}
# (path, raw body or JSON value, content type, expected status)
HOSTILE = [
    ("/v1/completions", b'{"prompt": "\xff\xfe\xfd"}', None, 400),
    ("/v1/completions", b"\xff\xfe\xfd", None, 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', None, 400),
    ("/v1/completions", b'{"prompt": "\\ud800"}', None, 400),  # a lone surrogate
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1000000000000000000000000}', None, 400),
    ("/v1/completions", b'{"prompt": [100000000000000000000000000]}', None, 400),
    ("/v1/completions", b'{"prompt": "hi", "seed": -100000000000000000000000000}', None, 400),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', None, 400),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', None, 400),
    ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', None, 400),
    ("/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', None, 400),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, 400),
    ("/v1/completions", b'{"x": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}", None, 400),
    ("/v1/completions", b'{"prompt": "' + b"a" * 10_000_000 + b'"}', None, 413),
    ("/v1/completions", {"prompt": "hi"}, "text/plain", 415),
    ("/v1/completions", {"prompt": "hi"}, "application/x-www-form-urlencoded", 415),
    ("/v1/chat/completions", {"messages": _MESSAGES}, "multipart/form-data; boundary=x", 415),
    ("/v1/completions", b"", None, 400),
    ("/v1/completions", b"null", None, 400),
    ("/v1/completions", b"[]", None, 400),
    ("/v1/completions", b'"a string"', None, 400),
    ("/v1/completions", {"prompt": "hi", "n": -1}, None, 400),
    ("/v1/completions", {"prompt": "hi", "n": 10**6}, None, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, None, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, None, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, None, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10**9}, None, 400),
    (
        "/v1/chat/completions",
        {"messages": _MESSAGES, "logprobs": True, "top_logprobs": 99},
        None,
        400,
    ),
    ("/v1/completions", {"prompt": [999_999]}, None, 400),
    ("/v1/completions", {"prompt": [[1, 2], [-3]]}, None, 400),
    ("/v1/completions", {"prompt": []}, None, 400),
    ("/v1/completions", {"prompt": [[]]}, None, 400),
    ("/v1/completions", {"prompt": [1, "mixed"]}, None, 400),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 1000}, None, 400),
    ("/v1/chat/completions", {"messages": []}, None, 400),
    ("/v1/chat/completions", {"messages": [{"role": 7, "content": "hi"}]}, None, 400),
    ("/v1/chat/completions", {"messages": [{"role": None, "content": "hi"}]}, None, 400),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, None, 400),
    ("/v1/chat/completions", {"messages": "hi"}, None, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        None,
        400,
    ),
    (
        "/v1/chat/completions",
        {"messages": _MESSAGES, "chat_template": "{% for i in range(99) %}"},
        None,
        400,
    ),
    ("/detokenize", {"tokens": [-1, 10**30]}, None, 400),
    # Integers past 64 bits in free-form JSON (tool parameters, schemas, template arguments):
    # refused on decoding, not a 500 on the way to the tokenizer.
    ("/v1/chat/completions", {"messages": _MESSAGES, "tools": [_WIDE_INT_TOOL]}, None, 400),
    (
        "/v1/chat/completions",
        {"messages": _MESSAGES, "chat_template_kwargs": {"a": -(10**30)}},
        None,
        400,
    ),
    (
        "/v1/chat/completions",
        {
            "messages": _MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"maxLength": 10**30}},
            },
        },
        None,
        400,
    ),
    (
        "/v1/responses",
        {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"a": 10**30}}]},
        None,
        400,
    ),
    ("/tokenize", {"prompt": "hi", "messages": _MESSAGES}, None, 400),
]


@pytest.mark.parametrize("path, body, content_type, status", HOSTILE)
def test_hostile_input_gets_a_4xx_with_a_message(fuzz_server, path, body, content_type, status):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type or "application/json"}
    r = httpx.post(fuzz_server.url + path, content=raw, headers=headers, timeout=60)
    error_of(r, status)


def test_wrong_methods_and_paths(fuzz_server):
    for method, path, status in [
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("GET", "/v1/nothing", 404),
        ("POST", "/../../etc/passwd", 404),
    ]:
        r = httpx.request(method, fuzz_server.url + path, timeout=30)
        assert r.status_code == status, (method, path, r.text)


def test_engine_unharmed_after_everything(fuzz_server):
    assert fuzz_server.healthy()
    r = fuzz_server.post(
        "/v1/completions", {"prompt": "The quick", "max_tokens": 8, "ignore_eos": True}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    stream = {"messages": _MESSAGES, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", fuzz_server.url + "/v1/chat/completions", json=stream) as r:
        assert r.status_code == 200
        assert "data: [DONE]" in [line for line in r.iter_lines()]
    assert "Traceback" not in fuzz_server.log_text(), fuzz_server.log_tail()


def test_wide_integer_in_anthropic_tools_gets_anthropic_400(fuzz_server):
    tool = {"name": "f", "input_schema": {"type": "object", "maxProperties": 10**30}}
    model = fuzz_server.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 4, "messages": _MESSAGES, "tools": [tool]}
    r = httpx.post(fuzz_server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert "tools[0].input_schema.maxProperties" in r.json()["error"]["message"]
