"""The OpenAPI 3.1 description of the server (`GET /openapi.json`).

Request and response schemas come from the msgspec Structs in `api_models.py`, limits
included, so the description cannot drift from what the server decodes. Fuzzers
(tests/test_fuzz.py runs schemathesis) and client generators read it.
"""

from __future__ import annotations

from typing import Any

import msgspec

import zllm
from zllm.frontend.anthropic_api import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
)
from zllm.frontend.api_models import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeBody,
    DetokenizeResponse,
    EmbeddingsRequest,
    EmbeddingsResponse,
    ErrorResponse,
    LoadLoRAAdapterBody,
    ModelList,
    TokenizeBody,
    TokenizeResponse,
    UnloadLoRAAdapterBody,
)
from zllm.frontend.responses_api import ResponsesRequest
from zllm.serve_config import ServeConfig

_REF = "#/components/schemas/{name}"
_ERRORS = {
    400: "Invalid request (the error's `param` names the field).",
    401: "Missing or invalid API key.",
    404: "Unknown model.",
    413: "The request body is larger than --max-request-body-bytes.",
    503: "Overloaded (see Retry-After), shutting down, or the engine is restarting.",
    504: "The request ran past --request-timeout and was aborted.",
}


def openapi_schema(config: ServeConfig) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [
            CompletionRequest,
            ChatCompletionRequest,
            TokenizeBody,
            DetokenizeBody,
            CompletionResponse,
            ChatCompletionResponse,
            ModelList,
            TokenizeResponse,
            DetokenizeResponse,
            ErrorResponse,
            ResponsesRequest,
            EmbeddingsRequest,
            EmbeddingsResponse,
            MessagesRequest,
            MessagesResponse,
            CountTokensRequest,
            CountTokensResponse,
            AnthropicError,
            LoadLoRAAdapterBody,
            UnloadLoRAAdapterBody,
        ],
        ref_template=_REF,
    )
    max_model_len = config.engine.scheduler.max_model_len
    for name, field in (
        ("CompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_completion_tokens"),
    ):
        _set_maximum(components[name]["properties"][field], max_model_len)
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "TokenizeBody",
        "DetokenizeBody",
        "EmbeddingsRequest",
    ):
        model = components[name]["properties"]["model"]  # any other name: 404
        model["anyOf"] = [_model_names(config), {"type": "null"}]

    # A Response object (built as a dict: OpenAI's shape, its required fields included).
    components["ResponseObject"] = {"type": "object", "required": ["id", "object", "output"]}
    components["ResponsesRequest"]["properties"]["model"]["anyOf"] = [
        _model_names(config),
        {"type": "null"},
    ]
    for name in ("MessagesRequest", "CountTokensRequest"):
        components[name]["properties"]["model"] = _model_names(config)
    _set_maximum(components["MessagesRequest"]["properties"]["max_tokens"], max_model_len)

    generation_errors = (400, 401, 404, 413, 503, 504)
    paths = {
        "/v1/completions": {
            "post": _operation(
                "createCompletion",
                "Complete prompts (JSON, or server-sent events with `stream`).",
                "CompletionRequest",
                "CompletionResponse",
                generation_errors,
                stream=True,
            )
        },
        "/v1/chat/completions": {
            "post": _operation(
                "createChatCompletion",
                "Answer a conversation (JSON, or server-sent events with `stream`).",
                "ChatCompletionRequest",
                "ChatCompletionResponse",
                generation_errors,
                stream=True,
            )
        },
        "/v1/embeddings": {
            "post": _operation(
                "createEmbedding",
                "The prompts' final hidden states, pooled (--pooling) and L2-normalized.",
                "EmbeddingsRequest",
                "EmbeddingsResponse",
                (400, 401, 404, 413, 503, 504),
            )
        },
        "/v1/responses": {
            "post": _operation(
                "createResponse",
                "OpenAI's Responses API, stateless (JSON, or its server-sent events with "
                "`stream`); previous_response_id and store true are 400s.",
                "ResponsesRequest",
                "ResponseObject",
                generation_errors,
                stream=True,
            )
        },
        "/v1/messages": {
            "post": _operation(
                "createMessage",
                "Anthropic's Messages API (JSON, or Anthropic's server-sent events with "
                "`stream`); errors in Anthropic's shape.",
                "MessagesRequest",
                "MessagesResponse",
                generation_errors,
                stream=True,
                error_schema="AnthropicError",
            )
        },
        "/v1/messages/count_tokens": {
            "post": _operation(
                "countMessageTokens",
                "The prompt tokens a Messages request would have.",
                "CountTokensRequest",
                "CountTokensResponse",
                (400, 401, 404, 413),
                error_schema="AnthropicError",
            )
        },
        "/v1/models": {
            "get": _operation("listModels", "The served model names.", None, "ModelList", (401,))
        },
        "/tokenize": {
            "post": _operation(
                "tokenize",
                "Token ids of a prompt or of chat messages.",
                "TokenizeBody",
                "TokenizeResponse",
                (400, 401, 404, 413),
            )
        },
        "/detokenize": {
            "post": _operation(
                "detokenize",
                "Text of token ids.",
                "DetokenizeBody",
                "DetokenizeResponse",
                (400, 401, 404, 413),
            )
        },
        "/health": {
            "get": {
                "operationId": "health",
                "summary": "200 when every process is up and the engine answers, else 503.",
                "responses": {"200": {"description": "Healthy."}, **_error_responses((503,))},
            }
        },
        "/version": {
            "get": {
                "operationId": "version",
                "summary": "The server's version.",
                "responses": {"200": {"description": "The version."}},
            }
        },
    }
    if config.engine.lora is not None:
        paths |= _lora_paths()
    if config.engine.enable_sleep_mode:
        paths |= _sleep_paths()
    schema: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "zllm", "version": zllm.__version__},
        "paths": paths,
        "components": {"schemas": components},
    }
    if config.api_keys:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
        if not config.protect_metrics:
            for path in ("/health", "/version"):
                paths[path]["get"]["security"] = []
    return schema


