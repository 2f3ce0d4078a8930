"""JSON and server-sent-event bodies, and errors in OpenAI's shape, for every route; an
output the engine failed as the request's error, in every API."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

from zllm.errors import ERROR_TYPES, RequestError
from zllm.frontend.openai.protocol import ErrorInfo, ErrorResponse
from zllm.protocol import FinishReason, RequestOutputDelta

RETRY_AFTER_S = 1  # what a 503 tells clients to wait before retrying
DONE_EVENT = b"data: [DONE]\n\n"

_json_encoder = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _json_encoder.encode(body), status, headers=headers, media_type="application/json"
    )


def error_response(error: RequestError) -> Response:
    """`{"error": {...}}` with the error's status; a 503 says when to retry."""
    headers = error.headers
    if error.status == 503 and not headers:  # overloaded, draining or the engine restarting
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return json_response(_error_body(error), error.status, headers)


def sse_event(body: Any) -> bytes:
    return b"data: " + _json_encoder.encode(body) + b"\n\n"


def error_event(error: RequestError) -> bytes:
    """The last event of a stream that failed after it started (then `[DONE]`)."""
    return sse_event(_error_body(error))


def check_failed(delta: RequestOutputDelta) -> None:
    """An output the engine failed is the request's 500, in every API."""
    if delta.finish_reason == FinishReason.ERROR:
        raise RequestError(
            f"the request failed in the engine: {delta.stop_reason or 'unknown error'}", 500
        )


def encode_json(body: Any) -> bytes:
    return _json_encoder.encode(body)


def _error_body(error: RequestError) -> ErrorResponse:
    error_type = ERROR_TYPES.get(error.status, "InternalServerError")
    return ErrorResponse(
        ErrorInfo(error.message, error_type, error.param, error.code or str(error.status))
    )
