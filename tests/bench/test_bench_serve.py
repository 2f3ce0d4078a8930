"""`zllm bench serve` against a fake OpenAI server with known timings.

This tests the measuring tool, not an engine: the server below streams SSE completion chunks
after a fixed time to first token and at a fixed gap, so the measured TTFT, ITL, TPOT, token
counts and throughputs must come out near those numbers.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import pytest

starlette = pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from zllm.bench.serve import (  # noqa: E402
    ServeBenchConfig,
    format_table,
    percentile,
    run_benchmark,
)

TTFT_S = 0.05
GAP_S = 0.01
FAIL_TOKEN = 1  # a prompt starting with this token gets an HTTP 500
HANG_TOKEN = 2  # ... with this one, a stream that stalls (for the timeout)
SILENT_TOKEN = 3  # ... with this one, tokens that decode to no text: only the closing chunk


class FakeServer:
    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/nousage/v1/completions", self.completions_no_usage, methods=["POST"]),
            ]
        )
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(self, request: Request):
        return await self._complete(request, usage=True)

    async def completions_no_usage(self, request: Request):
        return await self._complete(request, usage=False)

    async def _complete(self, request: Request, usage: bool):
        body = await request.json()
        self.bodies.append(body)
        prompt = body["prompt"]
        if prompt[0] == FAIL_TOKEN:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = body["max_tokens"]

        async def events():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(TTFT_S if prompt[0] != HANG_TOKEN else 30)
                for i in range(n if prompt[0] != SILENT_TOKEN else 0):
                    if i:
                        await asyncio.sleep(GAP_S)
                    chunk = {
                        "object": "text_completion",
                        "model": body["model"],
                        "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
                yield f"data: {json.dumps(final)}\n\n"
                if usage:
                    u = {"prompt_tokens": len(prompt), "completion_tokens": n}
                    yield f"data: {json.dumps({'choices': [], 'usage': u})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


def _prompts(n: int, length: int = 8, first: int = 300) -> list[list[int]]:
    return [[first + i] + [400 + j for j in range(length - 1)] for i in range(n)]


def _run(config: ServeBenchConfig, prompts):
    return asyncio.run(run_benchmark(config, prompts))


def test_timings_tokens_and_throughput(server):
    n, out_len = 8, 10
    config = ServeBenchConfig(
        base_url=server.base_url, num_prompts=n, input_len=8, output_len=out_len, concurrency=4
    )
    server.max_in_flight = 0
    s, results = _run(config, _prompts(n))

    assert s["model"] == "fake-model"  # taken from /v1/models
    body = server.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == out_len
    assert body["stream_options"] == {"include_usage": True}
    assert body["prompt"] in _prompts(n)  # token ids sent as they are

    assert s["completed"] == n and s["failed"] == 0 and s["short_outputs"] == 0
    assert s["usage_reported"] == n
    assert s["total_output_tokens"] == n * out_len
    assert s["total_input_tokens"] == n * 8
    assert server.max_in_flight == 4  # closed loop: exactly `concurrency` in flight
    for r in results:
        assert r.ok and r.output_tokens == out_len and r.num_chunks == out_len
        assert len(r.itl) == out_len - 1
        assert TTFT_S * 0.9 <= r.ttft < TTFT_S + 0.25
        assert r.e2e >= r.ttft + (out_len - 1) * GAP_S * 0.9

    # TTFT ~50 ms, ITL and TPOT ~10 ms (generous upper bounds for a busy CI machine).
    assert 0.9 * TTFT_S * 1000 <= s["ttft_ms"]["p50"] < (TTFT_S + 0.25) * 1000
    assert 0.8 * GAP_S * 1000 <= s["itl_ms"]["p50"] < 5 * GAP_S * 1000
    assert 0.8 * GAP_S * 1000 <= s["tpot_ms"]["mean"] < 5 * GAP_S * 1000
    # TPOT is (e2e - TTFT) / (tokens - 1) per request, as vLLM's bench defines it: the gaps
    # between token chunks plus the stream's tail (usage chunk, [DONE]), so never below them.
    tpots = [(r.e2e - r.ttft) / (out_len - 1) for r in results]
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * sum(tpots) / n, abs=1e-3)
    for r in results:
        assert sum(r.itl) <= r.e2e - r.ttft + 1e-9

    # Throughput math is consistent with the totals and the duration.
    d = s["duration_s"]
    assert s["request_throughput"] == pytest.approx(n / d, rel=1e-2)
    assert s["output_throughput"] == pytest.approx(n * out_len / d, rel=1e-2)
    assert s["total_token_throughput"] == pytest.approx(n * (out_len + 8) / d, rel=1e-2)
    # Two waves of 4 requests, each at least TTFT + 9 gaps long.
    one = TTFT_S + (out_len - 1) * GAP_S
    assert 2 * one * 0.9 <= d < 2 * one + 1.5
    assert "Output token throughput" in format_table(s)


def test_counts_chunks_without_usage_and_poisson_arrivals(server):
    n, out_len = 6, 5
    config = ServeBenchConfig(
        base_url=server.base_url,
        endpoint="/nousage/v1/completions",
        model="named",
        num_prompts=n,
        input_len=8,
        output_len=out_len,
        request_rate=200.0,
        num_warmups=0,
    )
    s, results = _run(config, _prompts(n))
    assert server.bodies[-1]["model"] == "named"
    assert s["completed"] == n and s["usage_reported"] == 0
    assert s["total_output_tokens"] == n * out_len  # counted from the token chunks
    starts = [r.start for r in results]
    assert starts == sorted(starts) and starts[-1] > 0  # paced arrivals, in order
    assert s["request_rate"] == 200.0


def test_errors_and_timeouts_are_counted(server):
    prompts = _prompts(3)
    prompts[1][0] = FAIL_TOKEN
    prompts[2][0] = HANG_TOKEN
    config = ServeBenchConfig(
        base_url=server.base_url,
        num_prompts=3,
        input_len=8,
        output_len=4,
        concurrency=3,
        request_timeout=0.5,
        num_warmups=0,
    )
    t = time.perf_counter()
    s, results = _run(config, prompts)
    assert time.perf_counter() - t < 3  # the stalled request was cut off
    assert s["completed"] == 1 and s["failed"] == 2
    assert results[0].ok
    assert "HTTP 500" in results[1].error
    assert "timeout" in results[2].error
    assert sum(s["errors"].values()) == 2
    assert s["total_output_tokens"] == 4  # only successful requests count


def test_percentile_matches_linear_interpolation():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 99) == pytest.approx(4.96)
    assert math.isnan(percentile([], 50))


def test_engine_cost_from_counters_and_process_cpu():
    from zllm.bench.engine_stats import engine_cost, parse_counters

    text = "\n".join(
        [
            "# HELP zllm:engine_steps_total Steps the executor finished.",
            'zllm:engine_steps_total{model_name="m"} 110.0',
            'zllm:executor_busy_seconds_total{model_name="m"} 9.0',
            'zllm:executor_idle_seconds_total{model_name="m"} 1.0',
            'zllm:executor_forward_seconds_total{model_name="m"} 8.0',
            'zllm:core_schedule_seconds_total{model_name="m"} 0.5',
            'vllm:num_requests_running{model_name="m"} 3.0',
        ]
    )
    after = parse_counters(text)
    assert after == {"steps": 110, "busy": 9, "idle": 1, "forward": 8, "schedule": 0.5}
    before = {"steps": 10.0, "busy": 1.0, "idle": 0.2, "forward": 0.5}
    cost = engine_cost(
        (before, {"core": 1.0, "executor": 5.0}),
        (after, {"core": 1.5, "executor": 15.0, "frontend": 0.5}),
        output_tokens=1000,
    )
    assert cost["steps"] == 100
    assert cost["per_step_ms"]["busy"] == pytest.approx(80.0)
    assert cost["per_step_ms"]["forward"] == pytest.approx(75.0)
    assert cost["executor_idle_share"] == pytest.approx(0.8 / 8.8, abs=1e-4)
    cpu = cost["cpu_ms_per_output_token"]
    assert cpu["executor"] == pytest.approx(10.0) and cpu["core"] == pytest.approx(0.5)
    assert cpu["all_but_executor"] == pytest.approx(1.0)
    assert engine_cost(({}, {}), ({}, {}), 10) is None  # another engine: nothing to report
    # Per-process snapshots (zllm bench serve's): a tokenizer that ended between them (another
    # server's on the same machine) subtracts nothing, one that started adds nothing.
    cost = engine_cost(
        ({}, {"tokenizer:10": 4.0, "tokenizer:11": 1.0, "core:12": 2.0}),
        ({}, {"tokenizer:11": 1.5, "tokenizer:13": 9.0, "core:12": 2.25}),
        output_tokens=100,
    )
    assert cost["cpu_ms_per_output_token"] == {
        "tokenizer": 5.0, "core": 2.5, "all_but_executor": 7.5
    }  # fmt: skip


def test_pipeline_stage_idle_shares_from_counters():
    from zllm.bench.engine_stats import engine_cost, parse_counters

    text = "\n".join(
        [
            'zllm:engine_steps_total{engine="0",model_name="m"} 20.0',
            'zllm:pipeline_stage_busy_seconds_total{engine="0",model_name="m",stage="0"} 3.0',
            'zllm:pipeline_stage_busy_seconds_total{engine="0",model_name="m",stage="1"} 4.0',
            'zllm:pipeline_stage_idle_seconds_total{engine="0",model_name="m",stage="0"} 2.0',
            'zllm:pipeline_stage_idle_seconds_total{engine="0",model_name="m",stage="1"} 1.5',
        ]
    )
    after = parse_counters(text)
    assert after["stage_busy:1"] == 4.0 and after["stage_idle:0"] == 2.0
    before = {"steps": 10.0, "stage_busy:0": 1.0, "stage_idle:0": 1.0, "stage_busy:1": 1.0}
    cost = engine_cost((before, {}), (after, {}), output_tokens=100)
    assert cost["pipeline_stage_idle_share"] == [0.3333, 0.3333]  # 1 / (2 + 1), 1.5 / (3 + 1.5)


@pytest.mark.e2e
def test_engine_split_reported_against_a_real_zllm_server(tiny_llama_dir, tmp_path):
    from servers import start_server, stop_server

    from zllm.model.arch import read_arch_config

    server = start_server(tiny_llama_dir, tmp_path / "serve.log")
    try:
        config = ServeBenchConfig(
            base_url=server.url,
            num_prompts=8,
            input_len=16,
            output_len=12,
            concurrency=4,
            vocab_size=read_arch_config(tiny_llama_dir).vocab_size,
        )
        s, _ = _run(config, None)
    finally:
        stop_server(server)
    assert s["completed"] == 8 and s["total_output_tokens"] == 8 * 12
    engine = s["engine"]
    assert engine["steps"] >= 12  # at least one step per output token of a request
    step = engine["per_step_ms"]
    assert step["busy"] > 0 and step["forward"] > 0
    assert step["prepare"] + step["forward"] + step["sample"] <= step["busy"] + 1e-3
    assert 0 <= engine["executor_idle_share"] < 1
    cpu = engine["cpu_ms_per_output_token"]
    for role in ("frontend", "tokenizer", "core", "executor", "detokenizer"):
        assert cpu[role] >= 0, role
    assert cpu["executor"] > 0
    assert "Executor idle share" in format_table(s)


def test_a_stream_of_tokens_without_text_is_completed(server):
    """Tokens that decode to nothing (special tokens skipped, say): zllm streams no chunk for
    them, only the closing one (empty text, finish_reason) and usage. The request completed."""
    n, out_len = 2, 6
    config = ServeBenchConfig(
        base_url=server.base_url, num_prompts=n, input_len=8, output_len=out_len, num_warmups=0
    )
    prompts = [[SILENT_TOKEN] + [400] * 7, [300] + [400] * 7]
    s, results = _run(config, prompts)
    assert s["completed"] == n and s["failed"] == 0 and s["errors"] == {}
    silent, normal = results
    assert silent.ok and silent.output_tokens == out_len and silent.usage_reported
    assert silent.num_chunks == 1 and silent.itl == [] and 0 < silent.ttft <= silent.e2e
    # A closing empty chunk after token chunks still adds nothing.
    assert normal.ok and normal.num_chunks == out_len
