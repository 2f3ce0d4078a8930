"""The route table (frontend/routes.py) without a server: the door in front of the app
(frontend/middleware.py) and /openapi.json (frontend/openapi.py) both follow it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from zllm.frontend.admission import Admission
from zllm.frontend.middleware import Gate
from zllm.frontend.openapi import openapi_schema
from zllm.frontend.routes import ROUTES

KEY = "k-1"


def _config(protect_metrics: bool = False, lora: bool = False, keys: bool = True):
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(max_model_len=512),
        lora=object() if lora else None,
        enable_sleep_mode=False,
    )
    return SimpleNamespace(
        engine=engine,
        api_keys=[KEY] if keys else [],
        protect_metrics=protect_metrics,
        max_request_body_bytes=1 << 20,
        model_names=["tiny"],
    )


def _call(config, method: str, path: str, headers: list[tuple[bytes, bytes]]):
    """(status, body) of one request through the gate; the app behind it answers 200."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"app"})

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(Gate(app, config, Admission(4), ROUTES)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_api_key_needed_except_on_observability_routes() -> None:
    config = _config()
    auth = [(b"authorization", f"Bearer {KEY}".encode())]
    for route in ROUTES:
        status, _ = _call(config, route.method, route.path, [])
        assert (status == 200) == route.observability, route.path
        assert _call(config, route.method, route.path, auth)[0] == 200, route.path
    assert _call(config, "GET", "/no/such/route", [])[0] == 200  # the app's 404, not a 401
    protected = _config(protect_metrics=True)
    assert {_call(protected, r.method, r.path, [])[0] for r in ROUTES} == {401}
    assert [r.path for r in ROUTES if r.observability] == [
        "/health",
        "/version",
        "/metrics",
        "/dashboard",
        "/dashboard/stats",
    ]


def test_refusals_take_their_routes_api_shape() -> None:
    """A body that is not JSON: Anthropic's error on its routes, OpenAI's elsewhere."""
    config = _config()
    headers = [(b"x-api-key", KEY.encode()), (b"content-type", b"text/plain")]
    for route in ROUTES:
        if route.method != "POST":
            continue
        status, body = _call(config, "POST", route.path, headers)
        assert status == 415, route.path
        anthropic = route.path.startswith("/v1/messages")
        assert (json.loads(body).get("type") == "error") == anthropic, route.path


def test_openapi_describes_the_documented_routes() -> None:
    for lora in (False, True):
        spec = openapi_schema(_config(lora=lora), ROUTES)  # type: ignore[arg-type]
        expected = {
            r.path
            for r in ROUTES
            if r.doc is not None
            and (r.documented_if is None or r.documented_if(_config(lora=lora)))
        }
        assert set(spec["paths"]) == expected
        assert ("/v1/load_lora_adapter" in spec["paths"]) == lora
        for route in ROUTES:
            if route.path not in spec["paths"]:
                continue
            op = spec["paths"][route.path][route.method.lower()]
            assert (op.get("security") == []) == route.observability, route.path
            if route.body is not None:
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/" + route.body.__name__)
                assert route.body.__name__ in spec["components"]["schemas"]
    for name, field in [
        ("CompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_completion_tokens"),
        ("MessagesRequest", "max_tokens"),
    ]:
        bounded = spec["components"]["schemas"][name]["properties"][field]
        assert [b["maximum"] for b in bounded.get("anyOf", [bounded]) if "maximum" in b] == [512]
