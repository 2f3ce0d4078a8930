"""The OpenAI-compatible HTTP server: a Starlette app over an `EngineClient`.

    POST /v1/completions, /v1/chat/completions   generation (JSON, or SSE with `stream`)
    GET  /v1/models                              the served model names
    POST /tokenize, /detokenize                  vLLM's shapes, with the frontend's tokenizer
    GET  /health, /version, /metrics             open even when an API key is set
                                                 (unless --protect-metrics)
    GET  /openapi.json                           the API's OpenAPI 3.1 description

Every error is OpenAI's `{"error": {...}}` with its HTTP status. A request whose client goes
away stops iterating its outputs, which aborts it in the core. No torch in this process.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import generate_latest as prometheus_text
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

import zllm
from zllm.engine_client import EngineClient, EngineError
from zllm.frontend.admission import (
    BODY_TIMEOUT_S,
    RETRY_AFTER_S,
    SCOPE_KEY,
    Admission,
    BodyTooLarge,
    Ticket,
    read_body,
    replay,
    too_large_message,
)
from zllm.frontend.api_models import (
    ApiError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeBody,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    StreamOptions,
    TokenizeBody,
    TokenizeResponse,
    UsageInfo,
    decode_body,
)
from zllm.frontend.metrics import Metrics
from zllm.frontend.openai_format import (
    ChatAssembler,
    CompletionAssembler,
    LogprobText,
    chat_messages,
    chat_params,
    completion_params,
    prompt_inputs,
)
from zllm.frontend.openapi import openapi_schema
from zllm.protocol import RequestOutputDelta, TokenizeRequest
from zllm.serve_config import ServeConfig
from zllm.tokenizer_proc.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    408: "TimeoutError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}
_SHUTTING_DOWN = "the server is shutting down"
_DONE = b"data: [DONE]\n\n"
# Tokenize or detokenize this much in a worker thread, not on the event loop.
_BIG_INPUT = 16384

_json_encoder = msgspec.json.Encoder()


def build_app(config: ServeConfig, client: EngineClient, tokenizer: Tokenizer) -> Starlette:
    server = OpenAIServer(config, client, tokenizer)
    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/dashboard", server.prometheus.dashboard.page, methods=["GET"]),
        Route("/dashboard/stats", server.prometheus.dashboard.stats, methods=["GET"]),
    ]
    routes.append(Route("/openapi.json", server.openapi, methods=["GET"]))
    middleware = [Middleware(_Gate, server=server, routes=routes)]
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


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    error_type = _ERROR_TYPES.get(status, "InternalServerError")
    body = ErrorResponse(ErrorInfo(message, error_type, param, code or status))
    if status == 503 and not headers:  # overloaded, draining or the engine restarting
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return _json(body, status, headers)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _json_encoder.encode(body), status, headers=headers, media_type="application/json"
    )


def _event(body: Any) -> bytes:
    return b"data: " + _json_encoder.encode(body) + b"\n\n"


def _error_event(e: ApiError | EngineError) -> bytes:
    error_type = _ERROR_TYPES.get(e.status, "InternalServerError")
    code = getattr(e, "code", None) or e.status
    return _event(ErrorResponse(ErrorInfo(e.message, error_type, e.param, code)))


def _usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage in every chunk too)."""
    if options is None or not options.include_usage:
        return False, False
    return True, options.continuous_usage_stats


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.detail, exc.status_code)


