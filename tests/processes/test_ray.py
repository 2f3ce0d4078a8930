"""`--distributed-executor-backend ray`: executor ranks as Ray actors on a two-node Ray cluster
on loopback (ray.cluster_utils.Cluster: two raylets with their own ports and resources),
through `zllm serve` with the openai client. Tensor parallelism across the two nodes gives
one rank's greedy output (near-tie rule), and a node killed under load is an executor death:
in-flight requests fail, the engine comes back once the cluster can place its ranks again.
Data-parallel engines share one cluster (the supervisor's own head node), and a consumer of
KV transfers receives blocks in its rank's actor."""

from __future__ import annotations

import os
import re
import signal

import pytest
from parity import SERVED_PROMPTS, count_flips, served_greedy
from ray import cluster_utils
from served_answers import per_engine
from servers import (
    alive,
    fail_under_load,
    free_port,
    start_server,
    stop_server,
    wait_until,
)

pytestmark = pytest.mark.e2e


NODE = {"num_cpus": 2, "object_store_memory": 100 << 20}
RAY_TP2 = (
    "--distributed-executor-backend", "ray", "--tensor-parallel-size", "2",
    "--ray-placement-strategy", "STRICT_SPREAD",
)  # fmt: skip


def actor_pids(log: str) -> dict[str, list[int]]:
    """Engine ("dp<i>") -> its rank actors' process ids (not the server's children: Ray's),
    in the order its drivers logged them (a restarted engine's last)."""
    pids: dict[str, list[int]] = {}
    pattern = r"\[executor (dp\d+)\].*: Ray actor on node \w+ \(\S+\), pid (\d+)"
    for engine, pid in re.findall(pattern, log):
        pids.setdefault(engine, []).append(int(pid))
    return pids


def test_data_parallel_engines_share_one_cluster_and_restart_alone(
    tiny_llama_dir, one_rank_greedy, tmp_path, monkeypatch
):
    """`--data-parallel-size 2` with Ray actors and no RAY_ADDRESS (first in this file, before
    the two-node cluster exists): the supervisor starts one head node, both engines' drivers
    join it, each with its own placement group. Greedy answers equal a plain server's, and
    requests reach both engines. Engine 1's driver killed: engine 1 restarts with new actors
    while engine 0's actor, never touched, serves on."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    expected = one_rank_greedy(tiny_llama_dir, 16)
    dp2 = ("--data-parallel-size", "2", "--distributed-executor-backend", "ray")
    server = start_server(tiny_llama_dir, tmp_path / "dp.log", *dp2)
    try:
        log = server.log_text()
        assert "started a Ray head node" in log
        assert len(set(re.findall(r"group (zllm-engine-\d+-\d+)", log))) == 2, log
        flips = count_flips(served_greedy(server, SERVED_PROMPTS, 16), expected, "ray DP=2")
        assert flips <= 1, f"{flips} near-tie flips in {len(SERVED_PROMPTS)} prompts"

        def requests() -> dict[str, float]:  # (counters come with each core's heartbeat)
            return per_engine(server.get("/metrics").text, "zllm:tenant_requests_total")

        assert wait_until(lambda: sum(requests().values()) == len(SERVED_PROMPTS), 30)
        assert set(requests()) == {"0", "1"} and min(requests().values()) >= 1, requests()

        pids = actor_pids(server.log_text())
        [actor0], [actor1] = pids["dp0"], pids["dp1"]
        driver1 = server.children()["executor dp1"]
        os.kill(driver1, signal.SIGKILL)
        assert wait_until(lambda: "engine 1 restarted" in server.log_text(), 120), server.log_tail()
        assert wait_until(lambda: not alive(actor1), 30)  # its driver's actor went with it
        pids = actor_pids(server.log_text())
        assert pids["dp0"] == [actor0] and alive(actor0), pids  # engine 0's, never touched
        assert len(pids["dp1"]) == 2 and alive(pids["dp1"][1]), pids
        assert "engine 0 restarted" not in server.log_text()
        flips = count_flips(served_greedy(server, SERVED_PROMPTS, 16), expected, "restarted")
        assert flips <= 1, f"{flips} near-tie flips after the restart"
    finally:
        assert stop_server(server) == 0
    # The head node took every actor with it.
    assert wait_until(lambda: not any(alive(p) for ps in pids.values() for p in ps), 30)


@pytest.fixture(scope="module")
def cluster():
    """A head node and a worker node, 2 CPUs each, on this machine; RAY_ADDRESS names it
    for the servers started here."""
    cluster = cluster_utils.Cluster(
        initialize_head=True, head_node_args={**NODE, "include_dashboard": False}
    )
    worker = cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    yield cluster, worker
    if old is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = old
    cluster.shutdown()


def rank_nodes(log: str) -> dict[int, str]:
    """Executor rank -> the Ray node its actor runs on, from the server's log."""
    return {
        int(rank): node
        for rank, node in re.findall(r"executor rank (\d+): Ray actor on node (\w+)", log)
    }


