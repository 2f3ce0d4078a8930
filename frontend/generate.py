"""The one generation path every API takes (frontend/routes.py names them).

    Generation.serve(api, body):
        model/adapter -> api(body): prompts and params (its 400s) -> admission -> ids
        -> one TokenizeRequest per prompt (with the API's options) -> api.job(): an
        assembler and its response builders
    Generation.run(job):
        engine requests -> EngineClient.generate, merged (one stream per prompt)
        each output delta -> metrics, then the assembler -> a stream chunk or a whole choice
        -> SSE (`stream: true`) or one JSON response; a client that leaves aborts its requests

The metrics count each prompt as one engine request, and with --enable-log-requests each is
logged as it arrives (with the start of its prompt: the flag is the operator's consent) and
as it ends (never with text). With --otlp-traces-endpoint each engine request is traced: it
carries an empty RequestTiming that the processes stamp, and ends as a span tree
(frontend/observability/tracing.py), under the client's `traceparent` when it sent one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from zllm.config.generation import SamplingDefaults
from zllm.config.serve import ServeConfig
from zllm.errors import RequestError
from zllm.frontend.access.admission import Admission
from zllm.frontend.access.middleware import TENANT_KEY, TICKET_KEY
from zllm.frontend.images import load_images
from zllm.frontend.lora_adapters import LoRAAdapters
from zllm.frontend.observability.metrics import Metrics
from zllm.frontend.openai.format import ImageRef, PromptInput
from zllm.frontend.openai.logprobs import LogprobText
from zllm.frontend.openai.protocol import StreamOptions, UsageInfo
from zllm.frontend.replies import DONE_EVENT, error_event, json_response, sse_event
from zllm.frontend.streaming import merge, sse_response, until_disconnect
from zllm.protocol import (
    DEFAULT_TENANT,
    NO_OPTIONS,
    RequestOptions,
    RequestOutputDelta,
    RequestTiming,
    TokenizeRequest,
)
from zllm.runtime.engine_client import EngineClient
from zllm.sampling_params import SamplingParams
from zllm.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from zllm.frontend.anthropic.thinking import ThinkingSigner
    from zllm.frontend.observability.tracing import Tracer

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class RequestIds:
    """A request's id as the client sees it, and the unique ids of its engine requests.

    With an `X-Request-Id` header the response id is `<prefix>-<header>` (as vLLM does) and
    the header is echoed back; the engine ids add a random part, so two requests sent with
    the same header both run."""

    response_id: str
    engine_base: str
    headers: dict[str, str] | None = None

    @classmethod
    def of(cls, request: Request, prefix: str) -> RequestIds:
        given = request.headers.get("x-request-id")
        if not given:
            response_id = f"{prefix}-{uuid.uuid4().hex}"
            return cls(response_id, response_id)
        if len(given) > MAX_REQUEST_ID_CHARS:
            raise RequestError(f"X-Request-Id must be at most {MAX_REQUEST_ID_CHARS} characters.")
        response_id = f"{prefix}-{given}"
        return cls(response_id, f"{response_id}-{uuid.uuid4().hex[:8]}", {"X-Request-Id": given})

    def engine_id(self, prompt_index: int, num_prompts: int) -> str:
        return self.engine_base if num_prompts == 1 else f"{self.engine_base}-{prompt_index}"


class Assembler(Protocol):
    """An API's answer in the making: collects output deltas (non-streaming)."""

    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None: ...


