"""The OpenAI-compatible HTTP server: a Starlette app over an `EngineClient`.

    POST /v1/completions, /v1/chat/completions   generation (JSON, or SSE with `stream`)
    GET  /v1/models                              the served model names (LoRA adapters too;
                                                 a disaggregated server's kv_transfer part)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   LoRA adapters at run time (vLLM's)
    POST /sleep?level=1|2, /wake_up[?tags=weights|kv_cache]; GET /is_sleeping   (sleep mode)
    POST /reset_prefix_cache[?tiers=1]                                         (vLLM's)
    POST /tokenize, /detokenize                  vLLM's shapes, with the frontend's tokenizer
    GET  /health                                 open even when an API key is set
    GET  /version, /metrics                      open too, unless --protect-metrics
    GET  /dashboard, /dashboard/stats            the live dashboard (frontend/observability/dashboard.py),
                                                 as /metrics; each shows what its reader may
                                                 see (frontend/access/permissions.py)
    GET  /openapi.json                           the API's OpenAPI 3.1 description

The routes, the door's rules and /openapi.json all come from one table (frontend/routes.py);
this module makes the Starlette app from it. The handlers that are no generation API live in
frontend/handlers/ (`OpenAIServer` and its parts). The routes only parse: every generation
API turns its body into a job through `Generation.serve` (frontend/generate.py), streams and
disconnects go through `frontend/streaming.py`, keys/limits/admission through
`frontend/access/middleware.py`. Every error is its API's (OpenAI's `{"error": {...}}`, or
Anthropic's) with its HTTP status.
No torch in this process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from operator import attrgetter
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zllm.config.serve import ServeConfig
from zllm.errors import RequestError
from zllm.frontend.access.middleware import Gate
from zllm.frontend.handlers.server import OpenAIServer
from zllm.frontend.openai.protocol import decode_body
from zllm.frontend.replies import error_response
from zllm.frontend.routes import ROUTES, ApiRoute
from zllm.frontend.streaming import ClientGone
from zllm.runtime.engine_client import EngineClient
from zllm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


def build_app(
    config: ServeConfig,
    client: EngineClient,
    tokenizer: Tokenizer,
    run_dir: str | None = None,
) -> Starlette:
    """`run_dir`: the supervisor's run directory, where state that must outlive a frontend
    restart is kept (the LoRA adapters loaded at run time)."""
    server = OpenAIServer(config, client, tokenizer, run_dir)
    routes = [Route(r.path, _endpoint(server, r), methods=[r.method], name=r.path) for r in ROUTES]
    middleware = [
        Middleware(
            Gate,
            config=config,
            admission=server.admission,
            routes=ROUTES,
            tenant_limits=server.tenant_limits,
        )
    ]
    if config.allowed_origins:  # CORS is off unless asked for
        cors = Middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
        middleware.insert(0, cors)  # outermost: preflights need no API key
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_exception},
    )
    app.state.server = server
    return app


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(RequestError(exc.detail, exc.status_code))


def _endpoint(server: OpenAIServer, route: ApiRoute) -> Endpoint:
    """The route's handler, with its body decoded first (if it has one); any failure
    becomes an error in the route's API's shape, and the server keeps serving."""
    if isinstance(route.handler, str):
        handler = attrgetter(route.handler)(server)
    else:
        handler = functools.partial(server.generation.serve, route.handler)

    async def endpoint(request: Request) -> Response:
        try:
            if route.body is None:
                return await handler(request)
            return await handler(request, _decode(await request.body(), route.body))
        except RequestError as e:
            return route.errors.response(e)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            logger.exception("error serving %s %s", request.method, request.url.path)
            error = RequestError(f"internal server error: {type(e).__name__}: {e}", 500)
            return route.errors.response(error)

    return endpoint


def _decode(data: bytes, cls: type) -> Any:
    body, unknown = decode_body(data, cls)
    if unknown:
        logger.warning("The request has fields this server ignores: %s", ", ".join(unknown))
    return body
