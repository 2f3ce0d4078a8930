"""The multi-process engine (supervisor, tokenizers, core, executor, detokenizers) end to end,
through the same EngineClient the HTTP frontend uses, on a tiny random model."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from zllm import LLM, SamplingParams
from zllm.async_llm import AsyncLLM
from zllm.errors import RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    loop = asyncio.new_event_loop()
    llm = loop.run_until_complete(
        AsyncLLM.start(tiny_llama_dir, tokenizer_workers=2, detokenizer_workers=2)
    )
    yield loop, llm
    loop.run_until_complete(llm.shutdown())
    loop.close()


def run(engine, coro, timeout=60):
    loop, _ = engine
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


async def collect(llm: AsyncLLM, prompt, params=GREEDY, request_id=None):
    """All deltas of one request, per sample: (token ids, text, finish reason)."""
    n = params.n
    tokens: list[list[int]] = [[] for _ in range(n)]
    texts = [""] * n
    reasons: list[str | None] = [None] * n
    async for d in llm.generate(prompt, params, request_id=request_id):
        tokens[d.index] += d.token_ids
        texts[d.index] += d.text
        if d.finish_reason:
            reasons[d.index] = d.finish_reason
    return tokens, texts, reasons


def random_prompts(count: int, seed: int, vocab: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))] for _ in range(count)]


def test_64_concurrent_requests_equal_offline_outputs(engine, offline):
    _, llm = engine
    prompts = random_prompts(64, seed=1)

    async def all_requests():
        return await asyncio.gather(*(collect(llm, p) for p in prompts))

    results = run(engine, all_requests())
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for (tokens, texts, reasons), exp in zip(results, expected, strict=True):
        assert tokens[0] == exp.outputs[0].token_ids
        assert texts[0] == exp.outputs[0].text  # streamed deltas add up to the same text
        assert reasons[0] == "length"


def test_text_chat_and_n_samples(engine, offline):
    _, llm = engine
    tokens, texts, _ = run(engine, collect(llm, "The quick brown fox"))
    exp = offline.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0]
    assert tokens[0] == exp.token_ids and texts[0] == exp.text
    messages = [{"role": "user", "content": "Hello"}]
    tokens, _, _ = run(engine, collect(llm, messages))
    assert tokens[0] == offline.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    tokens, _, reasons = run(engine, collect(llm, [7, 8, 9], params))
    exp = offline.generate({"prompt_token_ids": [7, 8, 9]}, params, use_tqdm=False)[0]
    assert tokens == [o.token_ids for o in exp.outputs]
    assert reasons == ["length"] * 3


def test_request_ids_with_hashes_and_n_samples_finish(engine, offline):
    """Ids are free-form: '#' in them (the core names forked samples `<id>#<i>`) must not
    confuse forking, and a client id equal to another request's sample id must not collide."""
    _, llm = engine
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    expected = offline.generate({"prompt_token_ids": [7, 8, 9]}, params, use_tqdm=False)[0]

    async def both():
        return await asyncio.gather(
            collect(llm, [7, 8, 9], params, request_id="job#1"),
            collect(llm, [7, 8, 9], params, request_id="job"),  # forks into "job#1", ...
            collect(llm, [7, 8, 9], params, request_id="a#b#c"),
        )

    for tokens, _, reasons in run(engine, both()):
        assert tokens == [o.token_ids for o in expected.outputs]
        assert reasons == ["length"] * 3


def test_stop_string_split_across_tokens(engine, offline):
    _, llm = engine
    prompt = [11, 12, 13, 14]
    full = offline.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0]
    tok = offline.get_tokenizer()
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # A stop string that starts inside one token's text and ends inside a later one's.
    boundary = len(pieces[2])
    stop = full.text[boundary - 1 : boundary + 2]
    assert len(stop) == 3 and full.text.index(stop) == boundary - 1
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], ignore_eos=True)
    _, texts, reasons = run(engine, collect(llm, prompt, params))
    assert texts[0] == full.text[: boundary - 1]
    assert reasons == ["stop"]


def test_bad_request_gets_an_error_and_others_are_served(engine):
    _, llm = engine
    too_long = SamplingParams(max_tokens=10)
    with pytest.raises(RequestError, match="maximum context length") as err:
        run(engine, collect(llm, [5] * 600, too_long))
    assert err.value.status == 400
    with pytest.raises(RequestError, match="out of vocabulary"):
        run(engine, collect(llm, [10**6]))
    tokens, _, _ = run(engine, collect(llm, [5, 6, 7]))
    assert len(tokens[0]) == 16


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_abandoned_streams_free_their_blocks(engine):
    """50 streams left after their first delta: the core aborts them and frees their blocks.
    Read from a heartbeat the core sent after the last stream was left (an older one, from
    before the streams, is idle too), whose counts show the requests were cut short (had
    they all run their 400 tokens, they would have freed their blocks anyway)."""
    _, llm = engine
    loop = engine[0]
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    assert loop.run_until_complete(_poll(lambda: llm.client.stats is not None, 10.0))
    generated_before = llm.client.stats.tokens.generated

    async def abandon(i):
        async for _ in llm.generate([20 + i, 21, 22], params):
            break  # the client goes away after its first delta: the request is aborted

    async def all_streams():
        await asyncio.gather(*(abandon(i) for i in range(50)))

    run(engine, all_streams())
    left_at = time.time()

    def idle_since_left():
        stats = llm.client.stats
        return (
            stats.status.time > left_at
            and stats.load.num_running == 0
            and stats.kv_pool.usage == 0.0
        )

    # Heartbeats come every 0.5 s from the core; give the aborts a moment to land.
    assert loop.run_until_complete(_poll(idle_since_left, 30.0)), llm.client.stats
    assert llm.client.num_in_flight == 0
    generated = llm.client.stats.tokens.generated - generated_before
    assert 50 <= generated < 50 * 400, generated  # each got a token; not all ran out


