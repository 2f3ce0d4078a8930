"""Sleep mode (vLLM's `LLM.sleep(level)` / `wake_up(tags)`): level 1 releases the KV pool
(on CPU the weights stay where they are, in host memory), level 2 the weights too (the
process's resident memory falls by at least the pool plus 90% of the weights' bytes); waking
restores the parts named; after waking, outputs equal those before, and the prefix cache
starts empty. With tensor or pipeline ranks every rank sleeps (test_composition.py), with
data-parallel engines every engine (test_data_parallel.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from resident_memory import resident_bytes
from servers import metric, start_server, stop_server, wait_until

from zllm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=2, ignore_eos=True)


def texts(outs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outs]


def test_outputs_after_waking_equal_those_before(tiny_llama_dir) -> None:
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20, enable_sleep_mode=True)
    prompts = [
        "The quick brown fox jumps over the lazy dog, again and again, all day long.",
        "Paged attention stores keys and values in fixed-size blocks of the KV cache.",
    ]
    before = texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    sampled = texts(llm.generate(prompts, SAMPLED, use_tqdm=False))
    assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.sleep()
    assert llm.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.wake_up()
    assert not llm.is_sleeping()
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [0, 0]  # the prefix cache starts empty
    assert texts(again) == before
    assert texts(llm.generate(prompts, SAMPLED, use_tqdm=False)) == sampled


def test_level_1_keeps_the_weights_and_wakes_in_parts(tiny_llama_dir) -> None:
    from zllm.errors import ParamError

    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20, enable_sleep_mode=True)
    prompts = ["Blocks of the KV cache hold keys and values for sixteen tokens each."]
    before = texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    runner = llm.model_runner
    model = runner.model
    llm.sleep(level=1)
    assert runner.model is model and runner.kv_tensors == []  # the pool alone released
    with pytest.raises(ParamError, match="unknown wake_up tags"):
        llm.wake_up(["optimizer"])
    llm.wake_up(["weights"])  # (already here on CPU) not awake without a KV pool
    assert llm.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping() and runner.model is model
    assert texts(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
    llm.sleep(level=2)
    assert runner.model is None
    llm.wake_up(["kv_cache"])  # the parts in either order
    llm.wake_up(["weights"])
    assert texts(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
    with pytest.raises(ParamError, match="sleep level must be 1 or 2"):
        llm.sleep(level=3)


def test_sleep_needs_sleep_mode(tiny_llama_dir) -> None:
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20).sleep()


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, buffers, the GGUF kernel's blocks),
    each storage counted once."""
    storages: dict[int, int] = {}
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for t in held:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.slow
def test_sleep_releases_weights_and_kv_pool(smollm2_path) -> None:
    llm = LLM(smollm2_path, kv_cache_memory_bytes=48 << 20, enable_sleep_mode=True)
    prompts = [
        f"Write a long story about the number {i}, with a beginning, a middle and an end, "
        "told in plain words for a child who is learning to count."
        for i in range(10)
    ]
    # The pool is resident from the start (zeroed at allocation). What a wake-up must not
    # bring back is the prefix cache: sleep dropped its blocks' bytes, and each prompt (two
    # blocks and more) would hit its own blocks again if they were still listed.
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    before = texts(llm.generate(prompts, long, use_tqdm=False))
    runner = llm.model_runner
    weights = tensor_bytes(runner.model)
    pool = sum(t.nbytes for t in runner.kv_tensors)
    resident = resident_bytes()
    llm.sleep(level=1)  # the pool, not the weights
    released = resident - resident_bytes()
    assert 0.9 * pool <= released < pool + 0.5 * weights, (released, pool, weights)
    llm.wake_up()
    assert texts(llm.generate(prompts, long, use_tqdm=False)) == before
    resident = resident_bytes()
    llm.sleep(level=2)
    released = resident - resident_bytes()
    assert released >= pool + 0.9 * weights, (released, pool, weights)
    llm.wake_up()
    assert texts(llm.generate(prompts, long, use_tqdm=False)) == before


