"""The doors in front of the engine: admission control and request-body limits.

Admission counts generation work admitted and not yet finished, in *engine requests*: one
per prompt (a completions request with 4 prompts counts 4; its `n` samples share one). At
`max_num_seqs + max_waiting_requests` new generation requests get 503 with Retry-After at
once, before their body is read, so an overloaded server answers in microseconds instead
of queueing work it cannot start for minutes. The HTTP middleware (`_Gate` in app.py)
checks the count first; the route, once it knows how many prompts a request holds, admits
it for real (nothing awaits between the check and the count, so it cannot overshoot); the
middleware releases it when the response is completely sent, streams included.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.types import Message, Receive

from zllm.frontend.api_models import ApiError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
BODY_TIMEOUT_S = 60.0  # the whole request body must arrive within this
_WARN_EVERY_S = 10.0
SCOPE_KEY = "zllm.admission"


@dataclass(slots=True)
class Ticket:
    """What one HTTP request holds (released by the middleware when the response ends)."""

    count: int = 0


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0  # engine requests admitted and not finished
        self.num_rejected = 0
        self._last_warning = 0.0

    def full(self) -> bool:
        return self.in_flight >= self.limit

    def admit(self, ticket: Ticket | None, count: int) -> None:
        """Count `count` engine requests in, or raise the 503 to send.

        A request larger than the whole limit is admitted when nothing else runs, so it is
        not refused forever."""
        if ticket is None:  # not behind the middleware (a unit test): no accounting
            return
        if self.in_flight and self.in_flight + count > self.limit:
            raise self.overloaded()
        ticket.count += count
        self.in_flight += count

    def release(self, ticket: Ticket) -> None:
        self.in_flight -= ticket.count
        ticket.count = 0

    def overloaded(self) -> ApiError:
        self.num_rejected += 1
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            logger.warning(
                "overloaded: %d engine requests in flight (limit %d = --max-num-seqs + "
                "--max-waiting-requests); rejecting new ones with 503 (%d so far)",
                self.in_flight,
                self.limit,
                self.num_rejected,
            )
        return ApiError(
            f"The server is overloaded ({self.in_flight} requests in flight, the limit is "
            f"{self.limit}). Retry after {RETRY_AFTER_S} s.",
            status=503,
            code="overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class BodyTooLarge(Exception):
    pass


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None if the client left; BodyTooLarge past `limit`
    (checked as chunks arrive, so a body without Content-Length cannot exhaust memory)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive channel that yields `body` first, then whatever the client sends next
    (the disconnect that the routes watch for)."""
    sent = False

    async def receive_again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


def too_large_message(limit: int) -> str:
    return (
        f"The request body is larger than this server accepts ({limit} bytes; "
        "--max-request-body-bytes)."
    )
