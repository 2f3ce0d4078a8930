"""`OpenAIServer`: what the route handlers share, built once per frontend (engine client,
tokenizer, metrics, admission, tenant limits, LoRA adapters, tracer, the generation path),
and the routes that answer for the server itself (models, health, version, /openapi.json,
/metrics). The token routes and the engine's control routes are its parts."""

from __future__ import annotations

import os
import time

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import generate_latest as prometheus_text
from starlette.requests import Request
from starlette.responses import Response

import zllm
from zllm.config.serve import ServeConfig
from zllm.errors import RequestError
from zllm.frontend.access.admission import SHUTTING_DOWN, Admission
from zllm.frontend.access.permissions import EVERYONE, VIEWER_KEY, RegistryView
from zllm.frontend.access.tenant_limits import TenantLimits
from zllm.frontend.anthropic.thinking import ThinkingSigner
from zllm.frontend.generate import ApiContext, Generation
from zllm.frontend.handlers.control import ControlRoutes
from zllm.frontend.handlers.tokens import TokenRoutes
from zllm.frontend.lora_adapters import LORA_STATE_FILE, LoRAAdapters
from zllm.frontend.observability.cache_sizes import watch_server_caches
from zllm.frontend.observability.metrics import Metrics
from zllm.frontend.openai.logprobs import LogprobText
from zllm.frontend.openai.protocol import KVTransferCard, ModelCard, ModelList
from zllm.frontend.openapi import openapi_schema
from zllm.frontend.replies import encode_json, error_response, json_response
from zllm.frontend.routes import ROUTES
from zllm.model.fingerprint import weights_fingerprint
from zllm.runtime.engine_client import EngineClient
from zllm.text.tokenizer import Tokenizer


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
        self.tokens = TokenRoutes(config, tokenizer, self.adapters)
        self.control = ControlRoutes(config, client, self.adapters)
        self._openapi: bytes | None = None
        self.kv_transfer_card = kv_transfer_card(config)

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