def _model_names(config: ServeConfig) -> dict[str, Any]:
    """The names a request's `model` may take: the served names, or with LoRA any string
    (adapters come and go at run time; an unknown name is a 404)."""
    if config.engine.lora is not None:
        return {"type": "string"}
    return {"enum": list(config.model_names)}


def _lora_paths() -> dict[str, Any]:
    """vLLM's run-time LoRA routes (with --enable-lora); they answer in plain text."""
    text = {"text/plain": {"schema": {"type": "string"}}}
    paths = {}
    for path, op_id, summary, body, errors in (
        (
            "/v1/load_lora_adapter",
            "loadLoraAdapter",
            "Check a PEFT LoRA adapter against the base model and serve it under lora_name.",
            "LoadLoRAAdapterBody",
            (400, 401),
        ),
        (
            "/v1/unload_lora_adapter",
            "unloadLoraAdapter",
            "Stop serving an adapter (its running requests finish).",
            "UnloadLoRAAdapterBody",
            (400, 401, 404),
        ),
    ):
        op = _operation(op_id, summary, body, "ErrorResponse", errors)
        op["responses"]["200"] = {"description": "OK", "content": text}
        paths[path] = {"post": op}
    return paths


def _sleep_paths() -> dict[str, Any]:
    """Sleep mode's routes (with --enable-sleep-mode), as vLLM names them."""
    ok = {"200": {"description": "Done."}, **_error_responses((400, 401))}
    level = {"name": "level", "in": "query", "schema": {"type": "integer", "enum": [1, 2]}}
    state = {"type": "object", "properties": {"is_sleeping": {"type": "boolean"}}}
    return {
        "/sleep": {
            "post": {
                "operationId": "sleep",
                "summary": "Release the weights and KV cache while idle (400 while requests run).",
                "parameters": [level],
                "responses": ok,
            }
        },
        "/wake_up": {
            "post": {
                "operationId": "wakeUp",
                "summary": "Load the weights again; the prefix cache starts empty.",
                "responses": ok,
            }
        },
        "/is_sleeping": {
            "get": {
                "operationId": "isSleeping",
                "summary": "Whether the engine sleeps.",
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {"application/json": {"schema": state}},
                    }
                },
            }
        },
    }


def _operation(
    operation_id: str,
    summary: str,
    request: str | None,
    response: str,
    errors: tuple[int, ...],
    stream: bool = False,
    error_schema: str = "ErrorResponse",
) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": _REF.format(name=response)}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": content},
            **_error_responses(errors, error_schema),
        },
    }
    if request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name=request)}}},
        }
    return op


def _error_responses(statuses: tuple[int, ...], schema: str = "ErrorResponse") -> dict[str, Any]:
    error = {"application/json": {"schema": {"$ref": _REF.format(name=schema)}}}
    return {str(s): {"description": _ERRORS[s], "content": error} for s in statuses}


def _set_maximum(schema: dict[str, Any], maximum: int) -> None:
    """Set `maximum` on the integer branch of a field's schema."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "integer":
            branch["maximum"] = min(branch.get("maximum", maximum), maximum)
