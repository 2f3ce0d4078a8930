"""The door in front of every route, before any body is read.

In order: the API key; for POSTs, 503 once draining or (generation routes) overloaded, 413
for a body over the limit (refused from Content-Length before reading it, or counted while
it streams in), 415 for a body that is not JSON, 408 for a body that does not arrive in
time. A generation request then gets an admission `Ticket` in its scope, released when the
response is completely sent.

The routes come from the route table (frontend/routes.py): which are generation routes,
which key each needs (`Access`). With API keys set, every route needs one except /health
(never) and the observability routes (/metrics, /dashboard, /version), which need a key
only with `--protect-metrics`: an API key, or a `--metrics-api-key` (those open nothing
else). An unknown path gets its 404 without. A refusal has the shape of its route's API's
errors. An observability request's `Viewer` goes into its scope (frontend/access/permissions.py): an
API key under tenant isolation sees its own tenant's series, anyone else every tenant's.

A generation request's tenant (zllm/config/tenants.py) goes into its scope too: the key it was sent
with, else its X-Tenant header (400 when malformed), else the default tenant; the tenant's
own limits (frontend/access/tenant_limits.py) then answer 429 beyond them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zllm.config.serve import ServeConfig
from zllm.config.tenants import TENANT_HEADER, api_key_tenant, check_tenant_name
from zllm.errors import ParamError, RequestError
from zllm.frontend.access.admission import SHUTTING_DOWN, Admission, Ticket
from zllm.frontend.access.permissions import EVERYONE, VIEWER_KEY, Access, Viewer
from zllm.frontend.access.tenant_limits import TenantLimits
from zllm.frontend.replies import error_response
from zllm.protocol import DEFAULT_TENANT

BODY_TIMEOUT_S = 60.0  # the whole request body must arrive within this
TICKET_KEY = "zllm.admission"  # where a generation request's Ticket sits in the ASGI scope
TENANT_KEY = "zllm.tenant"  # and its tenant's name

if TYPE_CHECKING:
    from zllm.frontend.routes import ApiRoute

MISSING_KEY = "Missing or invalid API key: send `Authorization: Bearer <key>`."


class Gate:
    def __init__(
        self,
        app: ASGIApp,
        config: ServeConfig,
        admission: Admission,
        routes: Sequence[ApiRoute],
        tenant_limits: TenantLimits | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.admission = admission
        self.tenant_limits = tenant_limits
        # The table's paths have no parameters: a request's route is found by its path.
        self.routes = {route.path: route for route in routes}
        self.generation_paths = frozenset(r.path for r in routes if r.generation)
        # Keys are compared as SHA-256 digests: constant time, whatever their lengths.
        self.key_digests = [_digest(k.encode()) for k in config.api_keys]
        self.metrics_key_digests = [_digest(k.encode()) for k in config.metrics_api_keys]
        # Observability routes need a key only when protected and some key can open them.
        self.observability_keyed = config.protect_metrics and bool(
            self.key_digests or self.metrics_key_digests
        )
        self.tenant_views = config.prefix_cache_isolation == "tenant"
        self.max_body = config.max_request_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        keys = _given_keys(scope)
        key_index = _find(keys, self.key_digests) if self.key_digests else None
        refusal = self._refusal(scope, keys, key_index)
        if refusal is not None:
            return await self._error(scope, refusal)(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            body = await asyncio.wait_for(read_body(receive, self.max_body), self.body_timeout_s)
        except BodyTooLarge:
            return await self._error(scope, self._too_large())(scope, receive, send)
        except asyncio.TimeoutError:  # a client trickling its body in holds a connection
            message = f"The request body did not arrive within {self.body_timeout_s:g} s."
            return await self._error(scope, RequestError(message, 408))(scope, receive, send)
        if body is None:
            return  # the client left before sending its whole request
        receive = replay(body, receive)
        if scope["path"] not in self.generation_paths:
            return await self.app(scope, receive, send)
        try:
            tenant = scope[TENANT_KEY] = _tenant(scope, key_index)
        except ParamError as e:
            refusal = RequestError(str(e), param=e.param)
            return await self._error(scope, refusal)(scope, receive, send)
        limits = self.tenant_limits if self.tenant_limits and self.tenant_limits.enabled else None
        if limits is not None and (refusal := limits.enter(tenant)) is not None:
            return await self._error(scope, refusal)(scope, receive, send)
        ticket = scope[TICKET_KEY] = Ticket()  # the route admits it; released when sent
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release(ticket)
            if limits is not None:
                limits.leave(tenant)

    def _refusal(
        self, scope: Scope, keys: list[bytes], key_index: int | None
    ) -> RequestError | None:
        """The error for a request refused at the door, or None. An observability request
        let in gets its Viewer in its scope."""
        path: str = scope["path"]
        route = self.routes.get(path)
        access = Access.PUBLIC if route is None else route.access
        if access is Access.API and self.key_digests and key_index is None:
            return RequestError(MISSING_KEY, 401, code="invalid_api_key")
        if access is Access.OBSERVABILITY:
            viewer = self._viewer(keys, key_index)
            if viewer is None:
                return RequestError(MISSING_KEY, 401, code="invalid_api_key")
            scope[VIEWER_KEY] = viewer
        if scope["method"] != "POST":
            return None
        if self.admission.draining:
            return RequestError(SHUTTING_DOWN, 503)
        if path in self.generation_paths and self.admission.full():
            return self.admission.overloaded()
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"").strip()
        if length.isdigit() and int(length) > self.max_body:
            return self._too_large()
        content_type = headers.get(b"content-type")
        if content_type is not None and not _is_json(content_type):
            # Also what keeps a cross-site HTML form (no CORS preflight) from posting here.
            return RequestError(
                f"The request body must be JSON (Content-Type: application/json), "
                f"not {content_type.decode('latin-1')!r}.",
                415,
            )
        return None

    def _too_large(self) -> RequestError:
        return RequestError(
            f"The request body is larger than this server accepts ({self.max_body} bytes; "
            "--max-request-body-bytes).",
            413,
        )

    def _viewer(self, keys: list[bytes], key_index: int | None) -> Viewer | None:
        """Who reads an observability route (frontend/access/permissions.py), or None: refused."""
        if not self.observability_keyed:
            return EVERYONE  # open: anyone sees all, so a key narrows nothing
        if key_index is not None:
            return Viewer(api_key_tenant(key_index)) if self.tenant_views else EVERYONE
        if self.metrics_key_digests and _find(keys, self.metrics_key_digests) is not None:
            return EVERYONE
        return None

    def _error(self, scope: Scope, error: RequestError) -> Response:
        """The error in the shape of its route's API (Anthropic's or OpenAI's)."""
        route = self.routes.get(scope["path"])
        return route.errors.response(error) if route is not None else error_response(error)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _given_keys(scope: Scope) -> list[bytes]:
    """The keys a request carries (`Authorization: Bearer`, `x-api-key`)."""
    given: list[bytes] = []
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            given.append(value[7:].strip())
        elif name == b"x-api-key":
            given.append(value.strip())
    return given


def _find(given: list[bytes], digests: list[bytes]) -> int | None:
    """Which of `digests` one of the `given` keys matches (its position), or None. Keys are
    compared as SHA-256 digests in constant time, whatever their lengths."""
    found = None
    for candidate in given:
        digest = _digest(candidate)
        for i, key in enumerate(digests):  # every key: no early exit to time
            if hmac.compare_digest(digest, key) and found is None:
                found = i
    return found


def _tenant(scope: Scope, key_index: int | None) -> str:
    """The request's tenant: its API key's, else its X-Tenant header (checked), else the
    default. With keys set, the key decides: a header cannot claim another tenant."""
    if key_index is not None:
        return api_key_tenant(key_index)
    for name, value in scope["headers"]:
        if name == TENANT_HEADER.encode():
            return check_tenant_name(value.decode("latin-1").strip(), "X-Tenant")
    return DEFAULT_TENANT


def _is_json(content_type: bytes) -> bool:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json" or media_type.endswith(b"+json")


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