@pytest.mark.slow
@pytest.mark.e2e
def test_served_sleep_and_wake_up(smollm2_path, engine_pool, tmp_path) -> None:
    """POST /sleep releases the executor's memory (its resident set falls by at least the
    KV pool plus 90% of the weights' bytes, measured as the executor held them: the RSS it
    gains between sleep and wake-up); requests meanwhile are 503s; after /wake_up the
    answers equal those before."""
    with engine_pool.serve(
        smollm2_path, tmp_path / "server.log", "--enable-sleep-mode",
        "--kv-cache-memory-bytes", "48M", "--max-num-seqs", "8",
    ) as server:  # fmt: skip
        body = {"prompt": "Write a long story about a lighthouse.", "max_tokens": 24,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip

        def complete() -> str:
            r = server.post("/v1/completions", body, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(10) as pool:  # a batch of ten (the pool is resident from the start)
            before = list(pool.map(lambda _: complete(), range(10)))
        executor = str(server.children()["executor"])
        awake = resident_bytes(executor)
        assert server.post("/sleep?level=2", {}).status_code == 200
        assert wait_until(lambda: server.get("/is_sleeping").json()["is_sleeping"], 10)
        asleep = resident_bytes(executor)
        r = server.post("/v1/completions", body)
        assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
        assert server.post("/wake_up", {}).status_code == 200
        rewoken = resident_bytes(executor)
        assert wait_until(lambda: not server.get("/is_sleeping").json()["is_sleeping"], 10)
        # Waking loads the weights (GGUF blocks; fp32 for what the kernel does not serve) and
        # a pool zeroed in place (resident at once): what it gained beyond the pool is the
        # weights' bytes. Before sleeping, weights and the whole written pool were resident.
        released = awake - asleep
        pool_bytes = 48 << 20
        weight_bytes = rewoken - asleep - pool_bytes
        assert weight_bytes > 80 << 20  # SmolLM2's blocks: 94 MB
        assert released >= pool_bytes + 0.9 * weight_bytes, (awake, asleep, rewoken)
        assert complete() == before[0]
        assert server.post("/sleep?level=3", {}).status_code == 400
        # Level 1 releases the pool (resident: waking zeroed it in place); the weights stay.
        # Woken in parts (vLLM's tags): not serving until both are back.
        awake = resident_bytes(executor)
        assert server.post("/sleep?level=1", {}).status_code == 200
        released = awake - resident_bytes(executor)
        assert 0.9 * pool_bytes <= released < pool_bytes + 0.5 * weight_bytes, released
        assert server.post("/wake_up?tags=optimizer", {}).status_code == 400
        assert server.post("/wake_up?tags=weights", {}).status_code == 200
        assert server.get("/is_sleeping").json()["is_sleeping"]
        assert server.post("/v1/completions", body).status_code == 503
        assert server.post("/wake_up?tags=kv_cache", {}).status_code == 200
        assert wait_until(lambda: not server.get("/is_sleeping").json()["is_sleeping"], 10)
        assert complete() == before[0]


def post_raw(port: int, path: str, body: dict) -> socket.socket:
    """A POST sent on a socket the caller closes when it chooses: a client dropping its
    request at a moment the test picks."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(head.encode() + payload)
    return conn


@pytest.mark.e2e
def test_served_sleep_asked_during_a_step_waits_for_it(tiny_llama_dir, tmp_path) -> None:
    """The core takes requests and aborts in while it waits for a step, but a sleep call met
    then is held until that step is collected: sleeping collects the steps in flight itself,
    and doing so inside the wait would leave the wait for a step already taken (the core
    would give the executor up as dead after --executor-timeout). Here the executor is
    paused with a step in flight whose request the client has dropped (aborted: nothing
    unfinished, a step still out), /sleep is asked, the executor resumes: the engine
    sleeps, no executor is given up, and it serves again after /wake_up. While a request
    runs, /sleep is refused.

    Nothing here races --executor-timeout (CI's flake: the pauses under load outlasted the
    3 s it was): the timeout is left far above the pauses, and a wait left for a taken step
    shows instead as /wake_up unanswered (the held call never applied) within the client's
    timeout, which is below the executor's."""
    server = start_server(
        tiny_llama_dir, tmp_path / "server.log", "--enable-sleep-mode", "--executor-timeout", "120"
    )
    core, executor = server.children()["core"], server.children()["executor"]
    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}

    def running() -> float:
        return metric(server.get("/metrics").text, "vllm:num_requests_running")

    try:
        with ThreadPoolExecutor(2) as pool:
            os.kill(executor, signal.SIGSTOP)  # (for well under --executor-timeout)
            try:
                # The client drops its request once it runs (not after a fixed time: under
                # CI's load a 0.5 s client timeout could fire before the request reached the
                # core, so it never ran).
                dropped = post_raw(server.port, "/v1/completions", body)
                assert wait_until(lambda: running() == 1, 60)
                dropped.close()
                assert wait_until(lambda: running() == 0, 60)  # aborted mid-step
                asked = pool.submit(server.post, "/sleep?level=1", {}, timeout=30)
                # For the call to reach the core, which holds it unseen (were it late, the
                # step would end first and the test pass without its point, never fail).
                time.sleep(1)
            finally:
                os.kill(executor, signal.SIGCONT)
            assert asked.result().status_code == 200, asked.result().text
        assert server.get("/is_sleeping").json()["is_sleeping"]
        r = server.post("/v1/completions", body)
        assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
        # A wait left for the taken step would hold /wake_up until --executor-timeout.
        assert server.post("/wake_up", {}, timeout=60).status_code == 200
        with ThreadPoolExecutor(2) as pool:
            os.kill(executor, signal.SIGSTOP)
            try:
                long = pool.submit(server.post, "/v1/completions", body)
                assert wait_until(lambda: running() == 1, 60)
                asked = pool.submit(server.post, "/sleep?level=1", {}, timeout=30)
                time.sleep(0.5)
            finally:
                os.kill(executor, signal.SIGCONT)
            refused = asked.result()
            assert refused.status_code == 400 and "requests are running" in refused.text
            assert long.result().status_code == 200
        assert server.children()["core"] == core, server.log_tail()
        assert "treating the executor as dead" not in server.log_text()
    finally:
        assert stop_server(server) == 0
