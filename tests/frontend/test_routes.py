"""The route table (frontend/routes.py) without a server: the door in front of the app
(frontend/access/middleware.py) and /openapi.json (frontend/openapi.py) both follow it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from zllm.frontend.access.admission import Admission
from zllm.frontend.access.middleware import Gate
from zllm.frontend.access.permissions import EVERYONE, VIEWER_KEY, Access, Viewer
from zllm.frontend.openapi import openapi_schema
from zllm.frontend.routes import ROUTES

KEY = "k-1"
KEY_2 = "k-2"
METRICS_KEY = "m-1"


def _config(
    protect_metrics: bool = False,
    lora: bool = False,
    keys: bool = True,
    metrics_keys: tuple[str, ...] = (),
    isolation: str = "none",
):
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(max_model_len=512),
        lora=object() if lora else None,
        enable_sleep_mode=False,
    )
    return SimpleNamespace(
        engine=engine,
        api_keys=[KEY, KEY_2] if keys else [],
        metrics_api_keys=list(metrics_keys),
        protect_metrics=protect_metrics,
        prefix_cache_isolation=isolation,
        max_request_body_bytes=1 << 20,
        model_names=["tiny"],
    )


def _call(config, method: str, path: str, headers: list[tuple[bytes, bytes]], seen=None):
    """(status, body) of one request through the gate; the app behind it answers 200 (and
    appends the scope it got to `seen`)."""

    async def app(scope, receive, send):
        if seen is not None:
            seen.append(scope)
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
        assert (status == 200) == (route.access is not Access.API), route.path
        assert _call(config, route.method, route.path, auth)[0] == 200, route.path
    assert _call(config, "GET", "/no/such/route", [])[0] == 200  # the app's 404, not a 401
    protected = _config(protect_metrics=True)
    refused = {r.path for r in ROUTES if _call(protected, r.method, r.path, [])[0] == 401}
    assert refused == {r.path for r in ROUTES} - {"/health"}  # load balancers need no key
    assert [r.path for r in ROUTES if r.access is Access.PUBLIC] == ["/health"]
    assert [r.path for r in ROUTES if r.access is Access.OBSERVABILITY] == [
        "/version",
        "/metrics",
        "/dashboard",
        "/dashboard/stats",
    ]


def _viewer(config, key: str | None, path: str = "/metrics"):
    """The Viewer the gate hands an observability route, or the status it refused with."""
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    seen: list = []
    status, _ = _call(config, "GET", path, headers, seen)
    return seen[0][VIEWER_KEY] if status == 200 else status


def test_who_reads_the_observability_routes_and_what_they_see() -> None:
    """Under tenant isolation with --protect-metrics an API key reads its own tenant's
    view; a --metrics-api-key reads everyone's and opens nothing else; open routes, or no
    isolation, show everyone's to anyone."""
    isolated = _config(protect_metrics=True, metrics_keys=(METRICS_KEY,), isolation="tenant")
    for path in ("/metrics", "/dashboard/stats", "/dashboard", "/version"):
        assert _viewer(isolated, KEY, path) == Viewer("key-1")
    assert _viewer(isolated, KEY_2) == Viewer("key-2")
    assert _viewer(isolated, METRICS_KEY) == EVERYONE
    assert _viewer(isolated, None) == 401 and _viewer(isolated, "wrong") == 401
    headers = [(b"authorization", f"Bearer {METRICS_KEY}".encode())]
    for route in ROUTES:
        if route.access is Access.API:  # a scraper's key spends no compute, reads no models
            assert _call(isolated, route.method, route.path, headers)[0] == 401, route.path
    assert _call(isolated, "GET", "/health", [])[0] == 200
    shared = _config(protect_metrics=True, metrics_keys=(METRICS_KEY,), isolation="none")
    assert _viewer(shared, KEY) == EVERYONE and _viewer(shared, METRICS_KEY) == EVERYONE
    open_routes = _config(isolation="tenant")
    assert _viewer(open_routes, None) == EVERYONE and _viewer(open_routes, KEY) == EVERYONE
    # A metrics key alone protects the observability routes of a server without API keys.
    scraped = _config(protect_metrics=True, keys=False, metrics_keys=(METRICS_KEY,))
    assert _viewer(scraped, None) == 401 and _viewer(scraped, METRICS_KEY) == EVERYONE
    assert _call(scraped, "GET", "/v1/models", [])[0] == 200


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
            assert (op.get("security") == []) == (route.access is not Access.API), route.path
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
