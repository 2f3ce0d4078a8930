"""Prefill/decode disaggregation through servers with the openai client: a prefill and a decode
server behind `zllm proxy` answer as one server does, streamed and not, with the prompt's
blocks loaded from the transfer; a lost transfer is recomputed; errors, cancellation and a
prefill server that is down pass through; tensor-parallel pairs send each rank's heads; a
restarted decode server removes what its last life left. The pieces (config, the core's part,
the executor's bytes): tests/processes/test_disaggregation.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from disagg_pairs import (
    PROMPTS,
    Proxy,
    assert_pair_answers_as_one_server,
    free_port_range,
    kv_config,
    remote_hits,
    served_pair,
)
from served_answers import greedy
from servers import free_port, metric, start_server, stop_server, wait_until

from zllm.executor.kv.transfer import SHM_DIR


def chat(base_url: str, content: str) -> str:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=16, temperature=0
    )
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def disagg(tiny_llama_dir, tmp_path_factory):
    """A plain server (the reference), a decode server (kv_consumer), a prefill server
    (kv_producer) sending to it over tcp, and the proxy in front of the pair. All three
    serve two LoRA adapters, the decode server under other ids than the others."""
    from lora_adapters import ADAPTERS, make_adapter

    logs = tmp_path_factory.mktemp("disagg")
    a, b = (
        make_adapter(tiny_llama_dir, logs / name, seed=seed, **ADAPTERS[config])
        for name, seed, config in (("a", 1, "all"), ("b", 2, "mlp"))
    )
    ids_1_2 = ("--enable-lora", "--lora-modules", f"a={a}", f"b={b}")
    ids_2_1 = ("--enable-lora", "--lora-modules", f"b={b}", f"a={a}")
    port = free_port()
    servers = {}
    try:  # a server that fails to start must not leave the ones before it running
        servers["plain"] = start_server(tiny_llama_dir, logs / "plain.log", *ids_1_2)
        servers["decode"] = start_server(
            tiny_llama_dir,
            logs / "decode.log",
            "--kv-transfer-config",
            kv_config("kv_consumer", port, wait_timeout_s=30),
            *ids_2_1,
        )
        servers["prefill"] = start_server(
            tiny_llama_dir,
            logs / "prefill.log",
            "--kv-transfer-config",
            kv_config("kv_producer", port),
            *ids_1_2,
        )
        proxy = Proxy(servers["prefill"].url, servers["decode"].url, logs / "proxy.log")
    except BaseException:
        for server in servers.values():
            stop_server(server)
        raise
    yield servers, proxy
    proxy.stop()
    for server in servers.values():
        assert stop_server(server) == 0


@pytest.mark.e2e
def test_the_pair_behind_the_proxy_answers_as_one_server(disagg):
    """Greedy completions (plain and streamed) and a chat equal one server's, and the decode
    server took each prompt's blocks from the transfer (its remote hits grow by them)."""
    servers, proxy = disagg
    decode = servers["decode"]
    reference = greedy(servers["plain"].url, PROMPTS)
    prefill = servers["prefill"]
    hits = remote_hits(decode)
    assert greedy(proxy.url, PROMPTS) == reference
    assert wait_until(lambda: remote_hits(decode) > hits, 30), decode.log_tail()
    assert greedy(proxy.url, PROMPTS[:1], stream=True) == reference[:1]
    assert chat(proxy.url, "Tell me about paged attention.") == chat(
        servers["plain"].url, "Tell me about paged attention."
    )
    assert metric(decode.get("/metrics").text, "zllm:kv_transfer_wait_timeouts_total") == 0

    # (Counters come with the core's heartbeat, every 0.5 s: a moment behind the requests.)
    def sent() -> float:
        return metric(prefill.get("/metrics").text, "zllm:kv_transfer_sent_blocks_total")

    assert wait_until(lambda: sent() > 0, 30), prefill.log_tail()


@pytest.mark.e2e
def test_an_adapters_blocks_travel_between_servers_that_number_it_apart(disagg):
    """Adapter `a` is id 1 on the prefill server and id 2 on the decode server: its blocks
    are salted by its files' digest, so the decode server takes them from the transfer and
    answers as one server with the adapter does (which differs from the base model)."""
    servers, proxy = disagg
    decode = servers["decode"]

    def complete(base_url: str, model: str, prompt: str) -> str:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        return r.choices[0].text

    prompt = "An adapter's prompt, long enough to fill a few blocks of sixteen tokens each."
    reference = complete(servers["plain"].url, "a", prompt)
    assert reference != complete(servers["plain"].url, model_of(servers["plain"].url), prompt)
    hits = remote_hits(decode)
    assert complete(proxy.url, "a", prompt) == reference
    assert wait_until(lambda: remote_hits(decode) > hits, 30), decode.log_tail()
    assert complete(proxy.url, "b", prompt) == complete(servers["plain"].url, "b", prompt)