@dataclass(eq=False, kw_only=True)
class GenerationJob:
    """How an API answers its engine requests' outputs: whole, or as a stream."""

    assembler: Assembler | Any  # OpenAI's also add() a delta as a stream choice, with usage
    stream: bool
    # The whole (non-streaming) response, built once every output is in.
    response: Callable[[], Any]
    stream_options: StreamOptions | None = None
    # OpenAI's stream: a chunk holding these choices (and usage, when the client asked).
    chunk: Callable[[list[Any], UsageInfo | None], msgspec.Struct] | None = None
    # Chunks to send before the first choice, once the engine has accepted the request.
    prelude: Callable[[], list[msgspec.Struct]] = field(default=list)
    # Another API's stream (Anthropic's events): outputs -> SSE bytes, in place of the
    # OpenAI chunks above; with its end marker and its error event.
    events: (
        Callable[[AsyncIterator[tuple[int, RequestOutputDelta]]], AsyncIterator[bytes]] | None
    ) = None
    done: bytes = DONE_EVENT
    on_error: Callable[[RequestError], bytes] = error_event

    @classmethod
    def of_events(
        cls, assembler: Any, stream: bool, on_error: Callable[[RequestError], bytes]
    ) -> GenerationJob:
        """An API whose assembler builds both its response and its own stream of events
        (Anthropic's, the Responses API's): no OpenAI chunks, no `[DONE]`."""
        return cls(
            assembler=assembler,
            stream=stream,
            response=assembler.response,
            events=assembler.stream,
            done=b"",
            on_error=on_error,
        )


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation as the chat template sees it: one engine request."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    # Extra template variables, the server's defaults merged (zllm/text/template_kwargs.py).
    template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False  # the last message left open (continue_final.py)
    images: list[ImageRef] = field(default_factory=list)  # read before queueing (images.py)


Prompt = PromptInput | ChatPrompt


@dataclass(frozen=True, slots=True)
class ApiContext:
    """What the APIs read to parse a request: the server's config, its tokenizer, limits."""

    config: ServeConfig
    tokenizer: Tokenizer
    names: LogprobText
    max_model_len: int
    sampling_defaults: SamplingDefaults
    # Signs and checks Anthropic thinking blocks (frontend/anthropic/thinking.py).
    thinking_signer: ThinkingSigner | None = None


class ApiCall(ABC):
    """One generation request of one API (completions, chat, responses, messages,
    embeddings), parsed by its constructor `(body, ApiContext)`: every 400 that needs no
    admission is raised there. It holds the prompts (one engine request each) and their
    sampling params; once admitted, it names its per-request options and builds the job
    that answers the outputs. `Generation.serve` is the one path every API takes."""

    id_prefix: ClassVar[str]  # of the response id: "cmpl", "chatcmpl", ...
    prompts: list[Prompt]
    params: SamplingParams
    add_special_tokens: bool = True

    def options(self) -> RequestOptions:
        """The request's own engine options from its fields (priority, pinning, KV
        transfer: frontend/options.py); parsed after admission, as each API always has."""
        return NO_OPTIONS

    @abstractmethod
    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob: ...


