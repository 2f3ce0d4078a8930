"""The OpenAI-compatible server end to end: a real `zllm serve` (every process) on a tiny
random model, driven by the official `openai` client and by raw HTTP with httpx."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import openai
import pytest
from servers import (
    asse_lines,
    error_of,
    metric,
    sse_events,
    sse_lines,
    start_server,
    stop_server,
    wait_until,
)

from zllm import LLM, SamplingParams

pytestmark = pytest.mark.e2e

MODEL = "tiny"
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Two workers of each kind, so requests cross between them; the model under its own name.
SERVE_ARGS = ("--tokenizer-workers", "2", "--detokenizer-workers", "2")
SERVE_ARGS += ("--served-model-name", MODEL, "--enable-log-requests")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
WORDS = ["Emoji", "CJK", "你好", "世界", "🙂", "café", "naïve", "Ångström"]
WORDS += ["The quick", "Paged", "def add", "1234", "brown fox", "lazy dog", "values in", "blocks"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(tiny_llama_dir, log, *SERVE_ARGS, api_key=API_KEY)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


# ---- basics --------------------------------------------------------------------------------


def test_health_models_version_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    import zllm

    assert httpx.get(server.url + "/version").json() == {"version": zllm.__version__}
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert metric(text, name) >= 0
    assert 0.0 <= metric(text, "vllm:kv_cache_usage_perc") <= 1.0
    assert f'model_name="{MODEL}"' in text


def test_tokenize_and_detokenize(server, offline):
    tok = offline.get_tokenizer()
    r = server.post("/tokenize", {"model": MODEL, "prompt": "The quick brown fox"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode("The quick brown fox")
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512
    r = server.post("/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert r.json() == {"prompt": "The quick brown fox"}
    messages = [{"role": "user", "content": "hi"}]
    r = server.post("/tokenize", {"messages": messages})
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    r = server.post("/detokenize", {"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# ---- generation ----------------------------------------------------------------------------


def test_completion_plain_and_streamed(server, client, offline):
    prompt = "The quick brown fox"
    expected = offline.generate(prompt, GREEDY, use_tqdm=False)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert r.id.startswith("cmpl-") and len(r.id) == len("cmpl-") + 32
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == expected.outputs[0].text
    assert r.choices[0].finish_reason == expected.outputs[0].finish_reason
    n_out = len(expected.outputs[0].token_ids)
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == n_out
    assert r.usage.total_tokens == r.usage.prompt_tokens + n_out

    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_out
    text = "".join(c.choices[0].text for c in chunks[:-1])
    assert text == expected.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == expected.outputs[0].finish_reason
    assert all(c.id == chunks[0].id for c in chunks)


def test_chat_plain_and_streamed(server, client, offline):
    messages = [{"role": "user", "content": "Name three planets."}]
    expected = offline.chat(messages, GREEDY, use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)

    # max_completion_tokens is the newer name of max_tokens.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == expected.outputs[0].finish_reason


def test_n_samples_and_several_prompts(server, client):
    prompts = ["The quick brown fox", "Paged attention"]
    kw = dict(model=MODEL, max_tokens=8, temperature=1.0, seed=7, n=3)
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    for i, p in enumerate(prompts):  # choice prompt_i * n + j is sample j of prompt i
        alone = client.completions.create(prompt=p, **kw)
        assert [c.text for c in r.choices[3 * i : 3 * i + 3]] == [c.text for c in alone.choices]
    assert len({c.text for c in r.choices[:3]}) > 1  # samples differ
    assert r.usage.completion_tokens == 6 * 8

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=1.0,
        seed=3,
        n=2,
        stream=True,
    )
    texts, finished = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finished[c.index] = c.finish_reason or finished[c.index]
    assert finished == ["length", "length"]


def _stop_case(offline) -> tuple[str, str, str]:
    """A prompt, its greedy output, and a stop string that spans a token boundary."""
    tok = offline.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [f"{a} {b}" for a in WORDS[:8] for b in WORDS[8:]]
    for prompt, out in zip(prompts, offline.generate(prompts, params, use_tqdm=False), strict=True):
        full, ids = out.outputs[0].text, out.outputs[0].token_ids
        for k in range(2, len(ids) - 2):
            prefix = tok.decode(ids[:k])
            b = len(prefix)
            stop = full[b - 2 : b + 2]
            if (
                full.startswith(prefix)
                and len(stop) == 4
                and stop.isprintable()
                and "\ufffd" not in full[: b + 2]
                and len(tok.decode(ids[k : k + 1])) >= 2
                and full.find(stop) == b - 2
            ):
                return prompt, full, stop
    raise AssertionError("no stop string across a token boundary in these outputs")


def test_stop_string_split_across_tokens(server, client, offline):
    prompt, full, stop = _stop_case(offline)
    expected = full[: full.index(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    body = {"ignore_eos": True}
    r = client.completions.create(extra_body=body, **kw)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, extra_body=body, **kw))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def _multibyte_case(offline) -> tuple[str, int, str]:
    """A prompt and a greedy length whose output is clean UTF-8 with a multi-byte character,
    preferably one split across tokens (a token alone decodes to U+FFFD)."""
    tok = offline.get_tokenizer()
    prompts = [f"{a} {b}" for a in WORDS for b in WORDS]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    cases = []
    for prompt, out in zip(prompts, offline.generate(prompts, params, use_tqdm=False), strict=True):
        ids = out.outputs[0].token_ids
        for k in range(len(ids), 0, -1):
            text = tok.decode(ids[:k])
            if "\ufffd" in text:
                continue
            if any(len(ch.encode()) > 1 for ch in text):
                split = any("\ufffd" in tok.decode([t]) for t in ids[:k])
                cases.append((not split, prompt, k))
            break
    assert cases, "no clean multi-byte output among the candidates"
    _, prompt, k = min(cases)
    params = SamplingParams(temperature=0.0, max_tokens=k)
    expected = offline.generate(prompt, params, use_tqdm=False)
    return prompt, k, expected[0].outputs[0].text


def test_multibyte_output_streams_byte_exact(server, client, offline):
    prompt, k, expected = _multibyte_case(offline)
    assert "\ufffd" not in expected and any(ord(c) > 127 for c in expected)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": k, "temperature": 0}
    r = server.post("/v1/completions", body)
    plain = r.json()["choices"][0]["text"]
    assert plain == expected
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH
    ) as r:
        raw = b"".join(r.iter_bytes())
    raw.decode("utf-8")  # valid UTF-8 on the wire
    deltas = [e["choices"][0]["text"] for e in sse_events(sse_lines([raw.decode()]))]
    assert all("\ufffd" not in d for d in deltas)  # no half character ever sent
    assert "".join(deltas) == plain


def test_logprobs(server, client):
    r = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 3 <= len(top) <= 4
        assert chosen >= max(top.values()) - 1e-4  # greedy picks the most likely token

    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.bytes and all(0 <= b < 256 for b in entry.bytes)
        assert entry.logprob >= entry.top_logprobs[0].logprob - 1e-4


def test_echo(server, client):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    r_echo = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    assert r_echo.choices[0].text == prompt + r.choices[0].text
    lp = r_echo.choices[0].logprobs
    n_prompt = r_echo.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    # Scoring a prompt: echo with max_tokens=0 gives the prompt and its logprobs only.
    r0 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert r0.choices[0].text == prompt
    assert r0.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n_prompt])
    assert r0.usage.completion_tokens == 0


def test_usage_reports_cached_prompt_tokens(server, client):
    rng = random.Random(1234)
    prompt = [rng.randrange(3, 400) for _ in range(200)]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 200
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 160 <= cached < 200 and cached % 16 == 0
    assert second.choices[0].text == first.choices[0].text


def test_64_concurrent_streams_equal_offline(server, offline):
    prompts = [f"{a} {b}" for a in WORDS[:8] for b in WORDS[8:]]
    assert len(prompts) == 64
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def all_streams() -> list[str]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120)
        finally:
            await aclient.close()

    texts = asyncio.run(all_streams())
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == offline.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text


# ---- request ids -----------------------------------------------------------------------------


def test_x_request_id_names_the_response_and_the_same_one_twice_both_run(server):
    """vLLM's X-Request-Id: the response id is `cmpl-<id>` (`chatcmpl-<id>`), the header comes
    back, and the request log line names it. Ids are free-form ('#' included, which the core
    uses to name forked samples), and two requests sent with the same one at once both run."""
    rid = "job#7"
    headers = {**AUTH, "X-Request-Id": rid}
    body = {"prompt": "The quick", "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 3}
    body["ignore_eos"] = True

    async def twice():
        async with httpx.AsyncClient(headers=headers, timeout=60) as c:
            url = server.url + "/v1/completions"
            plain = c.post(url, json=body)

            async def streamed():
                async with c.stream("POST", url, json={**body, "stream": True}) as r:
                    lines = [line async for line in asse_lines(r.aiter_text())]
                return r.headers, sse_events(lines)

            return await asyncio.wait_for(asyncio.gather(plain, streamed()), 60)

    r, (stream_headers, events) = asyncio.run(twice())
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    out = r.json()
    assert out["id"] == f"cmpl-{rid}"
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 3 * 12
    assert stream_headers["x-request-id"] == rid
    assert {e["id"] for e in events} == {f"cmpl-{rid}"}
    finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]

    messages = [{"role": "user", "content": "hi"}]
    chat = server.post(
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 4},
        headers={**AUTH, "X-Request-Id": "chat-1"},
    )
    assert chat.json()["id"] == "chatcmpl-chat-1"
    # Without the header: a fresh id per request.
    a, b = (server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}) for _ in range(2))
    assert a.json()["id"] != b.json()["id"]
    assert wait_until(lambda: server.log_text().count(f"request finished: id=cmpl-{rid}-") == 2, 5)


def test_only_the_executor_loads_torch(server):
    """The frontend, tokenizer, core and detokenizer processes start fast and stay lean: no
    torch library is mapped into any of them (the executor's maps show the check works)."""

    def loads_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()

    children = server.children()
    assert set(children) == {
        "frontend",
        "core",
        "executor",
        "tokenizer 0",
        "tokenizer 1",
        "detokenizer 0",
        "detokenizer 1",
    }
    assert loads_torch(children.pop("executor"))
    assert [name for name, pid in children.items() if loads_torch(pid)] == []


# ---- errors --------------------------------------------------------------------------------


def test_bad_requests_get_openai_errors(server):
    error_of(server.post("/v1/completions", b'{"prompt": "hi",'), 400)
    error_of(server.post("/v1/chat/completions", b"[1, 2]"), 400)
    e = error_of(server.post("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}), 400)
    assert e["param"] == "max_tokens"
    e = error_of(server.post("/v1/chat/completions", {"messages": "hi"}), 400)
    assert e["param"] == "messages"
    e = error_of(server.post("/v1/completions", {"model": "gpt-4", "prompt": "hi"}), 404)
    assert e["code"] == "model_not_found"
    for field, value in [("temperature", -1), ("top_p", 0), ("n", 0), ("max_tokens", 0)]:
        e = error_of(server.post("/v1/completions", {"prompt": "hi", field: value}), 400)
        assert e["param"] == field, e
    messages = [{"role": "user", "content": "hi"}]
    e = error_of(server.post("/v1/chat/completions", {"messages": messages, "top_k": -5}), 400)
    assert e["param"] == "top_k"
    e = error_of(server.post("/v1/chat/completions", {"messages": []}), 400)
    assert e["param"] == "messages"
    long_prompt = "hello " * 600
    for stream in (False, True):
        body = {"prompt": long_prompt, "stream": stream}
        e = error_of(server.post("/v1/completions", body), 400)
        assert e["message"].startswith("This model's maximum context length is")
    # Unknown fields are ignored (and logged), as vLLM does.
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "no_such_field": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    e = error_of(httpx.get(server.url + "/no/such/route"), 404)
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_api_key(server):
    body = {"prompt": "hi", "max_tokens": 1}
    assert error_of(server.post("/v1/completions", body, headers={}), 401)
    assert error_of(httpx.get(server.url + "/v1/models"), 401)
    wrong = {"Authorization": "Bearer wrong"}
    assert error_of(server.post("/v1/completions", body, headers=wrong), 401)
    assert server.post("/v1/completions", body, headers={"x-api-key": API_KEY}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200


# ---- disconnects and shutdown --------------------------------------------------------------


def test_disconnected_streams_are_aborted(server):
    """50 clients leave mid-stream: their requests stop and every KV block comes back."""
    n, max_tokens = 50, 400

    async def open_and_leave(c: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Paged attention {i}", "max_tokens": max_tokens, "stream": True}
        body["ignore_eos"] = True
        async with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = asse_lines(r.aiter_text())
            seen = 0
            while seen < 2:
                seen += (await lines.__anext__()).startswith("data: ")
        # leaving the block closes the connection mid-stream

    async def run() -> None:
        limits = httpx.Limits(max_connections=n + 10)
        async with httpx.AsyncClient(headers=AUTH, timeout=60, limits=limits) as c:
            await asyncio.gather(*(open_and_leave(c, i) for i in range(n)))

    before = metric(httpx.get(server.url + "/metrics").text, "vllm:generation_tokens_total")
    asyncio.run(run())
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(server.url + "/metrics").text
        running = metric(text, "vllm:num_requests_running")
        usage = metric(text, "vllm:kv_cache_usage_perc")
        waiting = metric(text, "vllm:num_requests_waiting")
        # (idle as of a heartbeat from after the streams: one that counted their tokens)
        fresh = metric(text, "vllm:generation_tokens_total") > before
        if running == 0 and usage == 0 and waiting == 0 and fresh:
            break
        assert time.monotonic() < deadline, f"running={running} kv usage={usage}"
        time.sleep(0.2)
    generated = metric(text, "vllm:generation_tokens_total") - before
    assert generated < n * max_tokens / 2  # they were stopped, not run to the end
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_drains_in_flight_requests(tiny_llama_dir, tmp_path):
    """SIGTERM: a running stream finishes normally, then every process exits, status 0."""
    srv = start_server(
        tiny_llama_dir, tmp_path / "server.log", *SERVE_ARGS, "--drain-timeout", "20"
    )
    try:
        body = {"prompt": "Paged", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = sse_lines(r.iter_text())
            first = next(line for line in lines if line.startswith("data: "))
            srv.proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for e in events if e["choices"][0]["text"]) > 1
        assert srv.proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health")
        assert "killing it" not in srv.log_tail()
    finally:
        stop_server(srv)
