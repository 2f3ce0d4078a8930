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

The routes, the door's rules and /openapi.json all come from one table (frontend/routes.py).
The routes only parse: every generation API turns its body into a job through
`Generation.serve` (frontend/generate.py), streams and disconnects go through
`frontend/streaming.py`, keys/limits/admission through `frontend/access/middleware.py`. Every error
is its API's (OpenAI's `{"error": {...}}`, or Anthropic's) with its HTTP status.
No torch in this process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from operator import attrgetter
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import generate_latest as prometheus_text
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

import zllm
from zllm.config.engine import sleep_refusal
from zllm.config.serve import ServeConfig
from zllm.errors import ParamError, RequestError
from zllm.frontend import options
from zllm.frontend.access.admission import SHUTTING_DOWN, Admission
from zllm.frontend.access.middleware import Gate
from zllm.frontend.access.permissions import EVERYONE, VIEWER_KEY, RegistryView
from zllm.frontend.access.tenant_limits import TenantLimits
from zllm.frontend.anthropic import api as anthropic_api
from zllm.frontend.anthropic.thinking import ThinkingSigner
from zllm.frontend.generate import ApiContext, Generation
from zllm.frontend.images import load_images
from zllm.frontend.lora_adapters import LORA_STATE_FILE, LoRAAdapters
from zllm.frontend.observability.cache_sizes import watch_server_caches
from zllm.frontend.observability.metrics import Metrics
from zllm.frontend.openai.format import ImageRef, chat_images, chat_messages
from zllm.frontend.openai.logprobs import LogprobText
from zllm.frontend.openai.protocol import (
    DetokenizeBody,
    DetokenizeResponse,
    KVTransferCard,
    LoadLoRAAdapterBody,
    ModelCard,
    ModelList,
    TokenizeBody,
    TokenizeResponse,
    UnloadLoRAAdapterBody,
    decode_body,
)
from zllm.frontend.openapi import openapi_schema
from zllm.frontend.replies import encode_json, error_response, json_response
from zllm.frontend.routes import ROUTES, ApiRoute
from zllm.frontend.streaming import ClientGone
from zllm.inputs import check_vocabulary
from zllm.kv.tiers import TIER_NAMES, TIER_REMOTE
from zllm.media.images import ImageError, require_vision
from zllm.media.placeholders import model_placeholders
from zllm.model.fingerprint import weights_fingerprint
from zllm.protocol import SLEEP_TAGS
from zllm.runtime.engine_client import EngineClient
from zllm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Tokenize or detokenize this much in a worker thread, not on the event loop.
_BIG_INPUT = 16384
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


def kv_transfer_card(config: ServeConfig) -> KVTransferCard | None:
    """The server's part in disaggregation, None without one. Its weights fingerprint is
    the one its executors name their blocks by; they computed it before this frontend
    started, so this reads it from the fingerprint cache (a stat of each weights file)."""
    transfer = config.engine.kv_transfer
    if transfer is None:
        return None
    return KVTransferCard(
        role=transfer.role, weights_fingerprint=weights_fingerprint(config.engine.model_path)
    )


