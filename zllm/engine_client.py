"""An asyncio client of the running engine processes.

The frontend serves HTTP with it, and any asyncio application can embed zllm with it instead
of HTTP: submit a request, iterate its outputs, abort it. It owns the frontend's sockets: it
pushes requests to the tokenizer workers and aborts to the core, and receives detokenized
outputs, rejections, heartbeats and process events on one PULL socket.

Every request it sends carries this process's id as `client_id`: if this process dies, the
supervisor tells the core, which aborts its requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from zllm.errors import RequestError
from zllm.messaging import areceive
from zllm.protocol import (
    AbortRequests,
    EngineLifecycle,
    EngineState,
    EngineStats,
    FrontendBatch,
    FrontendInput,
    ProcessEvent,
    ProcessRole,
    RequestOutputDelta,
    RequestRejected,
    SleepControl,
    SleepReply,
    TokenizeRequest,
)
from zllm.serve_config import ServeConfig, detokenizer_index

logger = logging.getLogger(__name__)

_SHUTTING_DOWN = "the server is shutting down"


@dataclass(eq=False)
class _Stream:
    request: TokenizeRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_finished: int = 0
    started: bool = False  # some output arrived: the tokenizer stage is behind it


class EngineClient:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.client_id = os.getpid()
        self._ctx = zmq.asyncio.Context.instance()
        self._encoder = msgspec.msgpack.Encoder()
        self._streams: dict[str, _Stream] = {}
        self._receiver: asyncio.Task | None = None
        self.engine_state = EngineState.STARTING
        self.engine_message = "the engine is starting"
        self.stats: EngineStats | None = None  # the latest heartbeat
        self.last_heartbeat = 0.0
        self.processes: dict[tuple[ProcessRole, int], bool] = {}
        self.closed = False
        # Sleep mode: replies awaited from the core, by reply_to id.
        self._sleep_replies: dict[int, asyncio.Future[SleepReply]] = {}
        self._next_reply_id = 1

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        ep = self.config.endpoints
        self._to_tokenizers = self._ctx.socket(zmq.PUSH)
        self._to_tokenizers.bind(ep.tokenizer_in)
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.connect(ep.core_in)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(ep.frontend_in)
        self._receiver = asyncio.create_task(self._receive_loop())

    async def close(self) -> None:
        self.closed = True
        if self._receiver is not None:
            self._receiver.cancel()
        self.fail_all(_SHUTTING_DOWN, 503)
        for sock in (self._to_tokenizers, self._to_core, self._inbox):
            sock.close(linger=0)

    def mark_ready(self) -> None:
        """The engine is up (for an embedding that started it without a supervisor event)."""
        self.engine_state = EngineState.READY
        self.last_heartbeat = time.monotonic()

    # ---- health --------------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if self.engine_state != EngineState.READY:
            return False, self.engine_message
        age = time.monotonic() - self.last_heartbeat
        if age > self.config.heartbeat_timeout:
            return False, f"no heartbeat from the engine core for {age:.1f} s"
        dead = [f"{role} {i}" for (role, i), alive in self.processes.items() if not alive]
        if dead:
            return False, "process down: " + ", ".join(sorted(dead))
        return True, "ok"

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ------------------------------------------------------------------------
    async def generate(self, request: TokenizeRequest) -> AsyncIterator[RequestOutputDelta]:
        """Submit a request and yield its output deltas until every sample finishes.

        Raises RequestError (400 for a request the engine refused, 503 when the engine goes
        away, 504 past the request timeout). Leaving the iteration early (a client
        disconnect) aborts it."""
        if self.closed:
            raise RequestError(_SHUTTING_DOWN, 503)
        if self.engine_state != EngineState.READY:
            raise RequestError(self.engine_message, 503)
        if request.req_id in self._streams:
            raise RequestError(f"Request id {request.req_id!r} is already in use.", 400)
        request.client_id = self.client_id
        stream = _Stream(request)
        self._streams[request.req_id] = stream
        finished = False
        timer = self._arm_timeout(stream)
        try:
            await self._to_tokenizers.send(self._encoder.encode(request))
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, RequestError):
                    raise item  # the finally clause aborts it in the core (idempotent)
                if item.finish_reason is not None:
                    stream.num_finished += 1
                    finished = stream.num_finished >= request.sampling_params.n
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            self._streams.pop(request.req_id, None)
            if not finished:
                await self.abort(request.req_id)

    def _arm_timeout(self, stream: _Stream) -> asyncio.TimerHandle | None:
        """`request_timeout` seconds after the request arrived, fail it with a 504 (which
        aborts it in the core, freeing its blocks)."""
        timeout = self.config.request_timeout
        if timeout is None:
            return None
        arrival = stream.request.arrival_time or time.time()
        delay = max(0.0, arrival + timeout - time.time())
        return asyncio.get_running_loop().call_later(delay, self._time_out, stream, timeout)

    def _time_out(self, stream: _Stream, timeout: float) -> None:
        logger.warning(
            "request %s ran past the request timeout (%g s): aborting it",
            stream.request.req_id,
            timeout,
        )
        message = (
            f"The request did not finish within the server's request timeout ({timeout:g} s) "
            "and was aborted."
        )
        stream.queue.put_nowait(RequestError(message, 504, code="request_timeout"))

    async def abort(self, req_id: str) -> None:
        if self.closed:
            return
        await self._to_core.send(self._encoder.encode(AbortRequests([req_id])))

    async def sleep_control(self, command: str, level: int = 1, timeout: float = 600) -> SleepReply:
        """POST /sleep or /wake_up: ask the core and wait for its answer."""
        reply_to = self._next_reply_id
        self._next_reply_id += 1
        future: asyncio.Future[SleepReply] = asyncio.get_running_loop().create_future()
        self._sleep_replies[reply_to] = future
        try:
            await self._to_core.send(self._encoder.encode(SleepControl(command, reply_to, level)))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._sleep_replies.pop(reply_to, None)

    @property
    def is_sleeping(self) -> bool:
        return self.stats is not None and self.stats.asleep

    def fail_all(self, message: str, status: int = 503) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(RequestError(message, status))

    # ---- receiving -----------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(FrontendInput)
        async for msg in areceive(self._inbox, decoder, logger):
            try:
                self._handle(msg)
            except Exception:  # one bad message must not stop the receive loop
                logger.exception("error handling %s", type(msg).__name__)

    def _handle(self, msg: FrontendInput) -> None:
        if isinstance(msg, FrontendBatch):
            for out in msg.outputs:
                stream = self._streams.get(out.req_id)
                if stream is not None:
                    stream.started = True
                    stream.queue.put_nowait(out)
        elif isinstance(msg, EngineStats):
            self.stats = msg
            self.last_heartbeat = time.monotonic()
        elif isinstance(msg, RequestRejected):
            stream = self._streams.get(msg.req_id)
            if stream is not None:
                stream.queue.put_nowait(RequestError(msg.message, msg.status, msg.param))
        elif isinstance(msg, ProcessEvent):
            self._on_process_event(msg)
        elif isinstance(msg, EngineLifecycle):
            self._on_lifecycle(msg)
        elif isinstance(msg, SleepReply):
            if self.stats is not None:
                self.stats.asleep = msg.asleep  # until the next heartbeat says so too
            future = self._sleep_replies.get(msg.reply_to)
            if future is not None and not future.done():
                future.set_result(msg)

    def _on_lifecycle(self, msg: EngineLifecycle) -> None:
        self.engine_state = msg.state
        self.engine_message = msg.message or f"the engine is {msg.state}"
        if msg.state == EngineState.READY:
            self.last_heartbeat = time.monotonic()
        else:
            self.fail_all(f"the engine failed and is restarting: {msg.message}", 503)

    def _on_process_event(self, msg: ProcessEvent) -> None:
        self.processes[(msg.role, msg.index)] = msg.alive
        if msg.alive:
            return
        if msg.role == ProcessRole.TOKENIZER:
            # Requests queued in the dead worker are lost; send every request that has not
            # produced output again. The core ignores ids it already holds.
            for stream in self._streams.values():
                if not stream.started:
                    self._to_tokenizers.send(self._encoder.encode(stream.request))
        elif msg.role == ProcessRole.DETOKENIZER:
            # Its incremental decoding state is gone: fail its requests cleanly.
            m = self.config.detokenizer_workers
            for req_id, stream in list(self._streams.items()):
                if detokenizer_index(req_id, m) == msg.index:
                    stream.queue.put_nowait(
                        RequestError("the detokenizer serving this request restarted", 503)
                    )
