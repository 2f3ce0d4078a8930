"""Soak: 2,000 requests at concurrency 64 against the real multi-process server on the tiny
random model: mixed prompt lengths (text, chat and token ids), max_tokens, streaming and
not, and 20% of them abandoned by the client mid-stream. Every request is bounded by a
timeout (a hang fails the test); every one that was not abandoned must equal its offline
greedy output; afterwards nothing runs, no KV block is held, no child restarted, and no
process's anonymous memory plus swap grew by more than the stated bound. The client sends a
request again only where a real one would: when the pooled connection it took was closed by
the server's keep-alive timeout just then (tests/servers.py StaleConnectionRetry; on a
loaded 2-core machine about one request in a few thousand)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx
import pytest
from servers import (
    StaleConnectionRetry,
    asse_lines,
    engine_idle,
    metric,
    sse_events,
    start_server,
    stop_server,
    wait_until,
)

from zllm import LLM, SamplingParams
from zllm.bench.process_memory import process_memory
from zllm.runtime.heap_trim import IDLE_TRIM_S

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 2000
NUM_WARMUP = 500
CONCURRENCY = 64
CANCEL_SHARE = 0.2
REQUEST_TIMEOUT_S = 60.0
# Requests sent again after their kept-alive connection was closed under them: a race, so a
# few; a server that dropped requests on reused connections would need many more.
MAX_RETRIES = NUM_REQUESTS // 100
MAX_TOKENS = (1, 2, 4, 8, 16)
# Growth of anonymous memory plus swap allowed per process over the 2,000 requests (after a
# warm-up of 500), each measured once the server is idle and past the executor's idle heap
# trim (zllm/runtime/heap_trim.py): what a process allocated itself, which swap cannot hide
# and page-cache churn of the mapped weights does not move (zllm/bench/process_memory.py).
# 0.4 KB per request: a leak of 0.5 KB per request (1,000 KiB here) fails, as issue 56 asks.
# Measured on the 2-core CPU machine: core and executor +0.4 MiB, frontend +0.3 MiB, every
# other process +0.1 MiB or less. benchmarks/memory_soak.py measures the growth per request
# over 20,000 (BENCHMARKS.md: under 0.1 KB each).
MEMORY_GROWTH_BOUND_KIB = NUM_REQUESTS * 400 // 1024
WORDS = ["Emoji", "CJK", "你好", "世界", "🙂", "café", "naïve", "Ångström", "The quick"]
WORDS += ["Paged", "def add", "1234", "brown fox", "lazy dog", "values in", "blocks"]


@dataclass(frozen=True)
class Prompt:
    kind: str  # "text", "tokens" or "chat"
    text: str = ""
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Plan:
    prompt: Prompt
    max_tokens: int
    stream: bool
    cancel_after: int = 0  # abandon the stream after this many events (0: never)


def make_prompts(rng: random.Random) -> list[Prompt]:
    prompts = []
    for _ in range(40):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.choice((1, 3, 10, 40))))
        prompts.append(Prompt("text", text=text))
        prompts.append(Prompt("chat", text=text))
    for _ in range(120):
        length = rng.choice((1, 4, 16, 64, 200, 400))
        prompts.append(
            Prompt("tokens", token_ids=tuple(rng.randrange(3, 400) for _ in range(length)))
        )
    return prompts


def make_plans(rng: random.Random, prompts: list[Prompt], count: int) -> list[Plan]:
    plans = []
    for _ in range(count):
        prompt = rng.choice(prompts)
        if rng.random() < CANCEL_SHARE:
            plans.append(Plan(prompt, 64, True, cancel_after=rng.randint(1, 3)))
        else:
            plans.append(Plan(prompt, rng.choice(MAX_TOKENS), rng.random() < 0.5))
    return plans


def request_body(plan: Plan) -> tuple[str, dict]:
    body: dict = {"max_tokens": plan.max_tokens, "temperature": 0, "ignore_eos": True}
    body["stream"] = plan.stream
    p = plan.prompt
    if p.kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": p.text}]}
    prompt = p.text if p.kind == "text" else list(p.token_ids)
    return "/v1/completions", {**body, "prompt": prompt}


async def run_one(client: httpx.AsyncClient, url: str, plan: Plan) -> str | None:
    """The generated text, or None for a stream the client abandoned."""
    path, body = request_body(plan)
    chat = path.endswith("chat/completions")
    if not plan.stream:
        r = await client.post(url + path, json=body)
        assert r.status_code == 200, r.text[:500]
        payload = r.json()
        assert payload["usage"]["completion_tokens"] == plan.max_tokens
        choice = payload["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        if plan.cancel_after:
            seen = 0
            async for line in asse_lines(r.aiter_text()):
                seen += line.startswith("data: {")
                if seen >= plan.cancel_after:
                    return None  # leaving the block closes the connection mid-stream
            raise AssertionError("a stream to abandon ended first")
        events = sse_events([line async for line in asse_lines(r.aiter_text())])
    pieces = []
    for e in events:
        assert "error" not in e, e
        for c in e["choices"]:
            pieces.append((c["delta"].get("content") or "") if chat else c["text"])
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(pieces)


@dataclass(frozen=True)
class Run:
    texts: list[str | None]  # each plan's (None: abandoned)
    hung: int  # requests that did not end within REQUEST_TIMEOUT_S
    retries: int  # requests sent again on a fresh connection (StaleConnectionRetry)


async def run_all(url: str, plans: list[Plan]) -> Run:
    """Every plan at `CONCURRENCY` at a time."""
    results: list[str | None] = [None] * len(plans)
    hung = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(plans)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    transport = StaleConnectionRetry(limits=limits)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, transport=transport) as client:

        async def worker() -> None:
            nonlocal hung
            while not queue.empty():
                i = queue.get_nowait()
                try:
                    results[i] = await asyncio.wait_for(
                        run_one(client, url, plans[i]), REQUEST_TIMEOUT_S
                    )
                except asyncio.TimeoutError:
                    hung += 1

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return Run(results, hung, transport.retries)


def expected_texts(model_dir: str, plans: list[Plan]) -> dict[tuple[Prompt, int], str]:
    """Offline greedy outputs (one engine, run once) of every distinct finished request."""
    wanted = sorted(
        {(p.prompt, p.max_tokens) for p in plans if not p.cancel_after},
        key=lambda k: (k[0].kind, k[0].text, k[0].token_ids, k[1]),
    )
    llm = LLM(model_dir, kv_cache_memory_bytes=64 << 20)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in wanted]
    chat = [(i, k) for i, k in enumerate(wanted) if k[0].kind == "chat"]
    other = [(i, k) for i, k in enumerate(wanted) if k[0].kind != "chat"]
    texts: dict[tuple[Prompt, int], str] = {}
    inputs = [
        k[0].text if k[0].kind == "text" else {"prompt_token_ids": list(k[0].token_ids)}
        for _, k in other
    ]
    outs = llm.generate(inputs, [params[i] for i, _ in other], use_tqdm=False)
    for (_, key), out in zip(other, outs, strict=True):
        texts[key] = out.outputs[0].text
    conversations = [[{"role": "user", "content": k[0].text}] for _, k in chat]
    outs = llm.chat(conversations, [params[i] for i, _ in chat], use_tqdm=False)
    for (_, key), out in zip(chat, outs, strict=True):
        texts[key] = out.outputs[0].text
    return texts


def run_fast(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


@pytest.fixture(scope="module")
def soak_server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    server = start_server(
        tiny_llama_dir, log, "--tokenizer-workers", "2", "--detokenizer-workers", "2"
    )
    yield server
    stop_server(server)


def test_soak_2000_requests(soak_server, tiny_llama_dir):
    rng = random.Random(2024)
    prompts = make_prompts(rng)
    warmup = make_plans(rng, prompts, NUM_WARMUP)
    plans = make_plans(rng, prompts, NUM_REQUESTS)
    expected = expected_texts(tiny_llama_dir, warmup + plans)

    warm = run_fast(run_all(soak_server.url, warmup))
    assert warm.hung == 0
    children = soak_server.children()
    assert wait_until(lambda: _idle(soak_server), 15)
    time.sleep(IDLE_TRIM_S + 2.0)  # past the executor's idle trim (and the trim itself, under load)
    # The supervisor too: it lives as long as the server, and a leak there would too.
    watched = {"supervisor": soak_server.proc.pid, **children}
    before = {name: process_memory(pid).total_kib for name, pid in watched.items()}

    start = time.monotonic()
    run = run_fast(run_all(soak_server.url, plans))
    duration = time.monotonic() - start
    assert run.hung == 0, f"{run.hung} requests hung"
    assert run.retries <= MAX_RETRIES, f"{run.retries} requests lost their connection"

    mismatches = [
        (plan, text)
        for plan, text in zip(plans, run.texts, strict=True)
        if not plan.cancel_after and text != expected[(plan.prompt, plan.max_tokens)]
    ]
    assert not mismatches, f"{len(mismatches)} outputs differ from offline, e.g. {mismatches[0]}"
    assert wait_until(lambda: _idle(soak_server), 15), soak_server.get("/metrics").text[-3000:]
    assert soak_server.children() == children, "a child restarted during the soak"
    time.sleep(IDLE_TRIM_S + 2.0)
    after = {name: process_memory(pid).total_kib for name, pid in watched.items()}

    cancelled = sum(1 for p in plans if p.cancel_after)
    streamed = sum(1 for p in plans if p.stream)
    print(
        f"\nsoak: {NUM_REQUESTS} requests ({streamed} streamed, {cancelled} abandoned "
        f"mid-stream) at concurrency {CONCURRENCY} in {duration:.1f} s "
        f"({NUM_REQUESTS / duration:.0f} req/s); {run.retries} sent again after their "
        "kept-alive connection closed"
    )
    for name in sorted(watched):
        print(
            f"  {name:14} anon+swap {before[name] / 1024:7.1f} MiB -> {after[name] / 1024:7.1f} "
            f"MiB ({(after[name] - before[name]) / 1024:+.1f} MiB)"
        )
    for name in watched:
        growth = after[name] - before[name]
        assert growth < MEMORY_GROWTH_BOUND_KIB, f"{name} grew by {growth / 1024:.1f} MiB"


def _idle(server) -> bool:
    in_flight = metric(server.get("/metrics").text, "zllm:num_requests_in_flight")
    return engine_idle(server) and in_flight == 0