class OpenAIServer:
    """The route handlers and what they share: engine client, tokenizer, metrics."""

    def __init__(
        self,
        config: ServeConfig,
        client: EngineClient,
        tokenizer: Tokenizer,
        run_dir: str | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        # A vision model's image tokens, for the routes that count a prompt's tokens here.
        engine = config.engine
        self.placeholders = model_placeholders(
            engine.model_path, engine.arch.vision, tokenizer.token_text
        )
        self.max_model_len = config.engine.scheduler.max_model_len
        self.created = int(time.time())
        self.prometheus = Metrics(client, config.model_names[0])
        self.admission = Admission(config.max_in_flight)
        self.tenant_limits = TenantLimits(
            config.tenant_max_concurrency,
            config.tenant_max_requests_per_second,
            self.prometheus.registry,
            per_tenant=config.engine.scheduler.tenant_limits,
        )
        self.adapters = LoRAAdapters(
            config.engine,
            config.model_names,
            config.lora_modules,
            os.path.join(run_dir, LORA_STATE_FILE) if run_dir else None,
        )
        watch_server_caches(self.prometheus.caches, self.tenant_limits, self.adapters)
        context = ApiContext(
            config,
            tokenizer,
            LogprobText(tokenizer),
            self.max_model_len,
            # The model's generation_config.json defaults, for fields a request leaves unset.
            config.engine.generation_config.defaults,
            ThinkingSigner.of(config.thinking_signature_key_file),
        )
        self.tracer = None
        if config.otlp_traces_endpoint is not None:  # only then is OpenTelemetry imported
            from zllm.frontend.observability.tracing import Tracer

            self.tracer = Tracer(config.otlp_traces_endpoint)
        self.generation = Generation(
            config, client, self.prometheus, self.admission, self.adapters, context, self.tracer
        )
        self._openapi: bytes | None = None
        self.kv_transfer_card = kv_transfer_card(config)

    async def count_tokens(
        self, request: Request, body: anthropic_api.CountTokensRequest
    ) -> Response:
        model, _ = self.adapters.resolve(body.model)
        chat = anthropic_api.as_chat_request(body)
        images = chat_images(chat.messages)
        tools = [msgspec.to_builtins(t) for t in chat.tools or []] or None
        kwargs = options.template_kwargs(
            body.chat_template_kwargs, self.config.default_chat_template_kwargs
        )
        try:
            text = self.tokenizer.apply_chat_template(
                chat_messages(chat.messages),
                add_generation_prompt=True,
                **kwargs,
                **({"tools": tools} if tools else {}),
            )
        except Exception as e:  # jinja errors, or a model without a template
            raise RequestError(f"Could not apply the chat template: {e}", param="messages") from e
        text = await self._with_image_tokens(text, images, model)
        tokens = await _maybe_in_thread(len(text), self.tokenizer.encode, text, False)
        return json_response(anthropic_api.CountTokensResponse(len(tokens)))

    async def models(self, request: Request) -> Response:
        cards = [
            ModelCard(
                id=name,
                created=self.created,
                root=self.config.engine.model_path,
                max_model_len=self.max_model_len,
                kv_transfer=self.kv_transfer_card,
            )
            for name in self.config.model_names
        ]
        cards += [
            ModelCard(
                id=lora.lora_name,
                created=self.created,
                root=lora.lora_path,
                parent=self.config.model_names[0],
                max_model_len=self.max_model_len,
            )
            for lora in self.adapters.by_name.values()
        ]
        return json_response(ModelList(cards))

    async def load_lora_adapter(self, request: Request, body: LoadLoRAAdapterBody) -> Response:
        lora = await self.adapters.load(body.lora_name, body.lora_path)
        logger.info(
            "LoRA adapter %s (id %d) loaded from %s",
            lora.lora_name,
            lora.lora_int_id,
            lora.lora_path,
        )
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request, body: UnloadLoRAAdapterBody) -> Response:
        lora = self.adapters.unload(body.lora_name)
        logger.info("LoRA adapter %s (id %d) unloaded", lora.lora_name, lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    # ---- sleep mode ------------------------------------------------------------------------
    async def sleep(self, request: Request) -> Response:
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            raise RequestError("level must be 1 or 2", param="level") from None
        if level not in (1, 2):
            raise RequestError("level must be 1 or 2", param="level")
        return await self._sleep_control("sleep", level)

    async def wake_up(self, request: Request) -> Response:
        tags = request.query_params.getlist("tags")  # vLLM's: ?tags=weights&tags=kv_cache
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise RequestError(f"unknown tags {unknown}: use {list(SLEEP_TAGS)}", param="tags")
        return await self._sleep_control("wake_up", 1, tuple(tags))

    async def _sleep_control(
        self, command: str, level: int, tags: tuple[str, ...] = ()
    ) -> Response:
        refusal = sleep_refusal(self.config.engine)
        if refusal is not None:
            raise RequestError(refusal)
        reply = await self.client.sleep_control(command, level, tags)
        if not reply.ok:
            raise RequestError(reply.message, 400)
        return Response(status_code=200)

    async def is_sleeping(self, request: Request) -> Response:
        return json_response({"is_sleeping": self.client.is_sleeping})

    # ---- prefix cache ----------------------------------------------------------------------
    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's route, answered with what was dropped: every engine forgets the cached
        blocks no running request holds (pins released); `?tiers=1` (or vLLM's
        `?reset_external=true`) empties the cpu and disk KV tiers too."""
        tiers = _query_flag(request, "tiers") or _query_flag(request, "reset_external")
        reset = await self.client.reset_prefix_cache(tiers)
        dropped = reset.tier_blocks_dropped
        return json_response(
            {
                "reset": True,
                "blocks_dropped": reset.blocks_dropped,
                "tier_blocks_dropped": {
                    name: dropped[tier] if tier < len(dropped) else 0
                    for tier, name in enumerate(TIER_NAMES)
                    if tier != TIER_REMOTE
                },
            }
        )

    async def health(self, request: Request) -> Response:
        if self.admission.draining:
            return error_response(RequestError(SHUTTING_DOWN, 503))
        ok, reason = self.client.health()
        if ok and reason != "ok":
            # Degraded: some data-parallel engine is down, the others serve (and say so).
            return json_response({"status": "degraded", "message": reason})
        if ok:
            return Response(status_code=200)
        return error_response(RequestError(reason, 503))

    async def version(self, request: Request) -> Response:
        return json_response({"version": zllm.__version__})

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            self._openapi = encode_json(openapi_schema(self.config, ROUTES))
        return Response(self._openapi, media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        view = RegistryView(self.prometheus.registry, request.scope.get(VIEWER_KEY, EVERYONE))
        text = prometheus_text(view)  # type: ignore[arg-type]  # any collector will do
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request, body: TokenizeBody) -> Response:
        model, _ = self.adapters.resolve(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("Give exactly one of prompt and messages.", param="prompt")
        images: list[ImageRef] = []
        if body.messages is not None:
            images = chat_images(body.messages)
            kwargs = options.template_kwargs(
                body.chat_template_kwargs, self.config.default_chat_template_kwargs, body.documents
            )
            continue_final = options.continue_final_message(
                body.continue_final_message, body.add_generation_prompt
            )
            if body.chat_template is not None and not self.config.trust_request_chat_template:
                raise RequestError(  # as chat completions answers (frontend/openai/api.py)
                    "This server does not accept a chat_template in requests "
                    "(start it with --trust-request-chat-template to allow it).",
                    param="chat_template",
                )
            try:
                text = self.tokenizer.apply_chat_template(
                    chat_messages(body.messages),
                    add_generation_prompt=body.add_generation_prompt,
                    chat_template=body.chat_template,
                    continue_final_message=continue_final,
                    **kwargs,
                )
            except Exception as e:  # jinja errors, or a model without a template
                raise RequestError(
                    f"Could not apply the chat template: {e}", param="messages"
                ) from e
            add_special = bool(body.add_special_tokens)
            text = await self._with_image_tokens(text, images, model)
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        tokens = await _maybe_in_thread(len(text), self.tokenizer.encode, text, add_special)
        token_strs = None
        if body.return_token_strs:
            token_strs = [self.tokenizer.backend.id_to_token(t) or "" for t in tokens]
        return json_response(
            TokenizeResponse(
                count=len(tokens),
                max_model_len=self.max_model_len,
                tokens=tokens,
                token_strs=token_strs,
            )
        )

    async def _with_image_tokens(self, text: str, images: list[ImageRef], model: str) -> str:
        """The rendered prompt with its images' tokens in place; a model that takes none says
        so. A model whose images take a fixed count of tokens (Gemma 3) needs only their
        number; one whose count follows the image's size (Qwen2.5-VL) has them read, as a
        generation would (each checked the same way)."""
        if not images:
            return text
        try:
            require_vision(self.config.engine.arch.vision, model)
        except ImageError as exc:
            raise RequestError(str(exc), param=images[0].where) from None
        assert self.placeholders is not None
        if self.placeholders.grid is None:
            counts = [self.placeholders.tokens_per_image] * len(images)
        else:
            loaded = await load_images(images, self.config.engine.media, True, model)
            counts = []
            for ref, image in zip(images, loaded, strict=True):
                try:
                    counts.append(self.placeholders.count(image.width, image.height))
                except ValueError as exc:
                    raise RequestError(f"{ref.where}: {exc}", param=ref.where) from None
        try:
            return self.placeholders.expand(text, counts)
        except ValueError as exc:
            raise RequestError(str(exc), param="messages") from None

    async def detokenize(self, request: Request, body: DetokenizeBody) -> Response:
        self.adapters.resolve(body.model)
        try:
            check_vocabulary(body.tokens, self.tokenizer.vocab_size, "tokens")
        except ParamError as e:
            raise RequestError(str(e), param=e.param) from None
        text = await _maybe_in_thread(len(body.tokens), self.tokenizer.decode, body.tokens, False)
        return json_response(DetokenizeResponse(prompt=text))


def _query_flag(request: Request, name: str) -> bool:
    """A boolean query parameter: 1/true/yes or 0/false/no (absent: false); else a 400."""
    value = request.query_params.get(name, "0").strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no", ""):
        return False
    raise RequestError(f"{name} must be true or false, got {value!r}", param=name)


async def _maybe_in_thread(size: int, fn: Callable, *args: Any) -> Any:
    if size > _BIG_INPUT:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
