"""`zllm proxy --prefill URL --decode URL`: one OpenAI endpoint over disaggregated engines.

    client ──POST /v1/completions──► proxy ──① same body, max_tokens 1, not streamed,
                                       │      kv_transfer_params {"do_remote_decode": true}
                                       │      ──► a prefill server (kv_producer): computes the
                                       │          prompt, sends its KV blocks to the decode
                                       │          server's buffer
                                       └──② the client's body, kv_transfer_params
                                              {"do_remote_prefill": true} ──► a decode server
                                              (kv_consumer): waits for the blocks, decodes;
                                              its answer (streamed or not) goes back as it is

The same goes for /v1/chat/completions, Anthropic's /v1/messages and /v1/responses (whose
cap is max_output_tokens). Each prefill server sends its blocks to the one decode server
its --kv-transfer-config names, so the servers come in pairs: the i-th --prefill with the
i-th --decode (or every prefill server with the one --decode), and requests go to the pairs
round robin. What the client sends is what the decode server answers: its status, headers
that matter, and body, relayed chunk by chunk; a client that goes away closes the decode
request (which the server aborts). A prefill server's 4xx (bad input) is the answer, as one
server would have given it; a prefill server that is down or fails (5xx) is skipped: the
decode server then computes the prompt itself, so the request is slower, not lost.
Everything else (GET /v1/models, /tokenize, ...) goes to a decode server, relayed as it
comes; /health asks every server. Before serving, the proxy checks that the servers pair up:
prefill servers kv_producers, decode servers kv_consumers, all on the same weights
(zllm/proxy/pairing.py); otherwise it exits naming them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from zllm.config.tenants import TENANT_HEADER
from zllm.errors import RequestError
from zllm.frontend.replies import error_response
from zllm.proxy.pairing import check_servers

logger = logging.getLogger("zllm.proxy")

# Headers passed on to the servers (the client's credentials and request id), and back.
_REQUEST_HEADERS = ("authorization", "x-api-key", "x-request-id", TENANT_HEADER)
_RESPONSE_HEADERS = ("content-type", "x-request-id", "retry-after")
# The generation endpoints that go through prefill first, and the field each caps the
# prefill server's answer with (one token: all that matters there is the prompt's KV).
GENERATION_PATHS = {
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/v1/messages": "max_tokens",
    "/v1/responses": "max_output_tokens",
}
# Fields of the client's body that make no sense for that one-token, unstreamed prefill
# (beam search's settings with use_beam_search: the decode server runs the beams, and a
# server refuses beam_width without use_beam_search).
_NOT_FOR_PREFILL = (
    "stream_options", "best_of", "min_tokens", "n",
    "use_beam_search", "beam_width", "length_penalty", "early_stopping",
)  # fmt: skip


@dataclass
class ProxyConfig:
    prefill_urls: Sequence[str]
    decode_urls: Sequence[str]
    timeout_s: float = 600.0
    # The start's check (zllm/proxy/pairing.py): the key it asks the servers with, and how
    # long it waits for servers still starting.
    api_key: str | None = None
    startup_timeout_s: float = 600.0


class DisaggProxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._pairs = itertools.cycle(pairs_of(config.prefill_urls, config.decode_urls))
        decode = [u.rstrip("/") for u in config.decode_urls]
        self._decode = itertools.cycle(decode)
        self._servers = [*(u.rstrip("/") for u in config.prefill_urls), *decode]
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def generate(self, request: Request) -> Response:
        raw = await request.body()
        path = request.url.path
        headers = _pass_on(request.headers, _REQUEST_HEADERS)
        prefill_url, decode_url = next(self._pairs)
        body = _json_object(raw)
        params = None if body is None else body.get("kv_transfer_params")
        if params is None:
            params = {}  # (JSON null is no params, as the servers read it)
        if body is None or not isinstance(params, dict):
            # Not ours to judge: the server answers it (a 400), as it would without us.
            return await self._forward("POST", decode_url + path, raw, headers)
        prefilled, answer = await self._prefill_step(
            prefill_url + path, prefill_body(path, body, params), headers
        )
        if answer is not None:
            return answer
        if prefilled:
            params = {**params, "do_remote_prefill": True}
        decode_body = {**body, "kv_transfer_params": params} if params else body
        return await self._forward(
            "POST", decode_url + path, json.dumps(decode_body).encode(), headers
        )

    async def _prefill_step(
        self, url: str, prefill_body: dict, headers: dict[str, str]
    ) -> tuple[bool, Response | None]:
        """Have a prefill server compute the prompt. Returns whether it did (the decode
        server then waits for the blocks), and its 4xx, which is the client's answer."""
        try:
            r = await self.client.post(url, json=prefill_body, headers=headers)
        except httpx.HTTPError as e:
            _log_skipped_prefill(url, repr(e))
            return False, None
        if 400 <= r.status_code < 500:
            answer = Response(r.content, r.status_code, _pass_on(r.headers, _RESPONSE_HEADERS))
            return False, answer
        if r.status_code != 200:
            _log_skipped_prefill(url, f"status {r.status_code}")
            return False, None
        return True, None

    async def _forward(
        self, method: str, url: str, content: bytes, headers: dict[str, str]
    ) -> Response:
        """A request to a decode server; its answer, relayed as it comes (streamed or not:
        either way a client that leaves closes the request to the server)."""
        send_headers = {**headers, "content-type": headers.get("content-type", "application/json")}
        upstream = self.client.build_request(method, url, content=content, headers=send_headers)
        try:
            r = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return _unavailable(f"the decode server at {url} is not answering: {e!r}")
        out_headers = _pass_on(r.headers, _RESPONSE_HEADERS)
        if r.status_code != 200:
            body = await r.aread()
            await r.aclose()
            return Response(body, r.status_code, out_headers)
        return StreamingResponse(
            r.aiter_raw(), r.status_code, out_headers, background=BackgroundTask(r.aclose)
        )

    async def other(self, request: Request) -> Response:
        """Anything but generation: a decode server answers it."""
        url = next(self._decode) + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        headers = _pass_on(request.headers, (*_REQUEST_HEADERS, "content-type"))
        return await self._forward(request.method, url, await request.body(), headers)

    async def health(self, request: Request) -> Response:
        """200 when every prefill and decode server answers /health with 200 (asked all at
        once: one that hangs costs its 5 s timeout once, not once per server after it)."""
        problems = await asyncio.gather(*(self._health_of(url) for url in self._servers))
        down = [f"{url} ({why})" for url, why in zip(self._servers, problems, strict=True) if why]
        if not down:
            return Response(status_code=200)
        return JSONResponse({"status": "unavailable", "down": down}, 503)

    async def _health_of(self, url: str) -> str | None:
        """Why the server at `url` is not healthy, or None when it is."""
        try:
            r = await self.client.get(url + "/health", timeout=5.0)
        except httpx.HTTPError:
            return "not answering"
        return None if r.status_code == 200 else str(r.status_code)

    async def close(self) -> None:
        await self.client.aclose()


