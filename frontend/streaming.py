"""Streams of outputs, server-sent events, and clients that go away.

uvicorn drops writes to a closed connection silently, so a disconnect is watched on the
ASGI receive channel rather than discovered by a failing send. Whoever stops reading a
stream of engine outputs closes it, which aborts its requests in the core.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from zllm.errors import RequestError
from zllm.frontend.replies import DONE_EVENT, error_event

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as items come, as (stream index, item). Closing this
    closes them all (which aborts the unfinished requests in the core)."""
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for item in stream:
                yield 0, item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
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


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T], outputs: AsyncIterator[Any]) -> T:
    """Run `work` unless the client goes away first; then stop it, abort its requests (by
    closing `outputs`) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await outputs.aclose()  # type: ignore[attr-defined]
    if task.cancelled():
        raise ClientGone
    return task.result()


async def sse_response(
    request: Request,
    events: AsyncIterator[bytes],
    outputs: AsyncIterator[Any],
    headers: dict[str, str] | None = None,
    done: bytes = DONE_EVENT,
    on_error: Callable[[RequestError], bytes] = error_event,
) -> Response:
    """An SSE response, started once the first event is ready: a request the engine
    refuses (a prompt too long, the engine down) still gets a proper error status. `done`
    ends the stream (OpenAI's `[DONE]`; empty for Anthropic's), `on_error` turns a failure
    after the start into the API's error event."""
    try:
        first = await until_disconnect(request, _first(events), outputs)
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
    return EventStream(_sse_body(first, events, outputs, done, on_error), headers)


async def _first(events: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _sse_body(
    first: bytes | None,
    events: AsyncIterator[bytes],
    outputs: AsyncIterator[Any],
    done: bytes,
    on_error: Callable[[RequestError], bytes],
) -> AsyncIterator[bytes]:
    """The SSE events, then `done`; a failure after the start becomes an error event."""
    try:
        if first is not None:
            yield first
            async for event in events:
                yield event
    except RequestError as e:
        yield on_error(e)
    except Exception as e:
        logger.exception("error while streaming")
        yield on_error(RequestError(f"internal server error: {type(e).__name__}: {e}", 500))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        await outputs.aclose()  # type: ignore[attr-defined]
    if done:
        yield done


class EventStream(Response):
    """Server-sent events that stop (and abort the request) as soon as the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        for name, value in (headers or {}).items():
            self.raw_headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait((sender, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not sender.done():
                sender.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if not sender.cancelled() and sender.exception() is not None:
            logger.error("SSE stream failed: %r", sender.exception())

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