async def _poll(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


def test_process_titles(engine):
    _, llm = engine
    titles = set()
    for child in llm._supervisor.children:
        with open(f"/proc/{child.proc.pid}/cmdline", "rb") as f:
            titles.add(f.read().split(b"\0")[0].decode())
    assert titles == {
        "zllm: executor",
        "zllm: core",
        "zllm: tokenizer 0",
        "zllm: tokenizer 1",
        "zllm: detokenizer 0",
        "zllm: detokenizer 1",
    }


@pytest.mark.e2e
@pytest.mark.parametrize("role", ["tokenizer", "detokenizer", "core", "executor"])
def test_killed_worker_is_restarted_and_nothing_hangs(engine, role):
    _, llm = engine
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    prompts = random_prompts(24, seed=7)

    streaming = asyncio.Event()

    async def one(p):
        count = 0
        try:
            async for d in llm.generate(p, params):
                count += len(d.token_ids)
                if count >= 8:
                    streaming.set()
            return count
        except RequestError as e:  # only requests the dead worker was serving may fail
            assert e.status == 503
            return "error"

    async def under_load():
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        # Kill mid-generation: once tokens flow, with ~110 of 120 still to come. (A fixed
        # sleep raced with the tiny model, which can finish all 24 requests in 0.3 s.)
        await asyncio.wait_for(streaming.wait(), 60)
        victim = next(c for c in llm._supervisor.children if c.role == role and c.index == 0)
        os.kill(victim.proc.pid, signal.SIGKILL)
        return await asyncio.gather(*tasks), victim.proc.pid

    results, old_pid = run(engine, under_load(), timeout=120)
    # Each request completed or failed cleanly; none hung (the timeout above would fire).
    assert all(r == 120 or r == "error" for r in results)
    if role in ("core", "executor"):
        assert "error" in results  # a dead engine fails what it was running, with a 503
    else:
        assert 120 in results  # a dead worker costs at most the requests it was serving

    def replaced():
        return any(
            c.role == role and c.index == 0 and c.proc.pid != old_pid
            for c in list(llm._supervisor.children)
        )

    loop = engine[0]
    assert loop.run_until_complete(_poll(replaced, 30.0))
    assert loop.run_until_complete(_poll(lambda: llm.client.health()[0], 30.0))
    tokens, _, _ = run(engine, collect(llm, [5, 6, 7]))
    assert len(tokens[0]) == 16


@pytest.mark.e2e
def test_requests_held_by_a_dead_tokenizer_are_resent(engine, offline):
    """docs/correctness.md: "a tokenizer's lost requests are re-sent". Tokenizer 0 is
    stopped (SIGSTOP), so that of 8 requests the frontend pushes round-robin, those for it
    wait unread in its socket; once the others are answered it is killed while holding
    them. All 8 are then answered in full: its requests, which had produced nothing, were
    sent again. (The kill test above fires after tokenization, when nothing is left in a
    tokenizer.)"""
    loop, llm = engine
    victim = next(c for c in llm._supervisor.children if c.role == "tokenizer" and c.index == 0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts(8, seed=9)

    def only_held_left(tasks) -> bool:
        """Some requests answered, and every one still open neither started nor reached
        an engine: what is left sits in the stopped tokenizer."""
        streams = list(llm.client._streams.values())
        return (
            any(t.done() for t in tasks)
            and bool(streams)
            and all(not s.started and s.engine is None for s in streams)
        )

    async def scenario():
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            tasks = [asyncio.create_task(collect(llm, p, params)) for p in prompts]
            assert await _poll(lambda: only_held_left(tasks), 60), llm.client._streams
            held = sum(not t.done() for t in tasks)
        finally:
            os.kill(victim.proc.pid, signal.SIGKILL)
        return held, await asyncio.gather(*tasks)

    held, results = run(engine, scenario(), timeout=120)
    assert held > 0
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [tokens[0] for tokens, _, _ in results] == [o.outputs[0].token_ids for o in expected]
    assert loop.run_until_complete(_poll(lambda: llm.client.health()[0], 30.0))