def _log_skipped_prefill(url: str, why: str) -> None:
    logger.warning("prefill at %s failed (%s): the decode server computes the prompt", url, why)


def _json_object(raw: bytes) -> dict | None:
    """The body as a JSON object; None when it is none (not JSON, nested past what the
    parser recurses into, or another JSON value)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def prefill_body(path: str, body: dict, params: dict) -> dict:
    """The client's body (with its kv_transfer_params `params`) as the prefill server gets
    it: one token, not streamed, and asked to send the prompt's blocks on."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out[GENERATION_PATHS[path]] = 1
    if "max_completion_tokens" in body:  # (chat's newer name for max_tokens)
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {**params, "do_remote_decode": True}
    return out


def pairs_of(prefill: Sequence[str], decode: Sequence[str]) -> list[tuple[str, str]]:
    """(prefill, decode) server pairs: the i-th of each, or every prefill server with the one
    decode server."""
    prefill = [u.rstrip("/") for u in prefill]
    decode = [u.rstrip("/") for u in decode]
    if not prefill or not decode:
        raise ValueError("zllm proxy needs at least one --prefill and one --decode URL")
    if len(decode) == 1:
        return [(p, decode[0]) for p in prefill]
    if len(prefill) != len(decode):
        raise ValueError(
            f"{len(prefill)} --prefill and {len(decode)} --decode servers: each prefill server "
            "sends to the one decode server its kv_ip:kv_port names, so give as many of each "
            "(paired in order) or one --decode"
        )
    return list(zip(prefill, decode, strict=True))


def _pass_on(headers, names: Sequence[str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in names}


def _unavailable(message: str) -> Response:
    """The servers' own 503 body (and its Retry-After)."""
    return error_response(RequestError(message, status=503))


def build_proxy_app(config: ProxyConfig) -> Starlette:
    proxy = DisaggProxy(config)
    routes = [Route(p, proxy.generate, methods=["POST"]) for p in GENERATION_PATHS]
    routes.append(Route("/health", proxy.health, methods=["GET"]))
    routes.append(Route("/{path:path}", proxy.other, methods=["GET", "POST", "PUT", "DELETE"]))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await proxy.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.proxy = proxy
    return app


def run_proxy(config: ProxyConfig, host: str, port: int) -> None:
    """Serve until stopped; PairingError (a ValueError) if the servers cannot be a pair."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [proxy] %(message)s")
    pairs_of(config.prefill_urls, config.decode_urls)  # (their count first: no server asked)
    servers = check_servers(
        config.prefill_urls, config.decode_urls, config.api_key, config.startup_timeout_s
    )
    logger.info("the servers pair up: weights %s", servers[0].weights_fingerprint)
    logger.info(
        "zllm proxy on http://%s:%d: prefill %s, decode %s",
        host,
        port,
        ", ".join(config.prefill_urls),
        ", ".join(config.decode_urls),
    )
    uvicorn.run(build_proxy_app(config), host=host, port=port, log_level="warning", loop="auto")
