"""EngineClient's request streams, on its own sockets: a test stands in for the tokenizer
workers (it reads what the client sends) and for the detokenizers (it pushes outputs to the
client's inbox), so the order in which a stream hands out outputs and errors can be set up
exactly. The whole engine behind the same client runs in test_engine_processes.py."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from zllm import SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.config.serve import Endpoints, ServeConfig
from zllm.errors import RequestError
from zllm.protocol import FrontendBatch, RequestOutputDelta, TokenizeRequest
from zllm.runtime.engine_client import EngineClient
from zllm.runtime.launch import ipc_endpoints


@pytest.fixture
def config(tiny_llama_dir) -> Iterator[ServeConfig]:
    endpoints = ipc_endpoints(num_detokenizers=1)
    engine = EngineArgs(model=tiny_llama_dir).create_engine_config()
    yield ServeConfig(engine=engine, endpoints=endpoints)
    shutil.rmtree(endpoints.ipc_dir or "", ignore_errors=True)


class FakeWorkers:
    """The tokenizer side (PULL on tokenizer_in) and the detokenizer side (PUSH to
    frontend_in) of a running engine, driven by hand."""

    def __init__(self, endpoints: Endpoints) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.requests = ctx.socket(zmq.PULL)
        self.requests.connect(endpoints.tokenizer_in)
        self.outputs = ctx.socket(zmq.PUSH)
        self.outputs.connect(endpoints.frontend_in)
        self._decoder = msgspec.msgpack.Decoder(TokenizeRequest)

    async def next_request(self) -> TokenizeRequest:
        return self._decoder.decode(await self.requests.recv())

    async def send_tokens(self, req_id: str, token_ids: list[int]) -> None:
        deltas = [RequestOutputDelta(req_id, 0, f"t{t}", [t]) for t in token_ids]
        await self.outputs.send(msgspec.msgpack.encode(FrontendBatch(deltas)))

    def close(self) -> None:
        self.requests.close(linger=0)
        self.outputs.close(linger=0)


async def started_client(config: ServeConfig) -> tuple[EngineClient, FakeWorkers]:
    client = EngineClient(config)
    await client.start()
    client.mark_ready()
    return client, FakeWorkers(config.endpoints)


def request(req_id: str, max_tokens: int = 8) -> TokenizeRequest:
    return TokenizeRequest(req_id, SamplingParams(max_tokens=max_tokens), prompt="hi")


async def until(condition, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


def test_a_failure_is_read_before_outputs_still_queued(config):
    """A slow reader has outputs queued when the server fails its request (a drain timeout,
    the engine restarting): the next read raises the error at once instead of handing out
    the queued outputs first, and the request is gone from the client."""

    async def scenario() -> None:
        client, workers = await started_client(config)
        try:
            stream = client.generate(request("slow"))
            reading = asyncio.ensure_future(anext(stream))  # sends the request
            assert (await workers.next_request()).req_id == "slow"
            await workers.send_tokens("slow", [5])
            assert (await reading).token_ids == [5]
            # Outputs arrive while the reader is not reading.
            await workers.send_tokens("slow", [6, 7, 8])
            queue = client._streams["slow"].queue
            await until(lambda: queue.qsize() == 3)

            client.fail_all("the server is shutting down (drain timeout reached)", 503)

            with pytest.raises(RequestError) as failed:
                await anext(stream)
            assert failed.value.status == 503
            assert "drain timeout" in str(failed.value)
            assert client.num_in_flight == 0
        finally:
            workers.close()
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_the_first_failure_is_the_one_kept_and_others_still_stream(config):
    """Two failures of one request (a timeout, then the shutdown) report the first; a request
    that did not fail keeps receiving its outputs in order."""

    async def scenario() -> None:
        client, workers = await started_client(config)
        try:
            failing = client.generate(request("a"))
            healthy = client.generate(request("b"))
            reading_a = asyncio.ensure_future(anext(failing))
            reading_b = asyncio.ensure_future(anext(healthy))
            sent = {(await workers.next_request()).req_id for _ in range(2)}
            assert sent == {"a", "b"}
            await workers.send_tokens("a", [1])
            await workers.send_tokens("b", [1])
            await asyncio.gather(reading_a, reading_b)

            stream_a = client._streams["a"]
            stream_a.fail(RequestError("past the request timeout", 504))
            stream_a.fail(RequestError("the server is shutting down", 503))
            await workers.send_tokens("b", [2, 3])

            with pytest.raises(RequestError) as failed:
                await anext(failing)
            assert failed.value.status == 504
            second = await anext(healthy)
            third = await anext(healthy)
            assert (second.token_ids, third.token_ids) == ([2], [3])
            assert client.num_in_flight == 1
            await healthy.aclose()  # a client that leaves aborts its request
            assert client.num_in_flight == 0
        finally:
            workers.close()
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
