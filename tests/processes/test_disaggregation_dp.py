"""Prefill/decode disaggregation with data-parallel engines (--kv-transfer-config with
--data-parallel-size): each consumer engine's ports, the producer's choice of the consumer
engine for each request's blocks, the sender's socket per consumer engine, then a pair of
two-engine servers behind the proxy. The consumer's routing of marked requests is in
tests/tokenizer_proc/test_router.py; the rest of disaggregation in
tests/processes/test_disaggregation.py (the pieces) and test_disaggregation_served.py (through
servers)."""

from __future__ import annotations

import os
import re
import time

import pytest
from disagg_pairs import PROMPTS, free_port_range, served_pair
from kv_tiers import make_pool
from scheduler_parts import BS, disagg_scheduler, transfer_request
from served_answers import greedy
from servers import wait_until

from zllm.config.engine_args import EngineArgs
from zllm.config.kv_transfer import KVTransferConfig, consumer_engine
from zllm.executor.kv.transfer import KVReceiver, KVSender, RemoteKVBuffer
from zllm.kv.block_hash import hash_full_blocks
from zllm.protocol import KVBlocksReceived

# ---- the config and the core ---------------------------------------------------------------


def test_a_data_parallel_consumers_engines_each_take_their_own_ports(tiny_llama_dir):
    """Engine e's rank r listens at kv_port + e x ranks + r: the whole range must be ports
    and leave the HTTP port; a producer names the consumer's engines in its extra config and
    a consumer's are its --data-parallel-size."""
    from zllm.config.serve import ServerArgs
    from zllm.runtime.launch import serve_config_from

    config = KVTransferConfig(role="kv_consumer", port=9000)
    addresses = [config.engine_address(e, r, 2) for e in (0, 1, 2) for r in (0, 1)]
    assert [int(a.rsplit(":", 1)[1]) for a in addresses] == list(range(9000, 9006))
    assert config.rank_address(1) == config.engine_address(0, 1, 2) == "tcp://127.0.0.1:9001"

    def consumer(port: int, tp: int = 2, **extra):
        value = {"kv_role": "kv_consumer", "kv_port": port, "kv_connector_extra_config": extra}
        args = EngineArgs(model=tiny_llama_dir, kv_transfer_config=value, tensor_parallel_size=tp)
        return args.create_engine_config()

    engine = consumer(9000)
    served = serve_config_from(engine, ServerArgs(port=9004, data_parallel_size=2))
    assert served.engine.kv_transfer.consumer_engines == 2  # (its ports: 9000-9003)
    assert engine.kv_transfer.consumer_engines == 1  # (the caller's config is left as it was)
    with pytest.raises(ValueError, match="KV ports 9000-9005.*take the server's --port 9005"):
        serve_config_from(engine, ServerArgs(port=9005, data_parallel_size=3))
    with pytest.raises(ValueError, match=r"65533-65536 \(engine e's rank r.*past 65535"):
        serve_config_from(consumer(65533), ServerArgs(port=8000, data_parallel_size=2))
    with pytest.raises(ValueError, match="consumer_data_parallel_size 2 on a consumer with "):
        serve_config_from(consumer(9000, consumer_data_parallel_size=2), ServerArgs(port=8000))
    # A producer connects to its consumer's range: it must be ports too.
    producer = {"kv_role": "kv_producer", "kv_port": 65534}
    producer["kv_connector_extra_config"] = {"consumer_data_parallel_size": 3}
    with pytest.raises(ValueError, match="1 executor ranks x 3 engines.*past 65535"):
        EngineArgs(model=tiny_llama_dir, kv_transfer_config=producer).create_engine_config()


def test_a_producer_names_the_consumer_engine_of_each_requests_blocks():
    """With consumer_data_parallel_size 2 each sent block carries its consumer engine: the
    one its prompt's first block hash picks (consumer_engine), which is where the consumer's
    tokenizer workers send the request; with one consumer engine none is named."""
    prompts = {f"p{i}": list(range(100 * i, 100 * i + 13)) for i in range(1, 9)}
    engine_of = {r: consumer_engine(hash_full_blocks(p, BS), 2) for r, p in prompts.items()}
    assert set(engine_of.values()) == {0, 1}  # (eight prompts: both engines get some)
    for engines in (2, 1):
        sched, _ = disagg_scheduler("kv_producer", budget=128)  # (every prompt in one step)
        sched.kv.transfer.consumer_engines = engines
        for req_id, prompt in prompts.items():
            sched.add_request(transfer_request(req_id, prompt, do_remote_decode=True))
        so = sched.schedule()
        assert len(so.kv_sends) == 3 * len(prompts)  # each prompt's 3 loadable blocks
        if engines == 1:
            assert so.kv_send_engines == []
            continue
        bm = sched.block_manager
        expected = [(h, engine_of[r]) for r in prompts for h in bm.block_hashes(r)[:3]]
        hashes = [h for h, _ in so.kv_sends]
        assert list(zip(hashes, so.kv_send_engines, strict=True)) == expected


