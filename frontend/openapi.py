"""The OpenAPI 3.1 description of the server (`GET /openapi.json`), made from the route
table (frontend/routes.py).

Request and response schemas come from the msgspec Structs the table names, limits
included, so the description cannot drift from what the server decodes. Fuzzers
(tests/test_fuzz.py runs schemathesis) and client generators read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

import zllm
from zllm.config.serve import ServeConfig
from zllm.frontend.access.permissions import Access
from zllm.frontend.routes import ApiRoute, Operation, Schema

_REF = "#/components/schemas/{name}"
_ERRORS = {
    400: "Invalid request (the error's `param` names the field).",
    401: "Missing or invalid API key.",
    404: "Unknown model.",
    413: "The request body is larger than --max-request-body-bytes.",
    503: "Overloaded (see Retry-After), shutting down, or the engine is restarting.",
    504: "The request ran past --request-timeout and was aborted.",
}
# Body fields the model's context length bounds.
_CONTEXT_BOUND = ("max_tokens", "max_completion_tokens")


def openapi_schema(config: ServeConfig, routes: Sequence[ApiRoute]) -> dict[str, Any]:
    documented = [r for r in routes if r.doc is not None]
    components = _components(config, documented)
    paths: dict[str, Any] = {}
    for route in documented:
        if route.documented_if is None or route.documented_if(config):
            paths[route.path] = {route.method.lower(): _operation(route)}
    schema: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "zllm", "version": zllm.__version__},
        "paths": paths,
        "components": {"schemas": components},
    }
    if config.api_keys:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
        for route in documented:
            if route.path in paths and (
                route.access is Access.PUBLIC
                or (route.access is Access.OBSERVABILITY and not config.protect_metrics)
            ):
                paths[route.path][route.method.lower()]["security"] = []
    return schema


def _components(config: ServeConfig, routes: list[ApiRoute]) -> dict[str, Any]:
    """Every body, response and error schema the routes name (features off included), with
    the served model names and the context length filled in."""
    structs: list[type] = []
    named: dict[str, Any] = {}
    for route in routes:
        assert route.doc is not None
        response = route.doc.response
        for t in (route.body, response, route.errors.schema):
            if isinstance(t, type) and t not in structs:
                structs.append(t)
        if isinstance(response, Schema) and response.name is not None:
            named[response.name] = response.schema
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    max_model_len = config.engine.scheduler.max_model_len
    for body in {r.body for r in routes if r.body is not None}:
        properties = components[body.__name__]["properties"]
        if "model" in properties:  # any other name: 404
            model = properties["model"]
            if "anyOf" in model:  # optional
                model["anyOf"] = [_model_names(config), {"type": "null"}]
            else:
                properties["model"] = _model_names(config)
        for name in _CONTEXT_BOUND:
            if name in properties:
                _set_maximum(properties[name], max_model_len)
    return components | named


def _model_names(config: ServeConfig) -> dict[str, Any]:
    """The names a request's `model` may take: the served names, or with LoRA any string
    (adapters come and go at run time; an unknown name is a 404)."""
    if config.engine.lora is not None:
        return {"type": "string"}
    return {"enum": list(config.model_names)}


def _operation(route: ApiRoute) -> dict[str, Any]:
    doc: Operation = route.doc  # type: ignore[assignment]
    ok: dict[str, Any] = {"description": doc.ok}
    if doc.response is not None:
        ok["content"] = _content(doc.response)
        if doc.stream:
            ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    error = {"application/json": {"schema": _ref(route.errors.schema.__name__)}}
    op: dict[str, Any] = {
        "operationId": doc.operation_id,
        "summary": doc.summary,
        "responses": {
            "200": ok,
            **{str(s): {"description": _ERRORS[s], "content": error} for s in doc.errors},
        },
    }
    if doc.parameters:
        op["parameters"] = list(doc.parameters)
    if route.body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(route.body.__name__)}},
        }
    return op


def _content(response: type | Schema) -> dict[str, Any]:
    if isinstance(response, Schema):
        schema = response.schema if response.name is None else _ref(response.name)
        return {response.media_type: {"schema": schema}}
    return {"application/json": {"schema": _ref(response.__name__)}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _set_maximum(schema: dict[str, Any], maximum: int) -> None:
    """Set `maximum` on the integer branch of a field's schema."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "integer":
            branch["maximum"] = min(branch.get("maximum", maximum), maximum)
