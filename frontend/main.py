"""The frontend process: `python -m zllm.frontend.main <config-path> [index]`.

Serves HTTP with uvicorn on uvloop, reports ready to the supervisor once it listens, and on
SIGTERM drains: new requests get 503, those in flight may finish until `drain_timeout`, the
rest then fail with a clear error, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

import uvicorn

from zllm.config.serve import ServeConfig
from zllm.frontend.app import build_app
from zllm.frontend.handlers.server import OpenAIServer
from zllm.protocol import ProcessRole
from zllm.runtime.engine_client import EngineClient
from zllm.runtime.procutil import die_with_parent, index_arg, report_ready, start_process
from zllm.text.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("zllm.frontend")

# Beyond the drain timeout, uvicorn waits this long for the failed requests' last bytes.
_FAIL_GRACE_S = 2.0
# A TLS connection uvicorn has closed waits for the client's close_notify (asyncio's SSL
# shutdown timeout: 30 s). An idle keep-alive connection in a client's pool never sends one,
# so after this grace the shutdown drops such a connection instead of waiting out the 30 s.
_TLS_CLOSE_GRACE_S = 1.0


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        serve_config: ServeConfig,
        api: OpenAIServer,
        client: EngineClient,
    ) -> None:
        super().__init__(config)
        self.serve_config = serve_config
        self.api = api
        self.client = client

    def handle_exit(self, sig: int, frame) -> None:
        # Unlike uvicorn's own handler this does not re-raise the signal once shut down,
        # so a drained frontend exits with status 0.
        self.api.admission.start_draining()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            await asyncio.to_thread(
                report_ready, self.serve_config, ProcessRole.FRONTEND, index_arg()
            )
            config = self.serve_config
            logger.info("listening on %s://%s:%d", config.scheme, config.host, config.port)

    async def shutdown(self, sockets=None) -> None:
        # uvicorn stops listening, then waits for open connections; meanwhile fail whatever
        # is still running when the drain timeout ends, and drop the TLS connections that
        # were idle (uvicorn closes them at once) but wait on their client's close_notify.
        helpers = [asyncio.create_task(self._fail_after_drain_timeout())]
        if self.serve_config.ssl_certfile:
            idle = [c for c in self.server_state.connections if _between_requests(c)]
            helpers.append(asyncio.create_task(self._abort_closed_tls_connections(idle)))
        try:
            await super().shutdown(sockets)
        finally:
            for helper in helpers:
                helper.cancel()

    async def _abort_closed_tls_connections(self, idle: list) -> None:
        """Abort each of the `idle` connections (between requests when the shutdown began:
        nothing of theirs is unsent) once it has been closing for _TLS_CLOSE_GRACE_S, so a
        client that never answers TLS's close_notify does not hold the exit for asyncio's
        30 s. Connections that were serving a request are left to the drain: the tail of
        their response may still sit in a transport's buffer."""
        deadline = time.monotonic() + _TLS_CLOSE_GRACE_S
        while idle:
            await asyncio.sleep(max(0.0, min(0.1, deadline - time.monotonic())))
            if time.monotonic() < deadline:
                continue
            still_open = []
            for connection in idle:
                transport = getattr(connection, "transport", None)
                if connection not in self.server_state.connections or transport is None:
                    continue
                if transport.is_closing():
                    transport.abort()
                else:
                    still_open.append(connection)
            idle = still_open
            await asyncio.sleep(0.1)

    async def _fail_after_drain_timeout(self) -> None:
        deadline = time.monotonic() + self.serve_config.drain_timeout
        while self.client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.client.num_in_flight:
            logger.warning(
                "drain timeout (%.0f s): failing %d request(s) still running",
                self.serve_config.drain_timeout,
                self.client.num_in_flight,
            )
            self.client.fail_all("the server is shutting down (drain timeout reached)", 503)


def _between_requests(connection) -> bool:
    """Whether a uvicorn HTTP connection has no request in progress (its `cycle` is the
    request/response cycle: none yet, or its response complete)."""
    cycle = getattr(connection, "cycle", None)
    return cycle is None or bool(getattr(cycle, "response_complete", False))


async def serve(config: ServeConfig, tokenizer: Tokenizer) -> None:
    client = EngineClient(config)
    await client.start()
    # The supervisor's run directory holds the config file this process was started with.
    app = build_app(config, client, tokenizer, os.path.dirname(os.path.abspath(sys.argv[1])))
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        log_level="warning",
        timeout_graceful_shutdown=config.drain_timeout + _FAIL_GRACE_S,
        timeout_keep_alive=config.timeout_keep_alive,
        # HTTPS when a certificate is given (checked by the supervisor: zllm/config/tls.py).
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
        ssl_ca_certs=config.ssl_ca_certs,
        ssl_cert_reqs=config.ssl_cert_reqs,
    )
    server = _Server(uv_config, config, app.state.server, client)
    try:
        await server.serve()
    finally:
        await client.close()
        tracer = app.state.server.tracer
        if tracer is not None:  # the spans still batched
            await asyncio.to_thread(tracer.shutdown)


def main() -> int:
    config = start_process(ProcessRole.FRONTEND)
    # Drain rather than vanish when the supervisor dies (start_process asked for SIGKILL).
    die_with_parent(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # until uvicorn takes over
    tokenizer = load_tokenizer(config.engine.tokenizer_path, config.chat_template)
    try:
        import uvloop
    except ImportError:  # not on every platform
        asyncio.run(serve(config, tokenizer))
    else:
        uvloop.run(serve(config, tokenizer))
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