def model_of(base_url: str) -> str:
    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def message(base_url: str, content: str, stream: bool = False) -> str:
    """Anthropic's Messages API through its own client."""
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=model_of(base_url), max_tokens=12, extra_body={"temperature": 0.0})
    kw["messages"] = [{"role": "user", "content": content}]  # (create takes no temperature)
    if stream:
        with client.messages.stream(**kw) as events:
            return events.get_final_text()
    return client.messages.create(**kw).content[0].text


def response(base_url: str, content: str, stream: bool = False) -> str:
    """OpenAI's Responses API."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=model_of(base_url), input=content, max_output_tokens=12, temperature=0.0)
    if stream:
        events = client.responses.create(**kw, stream=True)
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return client.responses.create(**kw).output_text


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_and_responses_go_through_both_servers(disagg, stream):
    """Anthropic's /v1/messages and OpenAI's /v1/responses through the proxy answer as one
    server does, and the decode server takes each prompt's blocks from the transfer (the
    prompts are new to both servers, so a prefix hit can only come from there)."""
    servers, proxy = disagg
    decode = servers["decode"]
    for ask in (message, response):
        content = f"{ask.__name__} {stream}: " + "Blocks of keys and values travel. " * 8
        before = remote_hits(decode)
        assert ask(proxy.url, content, stream) == ask(servers["plain"].url, content, stream)
        assert wait_until(lambda: remote_hits(decode) > before, 30), (ask, decode.log_tail())  # noqa: B023


@pytest.mark.e2e
def test_errors_and_cancellation_pass_through_the_proxy(disagg):
    servers, proxy = disagg
    bad = {"prompt": "hi", "max_tokens": -1}
    direct = servers["plain"].post("/v1/completions", bad)
    through = httpx.post(proxy.url + "/v1/completions", json=bad, timeout=30)
    assert through.status_code == direct.status_code == 400
    assert through.json()["error"]["param"] == direct.json()["error"]["param"]
    # A body that is no JSON object, and a field the proxy itself reads of the wrong type, on each
    # generation endpoint: the server's 400 (OpenAI's or Anthropic's shape), not the proxy's 500.
    model = model_of(proxy.url)
    user = [{"role": "user", "content": "hi"}]
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        ("/v1/messages", {"model": model, "messages": user, "max_tokens": 4}),
        ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 4}),
    ):
        # Not JSON, and JSON nested past what a parser recurses into.
        for content in (b"{not json", b"[" * 200_000):
            direct = httpx.post(servers["plain"].url + path, content=content, timeout=30)
            through = httpx.post(proxy.url + path, content=content, timeout=30)
            assert through.status_code == direct.status_code == 400, (path, content[:9])
        for params in ("x", 5, [True], [], 0, False, "", {"do_remote_decode": "yes"}):
            bad = {**body, "kv_transfer_params": params}
            direct = httpx.post(servers["plain"].url + path, json=bad, timeout=30)
            through = httpx.post(proxy.url + path, json=bad, timeout=30)
            assert through.status_code == direct.status_code == 400, (path, params)
            assert through.json()["error"]["message"] == direct.json()["error"]["message"]
    # A streamed request whose client leaves after its first event: the decode server
    # aborts it. Its executor is paused meanwhile (well under --executor-timeout), so the
    # request cannot simply have finished.
    decode = servers["decode"]
    executor = decode.children()["executor"]

    def aborted() -> float:
        text = decode.get("/metrics").text
        return metric(text, "vllm:request_success_total", 'finished_reason="abort"')

    before = aborted()

    async def leave_early() -> None:
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", proxy.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        os.kill(executor, signal.SIGSTOP)
                        break  # the first event, then gone

    try:
        asyncio.run(leave_early())
        assert wait_until(lambda: aborted() == before + 1, 10)
    finally:
        os.kill(executor, signal.SIGCONT)
    assert httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"]


@pytest.mark.e2e
def test_a_lost_transfer_is_recomputed(disagg, tiny_llama_dir, tmp_path):
    """A prefill server whose blocks go nowhere (its kv_port has no consumer): the decode
    server waits for them until its timeout, then computes the prompt: the same answer.
    While it waits, its core sleeps on its inputs instead of spinning (it used a core's
    worth of CPU for the whole wait)."""
    from zllm.bench.engine_stats import process_cpu_seconds

    servers, _ = disagg
    decode_port, lost_port = free_port(), free_port()
    decode = start_server(
        tiny_llama_dir, tmp_path / "decode.log", "--kv-transfer-config",
        kv_config("kv_consumer", decode_port, wait_timeout_s=2),
    )  # fmt: skip
    prefill = start_server(
        tiny_llama_dir, tmp_path / "prefill.log", "--kv-transfer-config",
        kv_config("kv_producer", lost_port),
    )  # fmt: skip
    proxy = Proxy(prefill.url, decode.url, tmp_path / "proxy.log")
    try:
        reference = greedy(servers["plain"].url, PROMPTS[:2])
        # The decode server's core alone: the other xdist worker's servers run beside it.
        decode_core = lambda: process_cpu_seconds(decode.proc.pid).get("core")  # noqa: E731
        core_cpu = decode_core()
        assert core_cpu is not None  # its core is the supervisor's child
        start = time.monotonic()
        assert greedy(proxy.url, PROMPTS[:2]) == reference
        waited = time.monotonic() - start
        assert waited >= 4  # two requests, each held for its 2 s
        assert decode_core() - core_cpu < 0.25 * waited
        assert wait_until(
            lambda: (
                metric(decode.get("/metrics").text, "zllm:kv_transfer_wait_timeouts_total") == 2
            ),
            5,
        )
        assert remote_hits(decode) == 0
    finally:
        proxy.stop()
        stop_server(prefill)
        stop_server(decode)


@pytest.mark.e2e
def test_tensor_parallel_pair_sends_each_ranks_heads(tiny_llama_dir, tmp_path):
    """Both servers with --tensor-parallel-size 2: producer rank r sends its KV heads of each
    prompt block to consumer rank r (kv_port + r). Through the proxy the greedy answers equal
    a plain server's (the producer's own, asked unmarked: the same cut of the model), and the
    consumer loaded every full prompt block from the transfer, held on both its ranks."""
    tp2 = ("--tensor-parallel-size", "2")
    with served_pair(tiny_llama_dir, tmp_path, free_port_range(2), *tp2) as pair:
        assert_pair_answers_as_one_server(*pair, PROMPTS[:2])


@pytest.mark.e2e
def test_shared_memory_transport_and_a_prefill_server_that_is_down(
    disagg, tiny_llama_dir, tmp_path
):
    """transport "shm": the same answers (as the module's plain server's), the blocks through
    /dev/shm files the decode server deletes. Then the prefill server stops: the proxy skips
    it and the decode server computes the prompt (still the same answer)."""
    plain = disagg[0]["plain"]
    port = free_port()
    decode = start_server(
        tiny_llama_dir, tmp_path / "decode.log", "--kv-transfer-config",
        kv_config("kv_consumer", port, transport="shm", wait_timeout_s=30),
    )  # fmt: skip
    prefill = start_server(
        tiny_llama_dir, tmp_path / "prefill.log", "--kv-transfer-config",
        kv_config("kv_producer", port, transport="shm"),
    )  # fmt: skip
    proxy = Proxy(prefill.url, decode.url, tmp_path / "proxy.log")
    shm_before = {n for n in os.listdir(SHM_DIR) if n.startswith("zllm-kv-")}
    try:
        reference = greedy(plain.url, PROMPTS)
        assert greedy(proxy.url, PROMPTS) == reference
        assert wait_until(lambda: remote_hits(decode) > 0, 30)
        leftover = {n for n in os.listdir(SHM_DIR) if n.startswith("zllm-kv-")} - shm_before
        assert not leftover
        assert stop_server(prefill) == 0
        assert greedy(proxy.url, PROMPTS[:1]) == reference[:1]
        assert "the decode server computes the prompt" in (tmp_path / "proxy.log").read_text()
    finally:
        proxy.stop()
        stop_server(prefill)
        stop_server(decode)


@pytest.mark.e2e
def test_a_restarted_decode_server_removes_the_files_its_last_life_left_unread(
    tiny_llama_dir, tmp_path
):
    """transport shm: with the decode server's executor paused, the prefill server's blocks
    of two prompts wait in /dev/shm files. Killed, the decode server leaves them there (their
    producer lives on, so no orphan sweep takes them); started again on the same kv_port,
    it removes them before it reads any, and the pair serves as before."""
    import re

    port = free_port()
    consumer = kv_config("kv_consumer", port, transport="shm", wait_timeout_s=30)
    decode = start_server(tiny_llama_dir, tmp_path / "decode.log", "--kv-transfer-config", consumer)
    prefill = start_server(
        tiny_llama_dir, tmp_path / "prefill.log", "--kv-transfer-config",
        kv_config("kv_producer", port, transport="shm"),
    )  # fmt: skip
    servers = [decode, prefill]
    ours = re.compile(rf"zllm-kv-\d+-{port}-\d+")

    def transfer_files() -> set[str]:
        return {name for name in os.listdir(SHM_DIR) if ours.fullmatch(name)}

    try:
        executor = decode.children()["executor"]
        os.kill(executor, signal.SIGSTOP)
        for prompt in PROMPTS[:2]:
            marked = {"prompt": prompt, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
            assert prefill.post("/v1/completions", marked).status_code == 200
        assert wait_until(lambda: len(transfer_files()) == 2, 10), prefill.log_tail()
        decode.kill()
        assert wait_until(lambda: not os.path.exists(f"/proc/{executor}"), 10)
        left = transfer_files()
        assert len(left) == 2  # the producer lives: nothing else removes them
        decode = start_server(
            tiny_llama_dir, tmp_path / "decode-again.log", "--kv-transfer-config", consumer
        )
        servers.append(decode)
        assert not transfer_files() & left
        proxy = Proxy(prefill.url, decode.url, tmp_path / "proxy.log")
        try:
            assert_pair_answers_as_one_server(prefill, decode, proxy, PROMPTS[2:])
        finally:
            proxy.stop()
        assert not transfer_files()
    finally:
        for server in servers:
            stop_server(server)