# ---- the executor's bytes ------------------------------------------------------------------


def test_a_sender_sends_each_block_to_its_consumer_engines_rank():
    """A producer's rank 1 of 2, to a consumer of two engines: each block reaches rank 1 of
    the engine named for it (engine e's rank r at kv_port + e x 2 + r), and no other."""
    import msgspec
    import zmq

    port = free_port_range(4)
    consumer = KVTransferConfig(role="kv_consumer", port=port)
    news = []
    for engine in (0, 1):
        core_in = f"ipc:///tmp/zllm-test-kv-{port}-{engine}"
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.bind(core_in)
        news.append((sock, core_in))
        buffer = RemoteKVBuffer(make_pool(num_blocks=8), capacity=4, pin_memory=False)
        KVReceiver(consumer, buffer, "layout", core_in, rank=1, engine=engine, ranks=2)
    producer = KVTransferConfig(role="kv_producer", port=port, consumer_engines=2)
    sender = KVSender(producer, make_pool(num_blocks=8), "layout", rank=1, ranks=2)
    assert sender.addresses == [f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{port + 3}"]
    A, B, C = (bytes([i]) * 16 for i in (1, 2, 3))  # three block keys
    received: list[list[bytes]] = [[], []]
    deadline = time.monotonic() + 10
    while not all(received):  # (sends before the connections are up are dropped)
        assert time.monotonic() < deadline
        sender.send([(A, 3), (B, 4), (C, 5)], [1, 0, 1])
        time.sleep(0.1)
        for engine, (sock, _) in enumerate(news):
            while sock.poll(0):
                message = msgspec.msgpack.decode(sock.recv(), type=KVBlocksReceived)
                assert message.rank == 1
                received[engine].extend(message.stored)
    assert set(received[0]) == {B} and set(received[1]) == {A, C}
    for sock, core_in in news:
        sock.close(linger=0)
        os.unlink(core_in.removeprefix("ipc://"))


# ---- through servers -----------------------------------------------------------------------


def remote_hits_per_engine(server) -> dict[str, float]:
    """The remote tier's hits (tokens) of each data-parallel engine, by its `engine` label."""
    text = server.get("/metrics").text
    hits = {}
    for line in text.splitlines():
        if line.startswith("zllm:kv_offload_hits_total{") and 'tier="remote"' in line:
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            hits[engine] = float(line.rsplit(" ", 1)[1])
    return hits


@pytest.mark.e2e
def test_data_parallel_pair_sends_each_prompts_blocks_to_the_engine_that_serves_it(
    tiny_llama_dir, tmp_path
):
    """Both servers with --data-parallel-size 2, the producer told its consumer's
    (consumer_data_parallel_size 2): each prompt's blocks go to the consumer engine its first
    block's hash picks (at kv_port + engine), and the consumer's tokenizer routes the request
    there. Through the proxy the greedy answers equal a plain server's (the producer's own,
    asked unmarked), and each consumer engine loaded exactly its prompts' full blocks from
    the transfer, with no wait timed out (which blocks sent to the wrong engine would be)."""
    dp2 = ("--data-parallel-size", "2")
    pair = served_pair(
        tiny_llama_dir, tmp_path, free_port_range(2), *dp2, consumer_data_parallel_size=2
    )
    with pair as (prefill, decode, proxy):
        prompts, loadable = {}, {"0": 0.0, "1": 0.0}
        for i in range(32):  # one prompt for each consumer engine
            prompt = f"Question {i}: " + PROMPTS[i % len(PROMPTS)]
            ids = prefill.post("/tokenize", {"prompt": prompt}).json()["tokens"]
            engine = str(consumer_engine(hash_full_blocks(ids, 16), 2))
            if engine not in prompts:
                prompts[engine] = prompt
                loadable[engine] = (len(ids) - 1) // 16 * 16  # (not the last token's block)
            if len(prompts) == 2:
                break
        ordered = list(prompts.values())
        before = remote_hits_per_engine(decode)
        reference = greedy(prefill.url, ordered, max_tokens=16)
        assert greedy(proxy.url, ordered, max_tokens=16) == reference

        def gained() -> dict[str, float]:
            now = remote_hits_per_engine(decode)
            return {e: now[e] - before.get(e, 0.0) for e in now}

        assert wait_until(lambda: gained() == loadable, 30), (gained(), loadable)
        text = decode.get("/metrics").text
        timeouts = re.findall(r"^zllm:kv_transfer_wait_timeouts_total\{.*\} (\S+)$", text, re.M)
        assert len(timeouts) == 2 and sum(map(float, timeouts)) == 0