class Generation:
    def __init__(
        self,
        config: ServeConfig,
        client: EngineClient,
        metrics: Metrics,
        admission: Admission,
        adapters: LoRAAdapters,
        context: ApiContext,
        tracer: Tracer | None = None,
    ) -> None:
        self.tracer = tracer  # --otlp-traces-endpoint
        self.config = config
        self.client = client
        self.metrics = metrics
        self.admission = admission
        self.adapters = adapters
        self.context = context

    async def serve(self, api: type[ApiCall], request: Request, body: Any) -> Response:
        """decode (done) -> model/adapter -> parse -> admit -> ids -> engine requests -> job."""
        model, lora = self.adapters.resolve(body.model)
        call = api(body, self.context)  # type: ignore[call-arg]
        self.admission.admit(request.scope[TICKET_KEY], len(call.prompts))
        ids = RequestIds.of(request, call.id_prefix)
        now = time.time()
        tenant = request.scope.get(TENANT_KEY, DEFAULT_TENANT)  # the Gate's finding
        options = msgspec.structs.replace(
            call.options(),
            lora=lora,
            tenant=tenant,
            isolate_tenant_cache=self.config.prefix_cache_isolation == "tenant",
        )
        engine = self.config.engine
        images = [
            await load_images(p.images, engine.media, engine.arch.vision, model)
            if isinstance(p, ChatPrompt) and p.images
            else None
            for p in call.prompts
        ]
        requests = [
            TokenizeRequest(
                req_id=ids.engine_id(i, len(call.prompts)),
                images=images[i],
                sampling_params=call.params,
                add_special_tokens=call.add_special_tokens,
                arrival_time=now,
                options=options,
                timing=RequestTiming() if self.tracer is not None else None,
                **_prompt_fields(prompt),
            )
            for i, prompt in enumerate(call.prompts)
        ]
        return await self.run(request, ids, requests, call.job(ids, model, now), model)

    async def run(
        self,
        request: Request,
        ids: RequestIds,
        requests: list[TokenizeRequest],
        job: GenerationJob,
        model: str = "",
    ) -> Response:
        self.metrics.timeline.start()  # the charts' history begins with the first request
        self._log_received(requests)
        traced = None
        if self.tracer is not None:
            traced = _Traced(self.tracer, self.tracer.parent(request.headers), model)
        outputs = self._outputs(requests, traced)
        if job.stream:
            events = job.events(outputs) if job.events else self._events(job, outputs)
            return await sse_response(request, events, outputs, ids.headers, job.done, job.on_error)

        async def collect() -> None:
            async for prompt_index, delta in outputs:
                job.assembler.collect(prompt_index, delta)

        await until_disconnect(request, collect(), outputs)
        return json_response(job.response(), headers=ids.headers)

    async def _events(
        self, job: GenerationJob, outputs: AsyncIterator[tuple[int, RequestOutputDelta]]
    ) -> AsyncIterator[bytes]:
        include_usage, continuous_usage = _usage_options(job.stream_options)
        usage = job.assembler.usage
        make_chunk = job.chunk
        assert make_chunk is not None, "an OpenAI stream builds chunks"
        started = False
        async for prompt_index, delta in outputs:
            if not started:  # after the first output: errors before it are a 4xx/5xx
                started = True
                for chunk in job.prelude():
                    if continuous_usage:  # every chunk carries usage, the first ones too
                        chunk.usage = usage.info()  # type: ignore[attr-defined]
                    yield sse_event(chunk)
            choice = job.assembler.add(prompt_index, delta)
            if choice is not None:
                yield sse_event(make_chunk([choice], usage.info() if continuous_usage else None))
        if include_usage:
            yield sse_event(make_chunk([], usage.info()))

    async def _outputs(
        self, requests: list[TokenizeRequest], traced: _Traced | None = None
    ) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
        """Every prompt's output deltas as (prompt index, delta), observed by the metrics."""
        traces = [self.metrics.track(r) for r in requests]
        merged = merge([self.client.generate(r) for r in requests])
        interrupted = "error"  # how requests the engine did not finish end, if cut short
        try:
            async for prompt_index, delta in merged:
                self.metrics.on_output(traces[prompt_index], delta)
                yield prompt_index, delta
        except (asyncio.CancelledError, GeneratorExit):
            interrupted = "abort"  # the client went away
            raise
        except RequestError as e:
            # 504: the request timeout aborted it; 4xx: refused as invalid, it never ran.
            interrupted = "abort" if e.status == 504 else "rejected" if e.status < 500 else "error"
            raise
        finally:
            await merged.aclose()
            end = time.time()
            for request, trace in zip(requests, traces, strict=True):
                self.metrics.finish(trace, interrupted)
                if self.config.enable_log_requests:
                    logger.info(trace.log_line())
                if traced is not None:
                    traced.tracer.export(request, trace, traced.parent, traced.model, end)

    def _log_received(self, requests: list[TokenizeRequest]) -> None:
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


@dataclass(frozen=True, slots=True)
class _Traced:
    """An HTTP request's tracing: the exporter, the client's span, the model it named."""

    tracer: Tracer
    parent: Any  # an OpenTelemetry context
    model: str


def _prompt_fields(prompt: Prompt) -> dict[str, Any]:
    """The TokenizeRequest fields that carry one prompt."""
    if isinstance(prompt, ChatPrompt):
        return {
            "messages": prompt.messages,
            "tools": prompt.tools,
            "add_generation_prompt": prompt.add_generation_prompt,
            "chat_template": prompt.chat_template,
            "chat_template_kwargs": prompt.template_kwargs or None,
            "continue_final_message": prompt.continue_final_message,
        }
    return {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}


def _usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage in every chunk too)."""
    if options is None or not options.include_usage:
        return False, False
    return True, options.continuous_usage_stats
