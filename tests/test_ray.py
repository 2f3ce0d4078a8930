"""`--distributed-executor-backend ray`: executor ranks as Ray actors on a two-node Ray cluster
on loopback (ray.cluster_utils.Cluster: two raylets with their own ports and resources),
through `zllm serve` with the openai client. Tensor parallelism across the two nodes gives
one rank's greedy output (near-tie rule), and a node killed under load is an executor death:
in-flight requests fail, the engine comes back once the cluster can place its ranks again."""

from __future__ import annotations

import os
import re

import pytest
from parity import SERVED_PROMPTS, count_flips, served_greedy
from ray import cluster_utils
from servers import fail_under_load, start_server, stop_server, wait_until

pytestmark = pytest.mark.e2e


NODE = {"num_cpus": 2, "object_store_memory": 100 << 20}
RAY_TP2 = (
    "--distributed-executor-backend", "ray", "--tensor-parallel-size", "2",
    "--ray-placement-strategy", "STRICT_SPREAD",
)  # fmt: skip


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


def test_tp2_across_two_nodes_equals_one_rank(cluster, tiny_llama_dir, tmp_path):
    single = start_server(tiny_llama_dir, tmp_path / "mp.log")
    try:
        expected = served_greedy(single, SERVED_PROMPTS, 24)
    finally:
        assert stop_server(single) == 0
    server = start_server(tiny_llama_dir, tmp_path / "ray.log", *RAY_TP2)
    try:
        nodes = rank_nodes(server.log_text())
        assert set(nodes) == {0, 1} and nodes[0] != nodes[1], nodes  # one rank per node
        assert "executor" in server.children()  # one executor process: the driver
        flips = count_flips(served_greedy(server, SERVED_PROMPTS, 24), expected, "ray TP=2")
        assert flips <= 1, f"{flips} near-tie flips in {len(SERVED_PROMPTS)} prompts"
    finally:
        assert stop_server(server) == 0


def test_a_node_killed_under_load_is_an_executor_death(cluster, tiny_llama_dir, tmp_path):
    """The worker node goes (its raylet and the rank actor on it killed) while requests run:
    they end with a 503 or an error event, the driver exits, the supervisor starts the
    engine again, which waits for the cluster to place two ranks on two nodes; once a node
    joins, it serves the same greedy output as before."""
    ray_cluster, worker = cluster
    server = start_server(tiny_llama_dir, tmp_path / "server.log", *RAY_TP2)
    try:
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


def test_ray_backend_flags(tiny_llama_dir):
    from zllm import LLM
    from zllm.config.engine_args import EngineArgs

    config = EngineArgs(
        model=tiny_llama_dir, distributed_executor_backend="ray", tensor_parallel_size=2
    ).create_engine_config()
    assert config.executor_processes == 1 and config.world_size == 2
    # The driver is the one executor process: no rank endpoints (tcp ports) are set aside.
    from zllm.config.serve import ServerArgs, serve_config_from

    for transport in ("ipc", "tcp"):
        endpoints = serve_config_from(config, ServerArgs(transport=transport)).endpoints
        assert endpoints.engines[0].executor_ranks == [], transport
    with pytest.raises(ValueError, match="invalid choice|must be one of"):
        EngineArgs(model=tiny_llama_dir, ray_placement_strategy="ANYWHERE").create_engine_config()
    with pytest.raises(ValueError, match="the offline LLM starts its ranks as processes"):
        LLM(tiny_llama_dir, distributed_executor_backend="ray")
