"""The one generation path both OpenAI routes take, once they have parsed their request.

    route: parse body -> GenerationJob (engine requests, an assembler, response builders)
    Generation.run(job):
        engine requests -> EngineClient.generate, merged (one stream per prompt)
        each output delta -> metrics, then the assembler -> a stream chunk or a whole choice
        -> SSE (`stream: true`) or one JSON response; a client that leaves aborts its requests

The metrics count each prompt as one engine request, and with --enable-log-requests each is
logged as it arrives (with the start of its prompt: the flag is the operator's consent) and
as it ends (never with text).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from zllm.engine_client import EngineClient
from zllm.errors import RequestError
from zllm.frontend.api_models import StreamOptions, UsageInfo
from zllm.frontend.metrics import Metrics
from zllm.frontend.middleware import TENANT_KEY
from zllm.frontend.openai_format import ChatAssembler, CompletionAssembler
from zllm.frontend.responses import DONE_EVENT, error_event, json_response, sse_event
from zllm.frontend.streaming import merge, sse_response, until_disconnect
from zllm.protocol import RequestOutputDelta, TokenizeRequest
from zllm.serve_config import ServeConfig
from zllm.tenants import DEFAULT_TENANT

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


@dataclass(eq=False)
class GenerationJob:
    """What a route hands to `Generation.run`."""

    ids: RequestIds
    requests: list[TokenizeRequest]  # one per prompt, in prompt order
    assembler: CompletionAssembler | ChatAssembler | Any  # anything with collect()
    stream: bool
    stream_options: StreamOptions | None
    # A stream chunk holding these choices (and usage, when the client asked for it).
    chunk: Callable[[list[Any], UsageInfo | None], msgspec.Struct]
    # The whole (non-streaming) response, built once every output is in.
    response: Callable[[], msgspec.Struct]
    # Chunks to send before the first choice, once the engine has accepted the request.
    prelude: Callable[[], list[msgspec.Struct]] = field(default=list)
    # Another API's stream (Anthropic's events): outputs -> SSE bytes, in place of the
    # OpenAI chunks above; with its end marker and its error event.
    events: (
        Callable[[AsyncIterator[tuple[int, RequestOutputDelta]]], AsyncIterator[bytes]] | None
    ) = None
    done: bytes = DONE_EVENT
    on_error: Callable[[RequestError], bytes] = error_event


class Generation:
    def __init__(self, config: ServeConfig, client: EngineClient, metrics: Metrics) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics

    async def run(self, request: Request, job: GenerationJob) -> Response:
        self.metrics.timeline.start()  # the charts' history begins with the first request
        tenant = request.scope.get(TENANT_KEY, DEFAULT_TENANT)  # the Gate's finding
        for engine_request in job.requests:
            engine_request.tenant = tenant
        self._log_received(job.requests)
        outputs = self._outputs(job.requests)
        if job.stream:
            events = job.events(outputs) if job.events else self._events(job, outputs)
            return await sse_response(
                request, events, outputs, job.ids.headers, job.done, job.on_error
            )

        async def collect() -> None:
            async for prompt_index, delta in outputs:
                job.assembler.collect(prompt_index, delta)

        await until_disconnect(request, collect(), outputs)
        return json_response(job.response(), headers=job.ids.headers)

    async def _events(
        self, job: GenerationJob, outputs: AsyncIterator[tuple[int, RequestOutputDelta]]
    ) -> AsyncIterator[bytes]:
        include_usage, continuous_usage = _usage_options(job.stream_options)
        usage = job.assembler.usage
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
                yield sse_event(job.chunk([choice], usage.info() if continuous_usage else None))
        if include_usage:
            yield sse_event(job.chunk([], usage.info()))

    async def _outputs(
        self, requests: list[TokenizeRequest]
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
            for trace in traces:
                self.metrics.finish(trace, interrupted)
                if self.config.enable_log_requests:
                    logger.info(trace.log_line())

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


def _usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage in every chunk too)."""
    if options is None or not options.include_usage:
        return False, False
    return True, options.continuous_usage_stats
