"""Admission control: how much generation work the frontend lets in.

Work admitted and not yet finished is counted in *engine requests*: one per prompt (a
completions request with 4 prompts counts 4; its `n` samples share one). At
`max_num_seqs + max_waiting_requests` new generation requests get 503 with Retry-After at
once, before their body is read, so an overloaded server answers in microseconds instead
of queueing work it cannot start for minutes. The HTTP middleware (`frontend/access/middleware.py`)
checks `full()` first and hands each generation request a `Ticket`; the route, once it knows
how many prompts the request holds, admits it for real (nothing awaits between the check
and the count, so it cannot overshoot); the middleware releases the ticket when the response
is completely sent, streams included. Once draining (SIGTERM), nothing new is admitted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from zllm.errors import RequestError
from zllm.frontend.replies import RETRY_AFTER_S

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 10.0
SHUTTING_DOWN = "the server is shutting down"


@dataclass(slots=True)
class Ticket:
    """What one HTTP request holds (released by the middleware when the response ends)."""

    count: int = 0


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0  # engine requests admitted and not finished
        self.num_rejected = 0
        self.draining = False
        self._last_warning = 0.0

    def start_draining(self) -> None:
        """SIGTERM: new requests get 503 from now on; those in flight go on."""
        self.draining = True

    def full(self) -> bool:
        return self.in_flight >= self.limit

    def admit(self, ticket: Ticket, count: int) -> None:
        """Count `count` engine requests in, or raise the 503 to send.

        A request larger than the whole limit is admitted when nothing else runs, so it is
        not refused forever."""
        if self.in_flight and self.in_flight + count > self.limit:
            raise self.overloaded()
        ticket.count += count
        self.in_flight += count

    def release(self, ticket: Ticket) -> None:
        self.in_flight -= ticket.count
        ticket.count = 0

    def overloaded(self) -> RequestError:
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
        return RequestError(
            f"The server is overloaded ({self.in_flight} requests in flight, the limit is "
            f"{self.limit}). Retry after {RETRY_AFTER_S} s.",
            status=503,
            code="overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