def _api_errors(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Any failure of a route becomes an OpenAI error response; the server keeps serving."""

    @functools.wraps(handler)
    async def wrapper(self: OpenAIServer, request: Request) -> Response:
        try:
            return await handler(self, request)
        except ApiError as e:
            return error_response(e.message, e.status, e.param, e.code, e.headers)
        except EngineError as e:
            return error_response(e.message, e.status, e.param, e.code)
        except _ClientGone:
            return Response(status_code=499)
        except Exception as e:
            logger.exception("error serving %s %s", request.method, request.url.path)
            return error_response(f"internal server error: {type(e).__name__}: {e}", 500)

    return wrapper


class OpenAIServer:
    """The route handlers and what they share: engine client, tokenizer, metrics."""

    def __init__(self, config: ServeConfig, client: EngineClient, tokenizer: Tokenizer) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.names = LogprobText(tokenizer)
        self.max_model_len = config.engine.scheduler.max_model_len
        self.created = int(time.time())
        self.draining = False
        self.prometheus = Metrics(client, config.model_names[0])
        self.admission = Admission(config.max_in_flight)
        self._openapi: bytes | None = None

    def start_draining(self) -> None:
        """SIGTERM: new requests get 503 from now on; those in flight go on."""
        self.draining = True

    # ---- generation ----------------------------------------------------------------------
    @_api_errors
    async def completions(self, request: Request) -> Response:
        body, unknown = decode_body(await request.body(), CompletionRequest)
        self._warn_unknown(unknown)
        model = self._model_name(body.model)
        prompts = prompt_inputs(body.prompt)
        params, echo_only = completion_params(body, self.max_model_len)
        self.admission.admit(request.scope.get(SCOPE_KEY), len(prompts))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        now = time.time()
        engine_requests = [
            TokenizeRequest(
                req_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
                sampling_params=params,
                prompt=p.text,
                prompt_token_ids=p.token_ids,
                add_special_tokens=body.add_special_tokens,
                arrival_time=now,
            )
            for i, p in enumerate(prompts)
        ]
        self._log_request(request_id, engine_requests)
        assembler = CompletionAssembler(
            n=params.n,
            prompts=prompts,
            echo=body.echo,
            echo_only=echo_only,
            want_logprobs=body.logprobs is not None,
            want_prompt_logprobs=body.prompt_logprobs is not None,
            names=self.names,
        )
        outputs = self._outputs(engine_requests)
        created = int(now)

        def chunk(choices: list[CompletionStreamChoice], usage: UsageInfo | None = None) -> bytes:
            return _event(
                CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=choices, usage=usage
                )
            )

        if body.stream:
            include_usage, continuous_usage = _usage_options(body.stream_options)

            async def events() -> AsyncIterator[bytes]:
                async for prompt_index, delta in outputs:
                    choice = assembler.add(prompt_index, delta)
                    if choice is not None:
                        usage = assembler.usage.info() if continuous_usage else None
                        yield chunk([choice], usage)
                if include_usage:
                    yield chunk([], assembler.usage.info())

            return await self._stream(request, events(), outputs)

        async def collect() -> None:
            async for prompt_index, delta in outputs:
                assembler.collect(prompt_index, delta)

        await _until_disconnect(request, collect(), outputs)
        return _json(
            CompletionResponse(
                id=request_id,
                created=created,
                model=model,
                choices=assembler.finish(),
                usage=assembler.usage.info(),
            )
        )

    @_api_errors
    async def chat_completions(self, request: Request) -> Response:
        body, unknown = decode_body(await request.body(), ChatCompletionRequest)
        self._warn_unknown(unknown)
        model = self._model_name(body.model)
        messages = chat_messages(body.messages)
        params = chat_params(body, self.max_model_len)
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            raise ApiError(
                "This server does not accept a chat_template in requests "
                "(start it with --trust-request-chat-template to allow it).",
                param="chat_template",
            )
        self.admission.admit(request.scope.get(SCOPE_KEY), 1)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = time.time()
        engine_request = TokenizeRequest(
            req_id=request_id,
            sampling_params=params,
            messages=messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template=body.chat_template,
            add_special_tokens=body.add_special_tokens,
            arrival_time=now,
        )
        self._log_request(request_id, [engine_request])
        assembler = ChatAssembler(
            n=params.n,
            want_logprobs=body.logprobs,
            want_prompt_logprobs=body.prompt_logprobs is not None,
            names=self.names,
        )
        outputs = self._outputs([engine_request])
        created = int(now)

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> bytes:
            return _event(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=choices, usage=usage
                )
            )

        if body.stream:
            include_usage, continuous_usage = _usage_options(body.stream_options)

            async def events() -> AsyncIterator[bytes]:
                started = False
                async for _, delta in outputs:
                    if not started:  # after the first output: errors before it are a 4xx/5xx
                        started = True
                        for i in range(params.n):
                            role = DeltaMessage(role="assistant", content="")
                            yield chunk([ChatStreamChoice(index=i, delta=role)])
                    choice = assembler.add(delta)
                    if choice is not None:
                        yield chunk([choice], assembler.usage.info() if continuous_usage else None)
                if include_usage:
                    yield chunk([], assembler.usage.info())

            return await self._stream(request, events(), outputs)

        async def collect() -> None:
            async for _, delta in outputs:
                assembler.collect(delta)

        await _until_disconnect(request, collect(), outputs)
        return _json(
            ChatCompletionResponse(
                id=request_id,
                created=created,
                model=model,
                choices=assembler.finish(),
                usage=assembler.usage.info(),
                prompt_logprobs=assembler.prompt_logprobs,
            )
        )

    async def _outputs(
        self, requests: list[TokenizeRequest]
    ) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
        """Every prompt's output deltas as (prompt index, delta). Each prompt is one engine
        request for the metrics (observed as its outputs arrive) and the request log."""
        traces = [self.prometheus.track(r) for r in requests]
        merged = _merge([self.client.generate(r) for r in requests])
        interrupted = "error"  # how requests the engine did not finish end, if cut short
        try:
            async for prompt_index, delta in merged:
                self.prometheus.on_output(traces[prompt_index], delta)
                yield prompt_index, delta
        except (asyncio.CancelledError, GeneratorExit):
            interrupted = "abort"  # the client went away
            raise
        except EngineError as e:
            # 504: the request timeout aborted it; 4xx: refused as invalid, it never ran.
            interrupted = "abort" if e.status == 504 else "rejected" if e.status < 500 else "error"
            raise
        finally:
            await merged.aclose()
            for trace in traces:
                self.prometheus.finish(trace, interrupted)
                if self.config.enable_log_requests:
                    logger.info(trace.log_line())

    async def _stream(
        self,
        request: Request,
        events: AsyncIterator[bytes],
        outputs: AsyncIterator[Any],
    ) -> Response:
        """An SSE response, started once the first event is ready: a request the engine
        refuses (a prompt too long, the engine down) still gets a proper error status."""
        try:
            first = await _until_disconnect(request, _first(events), outputs)
        except BaseException:
            await events.aclose()
            raise
        return _EventStream(_sse_body(first, events, outputs))

    # ---- other routes --------------------------------------------------------------------
    @_api_errors
    async def models(self, request: Request) -> Response:
        cards = [
            ModelCard(
                id=name,
                created=self.created,
                root=self.config.engine.model_path,
                max_model_len=self.max_model_len,
            )
            for name in self.config.model_names
        ]
        return _json(ModelList(cards))

    async def health(self, request: Request) -> Response:
        if self.draining:
            return error_response(_SHUTTING_DOWN, 503)
        ok, reason = self.client.health()
        if ok:
            return Response(status_code=200)
        return error_response(reason, 503)

    async def version(self, request: Request) -> Response:
        return _json({"version": zllm.__version__})

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            self._openapi = _json_encoder.encode(openapi_schema(self.config))
        return Response(self._openapi, media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        return Response(prometheus_text(self.prometheus.registry), media_type=CONTENT_TYPE_LATEST)

    @_api_errors
    async def tokenize(self, request: Request) -> Response:
        body, unknown = decode_body(await request.body(), TokenizeBody)
        self._warn_unknown(unknown)
        self._model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError("Give exactly one of prompt and messages.", param="prompt")
        if body.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(
                    chat_messages(body.messages), add_generation_prompt=body.add_generation_prompt
                )
            except Exception as e:  # jinja errors, or a model without a template
                raise ApiError(f"Could not apply the chat template: {e}", param="messages") from e
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        tokens = await _maybe_in_thread(len(text), self.tokenizer.encode, text, add_special)
        token_strs = None
        if body.return_token_strs:
            token_strs = [self.tokenizer.backend.id_to_token(t) or "" for t in tokens]
        return _json(
            TokenizeResponse(
                count=len(tokens),
                max_model_len=self.max_model_len,
                tokens=tokens,
                token_strs=token_strs,
            )
        )

    @_api_errors
    async def detokenize(self, request: Request) -> Response:
        body, unknown = decode_body(await request.body(), DetokenizeBody)
        self._warn_unknown(unknown)
        self._model_name(body.model)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                f"Token id {bad} is out of vocabulary range [0, {vocab}).", param="tokens"
            )
        text = await _maybe_in_thread(len(body.tokens), self.tokenizer.decode, body.tokens, False)
        return _json(DetokenizeResponse(prompt=text))

    # ---- helpers -------------------------------------------------------------------------
    def _model_name(self, requested: str | None) -> str:
        names = self.config.model_names
        if requested is None or requested in names:
            return requested or names[0]
        raise ApiError(
            f"The model `{requested}` does not exist. Served models: {', '.join(names)}.",
            status=404,
            param="model",
            code="model_not_found",
        )

    @staticmethod
    def _warn_unknown(unknown: list[str]) -> None:
        if unknown:
            logger.warning("The request has fields this server ignores: %s", ", ".join(unknown))

    def _log_request(self, request_id: str, requests: list[TokenizeRequest]) -> None:
        """With --enable-log-requests, one line per prompt as it arrives, with the start of
        its prompt (the flag is the operator's consent to prompt text in the log); `_outputs`
        logs one line per prompt as it ends, which never holds text."""
        if not self.config.enable_log_requests:
            return
        for r in requests:
            prompt = r.prompt if r.prompt is not None else (r.messages or r.prompt_token_ids)
            preview = repr(prompt)
            if len(preview) > 200:
                preview = preview[:200] + f"... ({len(preview)} chars)"
            logger.info(
                "request received: id=%s prompt=%s params=%s", r.req_id, preview, r.sampling_params
            )


# ---- streams and disconnects -------------------------------------------------------------


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def _merge(
    streams: list[AsyncIterator[RequestOutputDelta]],
) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
    """Interleave several prompts' outputs as they come. Closing this closes them all (which
    aborts the unfinished ones in the core)."""
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for delta in stream:
                yield 0, delta
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutputDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first(events: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, work: Awaitable, outputs: AsyncIterator[Any]):
    """Run `work` unless the client goes away first; then stop it and abort its requests."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await outputs.aclose()  # in case `work` was cancelled outside the generator
    if task.cancelled():
        raise _ClientGone
    return task.result()


async def _sse_body(
    first: bytes | None, events: AsyncIterator[bytes], outputs: AsyncIterator[Any]
) -> AsyncIterator[bytes]:
    """The SSE events, then `[DONE]`; a failure after the start becomes an error event."""
    try:
        if first is not None:
            yield first
            async for event in events:
                yield event
    except (ApiError, EngineError) as e:
        yield _error_event(e)
    except Exception as e:
        logger.exception("error while streaming")
        yield _error_event(EngineError(f"internal server error: {type(e).__name__}: {e}", 500))
    finally:
        await events.aclose()
        await outputs.aclose()
    yield _DONE


class _EventStream(Response):
    """Server-sent events that stop (and abort the request) as soon as the client leaves.

    uvicorn drops writes to a closed connection silently, so the disconnect is watched on
    the receive channel, not discovered by a failing send.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait((sender, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not sender.done():
                sender.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            await self.body_iterator.aclose()
        if not sender.cancelled() and sender.exception() is not None:
            logger.error("SSE stream failed: %r", sender.exception())

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _maybe_in_thread(size: int, fn: Callable, *args: Any) -> Any:
    if size > _BIG_INPUT:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


# ---- auth and admission ------------------------------------------------------------------


_OBSERVABILITY_PATHS = ("/health", "/metrics", "/dashboard", "/version")
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class _Gate:
    """In front of every route, before any body is read: API keys, 503 once draining or
    overloaded, the body's size and type; then admission accounting for generation.

    With API keys set, every route needs one except /health, /metrics, /dashboard and
    /version (those too with `--protect-metrics`); an unknown path gets its 404 without."""

    def __init__(self, app: ASGIApp, server: OpenAIServer, routes: list[BaseRoute]) -> None:
        self.app = app
        self.server = server
        self.routes = routes
        config = server.config
        # Keys are compared as SHA-256 digests: constant time, whatever their lengths.
        self.key_digests = [hashlib.sha256(k.encode()).digest() for k in config.api_keys]
        self.open_paths = () if config.protect_metrics else _OBSERVABILITY_PATHS
        self.max_body = config.max_request_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            body = await asyncio.wait_for(read_body(receive, self.max_body), BODY_TIMEOUT_S)
        except BodyTooLarge:
            response = error_response(too_large_message(self.max_body), 413)
            return await response(scope, receive, send)
        except asyncio.TimeoutError:  # a client trickling its body in holds a connection
            message = f"The request body did not arrive within {BODY_TIMEOUT_S:g} s."
            return await error_response(message, 408)(scope, receive, send)
        if body is None:
            return  # the client left before sending its whole request
        receive = replay(body, receive)
        if scope["path"] not in _GENERATION_PATHS:
            return await self.app(scope, receive, send)
        ticket = scope[SCOPE_KEY] = Ticket()  # the route admits it; released when sent
        try:
            await self.app(scope, receive, send)
        finally:
            self.server.admission.release(ticket)

    def _refusal(self, scope: Scope) -> Response | None:
        """The error response for a request refused at the door, or None."""
        path: str = scope["path"]
        if (
            self.key_digests
            and not self._is_open(path)
            and self._is_route(scope)
            and not self._authorized(scope)
        ):
            return error_response(
                "Missing or invalid API key: send `Authorization: Bearer <key>`.",
                401,
                code="invalid_api_key",
            )
        if scope["method"] != "POST":
            return None
        if self.server.draining:
            return error_response(_SHUTTING_DOWN, 503)
        if path in _GENERATION_PATHS and self.server.admission.full():
            e = self.server.admission.overloaded()
            return error_response(e.message, e.status, e.param, e.code, e.headers)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"").strip()
        if length.isdigit() and int(length) > self.max_body:
            return error_response(too_large_message(self.max_body), 413)
        content_type = headers.get(b"content-type")
        if content_type is not None and not _is_json(content_type):
            # Also what keeps a cross-site HTML form (no CORS preflight) from posting here.
            return error_response(
                f"The request body must be JSON (Content-Type: application/json), "
                f"not {content_type.decode('latin-1')!r}.",
                415,
            )
        return None

    def _is_open(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self.open_paths)

    def _is_route(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] != Match.NONE for route in self.routes)

    def _authorized(self, scope: Scope) -> bool:
        given: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given.append(value[7:].strip())
            elif name == b"x-api-key":
                given.append(value.strip())
        ok = False
        for candidate in given:
            digest = hashlib.sha256(candidate).digest()
            for key in self.key_digests:  # compare with every key: no early exit to time
                ok |= hmac.compare_digest(digest, key)
        return ok


def _is_json(content_type: bytes) -> bool:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json" or media_type.endswith(b"+json")
