"""An asyncio client of the running engine processes.

The frontend serves HTTP with it, and any asyncio application can embed zllm with it instead
of HTTP: submit a request, iterate its outputs, abort it. It owns the frontend's sockets: it
pushes requests to the tokenizer workers and aborts to the core, and receives detokenized
outputs, rejections, heartbeats and process events on one PULL socket.

Every request it sends carries this process's id as `client_id`: if this process dies, the
supervisor tells the core, which aborts its requests.

With several data-parallel engines it tracks each one: its state and heartbeat, and which
engine each request went to (the tokenizer's RequestRouted). An engine's death fails only
the requests on it; the client serves while any engine is ready.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from zllm.config.serve import ServeConfig
from zllm.errors import RequestError
from zllm.protocol import (
    AbortRequests,
    EngineLifecycle,
    EngineState,
    EngineStats,
    FrontendBatch,
    FrontendInput,
    PrefixCacheReset,
    ProcessEvent,
    ProcessRole,
    RequestOutputDelta,
    RequestRejected,
    RequestRouted,
    ResetPrefixCache,
    SleepControl,
    SleepReply,
    TokenizeRequest,
)
from zllm.runtime.engine_stats import merge_stats
from zllm.runtime.messaging import areceive, detokenizer_index

logger = logging.getLogger(__name__)

_SHUTTING_DOWN = "the server is shutting down"

CoreControl = SleepControl | ResetPrefixCache  # a control call, answered by a CoreReply
CoreReply = SleepReply | PrefixCacheReset


@dataclass(eq=False)
class _Stream:
    request: TokenizeRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_finished: int = 0
    started: bool = False  # some output arrived: the tokenizer stage is behind it
    engine: int | None = None  # the engine it was sent to (None: not known yet)
    # Why it failed, once it has: read before any output still queued (see fail).
    error: RequestError | None = None

    def fail(self, error: RequestError) -> None:
        """End the request with `error` at once: outputs queued behind a slow reader (a
        stream whose client reads slowly) are dropped, so a shutdown's or a timeout's error
        reaches the client without waiting on them. The first failure is the one kept."""
        if self.error is None:
            self.error = error
            self.queue.put_nowait(error)  # wakes a reader waiting on an empty queue


class EngineClient:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.client_id = os.getpid()
        self._ctx = zmq.asyncio.Context.instance()
        self._encoder = msgspec.msgpack.Encoder()
        self._streams: dict[str, _Stream] = {}
        self._receiver: asyncio.Task | None = None
        self.num_engines = config.data_parallel_size
        self.engine_states = [EngineState.STARTING] * self.num_engines
        self.engine_messages = ["the engine is starting"] * self.num_engines
        self.engine_stats: dict[int, EngineStats] = {}  # the latest heartbeat of each
        self.heartbeats = [0.0] * self.num_engines  # monotonic time of each one's latest
        # (role, index) of every worker, (role, index, engine) of engine processes: alive?
        self.processes: dict[tuple[ProcessRole, int] | tuple[ProcessRole, int, int], bool] = {}
        self.closed = False
        # Control calls (sleep mode, prefix cache reset): replies awaited from the cores, by
        # reply_to id.
        self._replies: dict[int, asyncio.Future[CoreReply]] = {}
        self._reply_engine: dict[int, int] = {}  # reply id -> the engine asked
        self._next_reply_id = 1

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        ep = self.config.endpoints
        self._to_tokenizers = self._ctx.socket(zmq.PUSH)
        self._to_tokenizers.bind(ep.tokenizer_in)
        self._to_cores = []
        for engine in ep.engines:
            sock = self._ctx.socket(zmq.PUSH)
            # Queue nothing for a core that is down: an abort for it is moot (its requests
            # failed with it), and a send must not wait for it to come back.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(engine.core_in)
            self._to_cores.append(sock)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(ep.frontend_in)
        self._receiver = asyncio.create_task(self._receive_loop())

    async def close(self) -> None:
        self.closed = True
        if self._receiver is not None:
            self._receiver.cancel()
        self.fail_all(_SHUTTING_DOWN, 503)
        for sock in (self._to_tokenizers, *self._to_cores, self._inbox):
            sock.close(linger=0)

    def mark_ready(self) -> None:
        """The engines are up (for an embedding that started them without supervisor
        events)."""
        self.engine_states = [EngineState.READY] * self.num_engines
        self.heartbeats = [time.monotonic()] * self.num_engines

    # ---- health --------------------------------------------------------------------------
    @property
    def engine_state(self) -> EngineState:
        """READY while any engine is; else DEAD if one died, else STARTING."""
        for state in (EngineState.READY, EngineState.DEAD):
            if state in self.engine_states:
                return state
        return EngineState.STARTING

    @property
    def engine_message(self) -> str:
        """Why no engine serves (the first one's reason)."""
        return self.engine_messages[0]

    @property
    def stats(self) -> EngineStats | None:
        """The latest heartbeat; with several engines, theirs summed (merge_stats)."""
        if not self.engine_stats:
            return None
        return merge_stats([self.engine_stats[e] for e in sorted(self.engine_stats)])

    @property
    def last_heartbeat(self) -> float:
        return max(self.heartbeats)

    def engine_health(self, engine: int) -> str | None:
        """Why an engine is not serving, or None when it is."""
        if self.engine_states[engine] != EngineState.READY:
            return self.engine_messages[engine]
        age = time.monotonic() - self.heartbeats[engine]
        if age > self.config.heartbeat_timeout:
            return f"no heartbeat from the engine core for {age:.1f} s"
        return None

    def health(self) -> tuple[bool, str]:
        """(serving, what is wrong): serving while any engine is; the message names the
        engines that are down ("ok" when none is)."""
        problems = {e: self.engine_health(e) for e in range(self.num_engines)}
        down = {e: why for e, why in problems.items() if why is not None}
        if len(down) == self.num_engines:
            return False, down[0] if self.num_engines == 1 else _engines_down(down)
        dead = [
            f"{key[0]} {key[1]}"
            for key, alive in self.processes.items()
            if not alive and not key[0].is_engine
        ]
        if dead:
            return False, "process down: " + ", ".join(sorted(dead))
        if down:
            return True, _engines_down(down)
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
                if stream.error is not None:
                    raise stream.error  # the finally clause aborts it in the core (idempotent)
                if item.finish_reason is not None:
                    stream.num_finished += 1
                    finished = stream.num_finished >= request.sampling_params.n
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            self._streams.pop(request.req_id, None)
            if not finished:
                await self.abort(request.req_id, self._engine_of(stream))

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
        stream.fail(RequestError(message, 504, code="request_timeout"))

    async def abort(self, req_id: str, engine: int | None = None) -> None:
        """Abort in its engine's core (every core, when it is not known)."""
        if self.closed:
            return
        data = self._encoder.encode(AbortRequests([req_id]))
        for e, sock in enumerate(self._to_cores):
            if engine is None or e == engine:
                try:
                    await sock.send(data, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # that core is down: its requests died with it

    async def sleep_control(
        self, command: str, level: int = 1, tags: Sequence[str] = (), timeout: float = 600
    ) -> SleepReply:
        """POST /sleep or /wake_up: every engine's core is asked (data-parallel engines sleep
        and wake together) and the answers are combined: ok when every core carried it out,
        else the first refusal (a core that did sleep stays asleep: sleeping is idempotent,
        so the call can be repeated once the others are idle)."""
        replies = await asyncio.gather(
            *(
                self._ask_core(engine, SleepControl(command, 0, level, list(tags)), timeout)
                for engine in self._serving_engines()
            )
        )
        sleep_replies = [r for r in replies if isinstance(r, SleepReply)]
        refused = [r for r in sleep_replies if not r.ok]
        first = refused[0] if refused else sleep_replies[0]
        return SleepReply(
            first.reply_to, not refused, any(r.asleep for r in sleep_replies), first.message
        )

    async def reset_prefix_cache(
        self, tiers: bool = False, timeout: float = 600
    ) -> PrefixCacheReset:
        """POST /reset_prefix_cache: every serving engine's core drops its cached blocks
        (and with `tiers` its cpu and disk tiers' blocks); the counts are summed."""
        replies = await asyncio.gather(
            *(
                self._ask_core(engine, ResetPrefixCache(0, tiers), timeout)
                for engine in self._serving_engines()
            )
        )
        total = PrefixCacheReset(0, 0, [0, 0, 0])
        for reply in replies:
            if isinstance(reply, PrefixCacheReset):
                total.blocks_dropped += reply.blocks_dropped
                for tier, count in enumerate(reply.tier_blocks_dropped):
                    total.tier_blocks_dropped[tier] += count
        return total

    def _serving_engines(self) -> list[int]:
        """The engines a control call goes to: those that serve (one that is down or
        restarting has nothing to release and would not answer; it comes back awake with
        an empty prefix cache)."""
        return [e for e in range(self.num_engines) if self.engine_health(e) is None] or [0]

    async def _ask_core(self, engine: int, control: CoreControl, timeout: float) -> CoreReply:
        control.reply_to = reply_to = self._next_reply_id
        self._next_reply_id += 1
        future: asyncio.Future[CoreReply] = asyncio.get_running_loop().create_future()
        self._replies[reply_to] = future
        self._reply_engine[reply_to] = engine
        try:
            await self._to_cores[engine].send(self._encoder.encode(control))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._replies.pop(reply_to, None)
            self._reply_engine.pop(reply_to, None)

    @property
    def is_sleeping(self) -> bool:
        return self.stats is not None and self.stats.status.asleep

    def fail_all(self, message: str, status: int = 503, engine: int | None = None) -> None:
        """Fail every request in flight (on `engine`, when given)."""
        for stream in self._streams.values():
            if engine is None or self._engine_of(stream) == engine:
                stream.fail(RequestError(message, status))

    def _engine_of(self, stream: _Stream) -> int | None:
        """The engine a request is on (None: not known yet; with one engine, that one)."""
        return 0 if self.num_engines == 1 else stream.engine

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
            engine = msg.status.engine_index
            if engine < self.num_engines:
                self.engine_stats[engine] = msg
                self.heartbeats[engine] = time.monotonic()
        elif isinstance(msg, RequestRouted):
            self._on_routed(msg)
        elif isinstance(msg, RequestRejected):
            stream = self._streams.get(msg.req_id)
            if stream is not None:
                stream.fail(
                    RequestError(
                        msg.message, msg.status, msg.param, context_overflow=msg.context_overflow
                    )
                )
        elif isinstance(msg, ProcessEvent):
            self._on_process_event(msg)
        elif isinstance(msg, EngineLifecycle):
            self._on_lifecycle(msg)
        elif isinstance(msg, (SleepReply, PrefixCacheReset)):
            engine = self._reply_engine.get(msg.reply_to, 0)
            if isinstance(msg, SleepReply) and engine in self.engine_stats:
                self.engine_stats[engine].status.asleep = msg.asleep  # until the next heartbeat
            future = self._replies.get(msg.reply_to)
            if future is not None and not future.done():
                future.set_result(msg)

    def _on_lifecycle(self, msg: EngineLifecycle) -> None:
        engine = msg.engine
        if not 0 <= engine < self.num_engines:
            return
        self.engine_states[engine] = msg.state
        self.engine_messages[engine] = msg.message or f"the engine is {msg.state}"
        if msg.state == EngineState.READY:
            self.heartbeats[engine] = time.monotonic()
        else:
            self.engine_stats.pop(engine, None)
            message = f"the engine failed and is restarting: {msg.message}"
            if self.num_engines > 1:
                message = f"engine {engine} failed and is restarting: {msg.message}"
            self.fail_all(message, 503, engine)

    def _on_routed(self, msg: RequestRouted) -> None:
        """The tokenizer sent a request to an engine. If that engine died meanwhile (the
        news crossed), the request is lost with it: fail it, as its death did the others."""
        stream = self._streams.get(msg.req_id)
        if stream is None or not 0 <= msg.engine < self.num_engines:
            return
        stream.engine = msg.engine
        if self.engine_states[msg.engine] != EngineState.READY:
            message = f"engine {msg.engine} failed and is restarting"
            stream.fail(RequestError(message, 503))

    def _on_process_event(self, msg: ProcessEvent) -> None:
        key = (msg.role, msg.index, msg.engine) if msg.role.is_engine else (msg.role, msg.index)
        self.processes[key] = msg.alive
        if msg.alive:
            return
        if msg.role == ProcessRole.TOKENIZER:
            # Requests queued in the dead worker are lost; send every request that has not
            # produced output again. The core ignores ids it already holds (and with several
            # engines, one already routed to an engine is not sent again).
            for stream in self._streams.values():
                if not stream.started and stream.engine is None:
                    self._to_tokenizers.send(self._encoder.encode(stream.request))
        elif msg.role == ProcessRole.DETOKENIZER:
            # Its incremental decoding state is gone: fail its requests cleanly.
            m = self.config.detokenizer_workers
            for req_id, stream in list(self._streams.items()):
                if detokenizer_index(req_id, m) == msg.index:
                    stream.fail(RequestError("the detokenizer serving this request restarted", 503))


def _engines_down(down: dict[int, str]) -> str:
    return "; ".join(f"engine {e} down: {why}" for e, why in sorted(down.items()))