def test_tp2_across_two_nodes_equals_one_rank_and_a_node_killed_is_an_executor_death(
    cluster, tiny_llama_dir, one_rank_greedy, tmp_path
):
    """Two ranks as Ray actors, one on each node: greedy output equal to one rank's (near-tie
    rule). Then, on the same server, the worker node goes (its raylet and the rank actor on
    it killed) while requests run: they end with a 503 or an error event, the driver exits,
    the supervisor starts the engine again, which waits for the cluster to place two ranks
    on two nodes; once a node joins, it serves the same greedy output as before."""
    ray_cluster, worker = cluster
    expected = one_rank_greedy(tiny_llama_dir, 24)
    server = start_server(tiny_llama_dir, tmp_path / "ray.log", *RAY_TP2)
    try:
        nodes = rank_nodes(server.log_text())
        assert set(nodes) == {0, 1} and nodes[0] != nodes[1], nodes  # one rank per node
        assert "executor" in server.children()  # one executor process: the driver
        flips = count_flips(served_greedy(server, SERVED_PROMPTS, 24), expected, "ray TP=2")
        assert flips <= 1, f"{flips} near-tie flips in {len(SERVED_PROMPTS)} prompts"

        before = served_greedy(server, SERVED_PROMPTS[:2], 16)
        driver = server.children()["executor"]
        outcomes = fail_under_load(server, lambda: ray_cluster.remove_node(worker, False), 120)
        assert set(outcomes) <= {"ok", "status 503", "error event"}, outcomes
        assert outcomes.count("ok") < len(outcomes), outcomes
        assert wait_until(lambda: server.children().get("executor") not in (None, driver), 60)
        ray_cluster.add_node(**NODE)  # room for the second rank again
        assert wait_until(server.healthy, 120), server.log_tail()
        assert "a Ray executor rank is gone" in server.log_text()
        after = served_greedy(server, SERVED_PROMPTS[:2], 16)
        assert [tokens for tokens, _ in after] == [tokens for tokens, _ in before]
    finally:
        assert stop_server(server) == 0


def test_ray_backend_flags(tiny_llama_dir, monkeypatch):
    from zllm import LLM
    from zllm.config.engine_args import EngineArgs

    config = EngineArgs(
        model=tiny_llama_dir, distributed_executor_backend="ray", tensor_parallel_size=2
    ).create_engine_config()
    assert config.executor_processes == 1 and config.world_size == 2
    # The driver is the one executor process: no rank endpoints (tcp ports) are set aside.
    from zllm.config.serve import ServerArgs
    from zllm.runtime.launch import serve_config_from

    for transport in ("ipc", "tcp"):
        endpoints = serve_config_from(config, ServerArgs(transport=transport)).endpoints
        assert endpoints.engines[0].executor_ranks == [], transport
    # Several Ray engines share one cluster: RAY_ADDRESS's, else a head the supervisor starts;
    # each rank's share of the host's cores counts every engine's ranks.
    from zllm.executor.ranks.ray_actors import rank_bundle
    from zllm.runtime.ray_head import needs_own_head

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert needs_own_head("ray", 2) and not needs_own_head("ray", 1)
    assert not needs_own_head("mp", 2)
    cores = len(os.sched_getaffinity(0))
    assert rank_bundle(config, 2) == {"CPU": float(max(1, cores // 4))}
    with pytest.raises(ValueError, match="invalid choice|must be one of"):
        EngineArgs(model=tiny_llama_dir, ray_placement_strategy="ANYWHERE").create_engine_config()
    with pytest.raises(ValueError, match="the offline LLM starts its ranks as processes"):
        LLM(tiny_llama_dir, distributed_executor_backend="ray")


def test_ray_ranks_send_and_receive_kv_blocks(cluster, tiny_llama_dir, tmp_path):
    """Prefill/decode disaggregation with both servers' ranks as Ray actors (one each, on
    either node): the producer's actor sends the prompt blocks, the consumer's actor
    receives them into its buffer and its news reaches the core through the driver's relay.
    Through the proxy the greedy answers equal the producer's own, and the consumer loaded
    every full prompt block from the transfer."""
    from disagg_pairs import PROMPTS, assert_pair_answers_as_one_server, served_pair

    ray = ("--distributed-executor-backend", "ray")
    with served_pair(tiny_llama_dir, tmp_path, free_port(), *ray) as pair:
        assert_pair_answers_as_one_server(*pair, PROMPTS[:2])


def test_ray_ranks_compose_with_the_other_features(cluster, tiny_llama_dir, tmp_path):
    """Ray × LoRA, Spec, Offload, Sleep, HF, Det, KV dtype, Beam: two Ray rank actors (one
    per node) of the transformers backend with an adapter, ngram speculation, a CPU tier,
    sleep mode, deterministic mode and an int8 KV cache answer greedy requests (base and
    adapter) and a beam search as the offline engine on two rank processes with the same
    options does, before and after a sleep."""
    import json

    import openai
    from lora_adapters import ADAPTERS, make_adapter
    from offline_answers import NGRAM, offline_beam_texts
    from served_answers import beam_texts

    from zllm import LLM, LoRARequest, SamplingParams

    name, config = next(iter(ADAPTERS.items()))
    adapter = LoRARequest(name, 1, str(make_adapter(tiny_llama_dir, tmp_path / name, 1, **config)))
    options = dict(
        tensor_parallel_size=2, enable_lora=True, speculative_config=NGRAM,
        model_impl="transformers", deterministic=True, kv_cache_dtype="int8",
        kv_offload_bytes=8 << 20, kv_cache_memory_bytes=64 << 20,
    )  # fmt: skip
    prompts = [f"Request {i}: " + "tick tock " * (2 + i) for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    offline = LLM(tiny_llama_dir, **options)
    expected = {}
    for lora in (None, adapter):
        outs = offline.generate(prompts, params, lora_request=lora, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            expected[prompt, lora is None] = out.outputs[0].text
    expected_beams = offline_beam_texts(offline, prompts[0])
    del offline
    assert any(expected[p, True] != expected[p, False] for p in prompts)  # the adapter acts
    flags = (
        *RAY_TP2, "--enable-lora", "--lora-modules", f"{name}={adapter.lora_path}",
        "--speculative-config", json.dumps(NGRAM), "--model-impl", "transformers",
        "--deterministic", "--kv-cache-dtype", "int8", "--kv-offload-bytes", "8M",
        "--enable-sleep-mode",
    )  # fmt: skip
    server = start_server(tiny_llama_dir, tmp_path / "ray.log", *flags)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        base = client.models.list().data[0].id

        def check() -> None:
            for (prompt, is_base), text in expected.items():
                model = base if is_base else name
                answer = client.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0
                )
                assert answer.choices[0].text == text, (prompt, model)
            assert beam_texts(server.url, prompts[0]) == expected_beams

        check()
        assert server.post("/sleep?level=1", {}).status_code == 200
        assert server.post("/wake_up", {}).status_code == 200
        check()
    finally:
        assert stop_server(server) == 0


@pytest.mark.parametrize("case", ["hybrid-tp2", "gguf-dp2"])
def test_ray_ranks_serve_a_hybrid_model_and_a_gguf_file(cluster, tmp_path, case):
    """Ray × Hybrid: a tiny Gemma 3 over two Ray rank actors (one per node); Ray × Quant and
    DP × Quant: a Q8_0 GGUF file (its matmuls read the blocks) on two data-parallel engines
    of one Ray rank actor each. Greedy answers equal the offline engine's on the same layout
    of rank processes (one rank for each engine of the second)."""
    from gguf import GGMLQuantizationType as T
    from gguf_files import write_llama_gguf
    from served_answers import assert_every_engine_served, greedy
    from tiny_models import tiny_gemma3_overrides, write_tiny_model

    from zllm import LLM, SamplingParams

    if case == "hybrid-tp2":
        path = str(write_tiny_model(tmp_path / "gemma3", **tiny_gemma3_overrides(8)))
        flags, offline_options = RAY_TP2, {"tensor_parallel_size": 2}
    else:
        path = str(tmp_path / "q8.gguf")
        write_llama_gguf(tmp_path / "q8.gguf", lambda name: T.Q8_0)
        flags = ("--distributed-executor-backend", "ray", "--data-parallel-size", "2")
        offline_options = {}
    prompts = [f"Question {i}: " + "how far " * (1 + i) for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    offline = LLM(path, kv_cache_memory_bytes=64 << 20, **offline_options)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]
    del offline
    server = start_server(path, tmp_path / "ray.log", *flags)
    try:
        if case == "gguf-dp2":
            assert server.log_text().count("read GGUF blocks") == 2  # each engine's actor
        assert greedy(server.url, prompts, max_tokens=10) == expected
        if case == "gguf-dp2":  # both engines answered some
            assert_every_engine_served(server, len(prompts))
    finally:
        assert stop_server(server) == 0
