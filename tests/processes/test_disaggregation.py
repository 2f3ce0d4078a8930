"""Prefill/decode disaggregation (--kv-transfer-config, `zllm proxy`), its pieces: the config,
the core's part (a producer's sends, a consumer's wait and loads) as exact specs, the executor's
bytes (sender to receiver over tcp and shared memory, the buffer's bounds, the files shared
memory leaves). Through servers: tests/processes/test_disaggregation_served.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch
from disagg_pairs import (
    free_port_range,
)
from kv_tiers import make_pool
from scheduler_parts import BS, disagg_scheduler, transfer_request
from servers import free_port, wait_until

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.config.kv_transfer import KVTransferConfig, kv_transfer_config_from
from zllm.core.kv.connector import TieredKVConnector
from zllm.core.request import Request
from zllm.executor.kv.transfer import SHM_DIR, KVReceiver, KVSender, RemoteKVBuffer
from zllm.kv.block_hash import hash_full_blocks
from zllm.kv.tiers import TIER_REMOTE
from zllm.protocol import KVBlocksReceived, KVRejection, KVTransferParams, ModelRunnerOutput


def key(n: int) -> bytes:
    """A block key named by hand (16 bytes, as the engine's: zllm/kv/block_hash.py)."""
    return n.to_bytes(16, "little")


# ---- the config ----------------------------------------------------------------------------


def test_config_in_vllms_shape():
    config = kv_transfer_config_from(
        {
            "kv_connector": "ZllmConnector",
            "kv_role": "kv_consumer",
            "kv_ip": "10.0.0.2",  # (transport tcp: shm would need an address of this host)
            "kv_port": 15000,
            "kv_buffer_size": 1e9,
            "kv_rank": 1,  # vLLM's, meaningless here: accepted
            "kv_connector_extra_config": {
                "transport": "tcp",
                "wait_timeout_s": 2,
                "consumer_data_parallel_size": 2,
            },
        }
    )
    assert config == KVTransferConfig(
        role="kv_consumer",
        host="10.0.0.2",
        port=15000,
        buffer_bytes=10**9,
        transport="tcp",
        wait_timeout_s=2.0,
        consumer_engines=2,
    )
    assert config.consumes and not config.produces and config.address == "tcp://10.0.0.2:15000"


@pytest.mark.parametrize(
    "value, message",
    [
        ({"kv_role": "kv_producer", "kv_connector": "NixlConnector"}, "not available here"),
        ({"kv_role": "prefill"}, "kv_role must be one of"),
        ({"kv_role": "kv_both"}, "kv_role must be one of"),
        ({"kv_role": "kv_producer", "kv_ip": "192.0.2.123",
          "kv_connector_extra_config": {"transport": "shm"}}, "not an address of this host"),
        ({"kv_role": "kv_producer", "kv_port": 70000}, "is not a port"),
        ({"kv_role": "kv_producer", "kv_port": "x"}, "kv_port must be a number"),
        ({"kv_role": "kv_producer", "bogus": 1}, "unknown key"),
        ({"kv_role": "kv_producer", "kv_connector_extra_config": {"transport": "rdma"}},
         "transport must be one of"),
        ({"kv_role": "kv_consumer", "kv_connector_extra_config": {"wait_s": 1}},
         "kv_connector_extra_config: unknown key.*wait_s"),
        ({"kv_role": "kv_consumer", "kv_connector_extra_config": [1]},
         "kv_connector_extra_config must be a dict"),
        ({"kv_role": "kv_consumer", "kv_connector_extra_config": {"wait_timeout_s": "soon"}},
         "wait_timeout_s must be a number"),
        ({"kv_role": "kv_producer",
          "kv_connector_extra_config": {"consumer_data_parallel_size": 0}},
         "consumer_data_parallel_size must be at least 1"),
        ({"kv_role": "kv_producer",
          "kv_connector_extra_config": {"consumer_data_parallel_size": 1.5}},
         "consumer_data_parallel_size must be a whole number"),
    ],
)  # fmt: skip
def test_config_errors_name_the_problem(value, message):
    with pytest.raises(ValueError, match=message):
        kv_transfer_config_from(value)


def test_engines_refuse_what_disaggregation_cannot_serve(tiny_llama_dir, tmp_path):
    from tiny_models import tiny_gemma3_overrides, write_tiny_model

    consumer = {"kv_role": "kv_consumer"}
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineArgs(
            model=tiny_llama_dir, kv_transfer_config=consumer, enable_prefix_caching=False
        ).create_engine_config()
    gemma = str(write_tiny_model(tmp_path, **tiny_gemma3_overrides(8)))  # (several groups:
    assert EngineArgs(model=gemma, kv_transfer_config=consumer).create_engine_config()  # ok)
    windowed = str(write_tiny_model(tmp_path / "mistral", "mistral", sliding_window=16))
    for role in ("kv_producer", "kv_consumer"):  # (every layer sliding: one group, ok too)
        EngineArgs(model=windowed, kv_transfer_config={"kv_role": role}).create_engine_config()
    # Tensor-parallel ranks each move their heads, pipeline stages their layers: every
    # executor rank (stage x tensor-parallel size + its rank) on kv_port + rank.
    tp2 = EngineArgs(model=tiny_llama_dir, kv_transfer_config=consumer, tensor_parallel_size=2)
    assert tp2.create_engine_config().kv_transfer.rank_address(1) == "tcp://127.0.0.1:14580"
    staged = EngineArgs(
        model=tiny_llama_dir,
        kv_transfer_config=consumer,
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
    ).create_engine_config()
    assert staged.world_size == 4
    assert staged.kv_transfer.rank_address(3) == "tcp://127.0.0.1:14582"
    with pytest.raises(ValueError, match="4 executor ranks needs ports 65533-65536"):
        EngineArgs(
            model=tiny_llama_dir,
            kv_transfer_config={**consumer, "kv_port": 65533},
            pipeline_parallel_size=2,
            tensor_parallel_size=2,
        ).create_engine_config()
    with pytest.raises(ValueError, match="for served engines"):
        LLM(tiny_llama_dir, kv_transfer_config=consumer)
    # Ray actors receive (and send) blocks themselves: tests/test_ray.py.
    ray = EngineArgs(
        model=tiny_llama_dir, kv_transfer_config=consumer, distributed_executor_backend="ray"
    ).create_engine_config()
    assert ray.kv_transfer is not None and ray.kv_transfer.consumes


def test_a_tensor_parallel_consumers_ports_must_fit_and_leave_the_http_port(tiny_llama_dir):
    """Rank r listens at kv_port + r: the range must be ports, and not the server's own."""
    from zllm.config.serve import ServerArgs
    from zllm.runtime.launch import serve_config_from

    last = {"kv_role": "kv_consumer", "kv_port": 65535}
    EngineArgs(model=tiny_llama_dir, kv_transfer_config=last).create_engine_config()
    with pytest.raises(ValueError, match="needs ports 65535-65536.*past 65535"):
        EngineArgs(
            model=tiny_llama_dir, kv_transfer_config=last, tensor_parallel_size=2
        ).create_engine_config()
    consumer = {"kv_role": "kv_consumer", "kv_port": 9000}
    engine = EngineArgs(
        model=tiny_llama_dir, kv_transfer_config=consumer, tensor_parallel_size=2
    ).create_engine_config()
    with pytest.raises(ValueError, match="KV ports 9000-9001.*take the server's --port 9001"):
        serve_config_from(engine, ServerArgs(port=9001))
    assert serve_config_from(engine, ServerArgs(port=9002)).engine.kv_transfer.port == 9000


def test_the_proxy_pairs_each_prefill_server_with_its_decode_server():
    from zllm.proxy.app import pairs_of

    assert pairs_of(["http://p1/", "http://p2"], ["http://d1", "http://d2"]) == [
        ("http://p1", "http://d1"),
        ("http://p2", "http://d2"),
    ]
    assert pairs_of(["http://p1", "http://p2"], ["http://d"]) == [
        ("http://p1", "http://d"),
        ("http://p2", "http://d"),
    ]
    with pytest.raises(ValueError, match="as many of each"):
        pairs_of(["http://p1"], ["http://d1", "http://d2"])


# ---- the core ------------------------------------------------------------------------------


def test_a_producer_sends_the_full_prompt_blocks_of_marked_requests_once():
    sched, _ = disagg_scheduler("kv_producer", budget=8)
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks, prefilled in chunks of 8
    sched.add_request(transfer_request("marked", prompt, do_remote_decode=True))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"marked": 8} and first.kv_sends == []  # a chunk
    sched.update_from_output(first, ModelRunnerOutput(first.step_id, [], []))
    last = sched.schedule()
    blocks = sched.block_manager.block_ids("marked")
    assert last.kv_sends == list(zip(hash_full_blocks(prompt[:12], BS), blocks[:3], strict=True))
    sched.update_from_output(last, ModelRunnerOutput(last.step_id, ["marked"], [[7]]))
    sched.add_request(Request("plain", list(range(300, 309)), SamplingParams(max_tokens=2)))
    assert sched.schedule().kv_sends == []  # not marked: nothing sent
    assert sched.kv.num_sent_blocks == 3
    # 8 tokens, two full blocks: only the first is sent, as the second ends with the token
    # whose logits the consumer computes (no prefix hit takes it).
    exact = list(range(400, 408))
    sched.add_request(transfer_request("exact", exact, do_remote_decode=True))
    sends = next(so.kv_sends for so in iter(sched.schedule, None) if so.kv_sends)
    assert sends == [
        (hash_full_blocks(exact[:4], BS)[0], sched.block_manager.block_ids("exact")[0])
    ]
    assert sched.kv.num_sent_blocks == 4


def test_a_consumer_waits_for_the_blocks_then_loads_them_and_others_go_first():
    sched, kv = disagg_scheduler("kv_consumer")
    prompt = list(range(40, 53))  # 13 tokens: 3 full blocks a hit may use
    hashes = hash_full_blocks(prompt[:12], BS)
    sched.add_request(transfer_request("decode", prompt, do_remote_prefill=True))
    sched.add_request(Request("other", list(range(500, 505)), SamplingParams(max_tokens=1)))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["other"]  # "decode" waits, "other" goes ahead
    waiting = sched.requests["decode"]
    kept = waiting.prompt_block_hashes
    assert kept == hashes  # its prompt, hashed while it waits
    kv.received(hashes[:2], [])
    assert "decode" not in sched.schedule().num_scheduled_tokens  # one block still missing
    assert waiting.prompt_block_hashes is kept  # not hashed again
    kv.received(hashes[2:], [])
    so = sched.schedule()
    assert so.num_scheduled_tokens["decode"] == 1  # only the last token is computed
    assert waiting.prompt_block_hashes is None  # admitted: not kept
    assert [(t, h) for t, h, _ in so.kv_transfers.loads] == [(TIER_REMOTE, h) for h in hashes]
    assert kv.hit_tokens[TIER_REMOTE] == 12 and sched.kv.num_wait_timeouts == 0


def test_a_consumer_stops_waiting_at_the_timeout_and_computes_the_rest():
    sched, kv = disagg_scheduler("kv_consumer", wait_timeout_s=0.05)
    prompt = list(range(40, 53))
    kv.received(hash_full_blocks(prompt[:4], BS), [])  # only the first block ever comes
    sched.add_request(transfer_request("decode", prompt, do_remote_prefill=True))
    assert sched.schedule().num_scheduled_tokens == {}
    time.sleep(0.06)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"decode": 9}  # one block loaded, 9 tokens computed
    assert len(so.kv_transfers.loads) == 1 and sched.kv.num_wait_timeouts == 1


def test_a_consumer_does_not_wait_for_what_cannot_come_or_be_used():
    """A prompt with more blocks than the buffer holds, and a request that computes every
    prompt position anyway (prompt logprobs), are admitted at once."""
    sched, _ = disagg_scheduler("kv_consumer")  # a 64-block buffer
    sched.add_request(
        transfer_request("long", list(range(1000, 1000 + 65 * BS + 1)), do_remote_prefill=True)
    )
    assert "long" in sched.schedule().num_scheduled_tokens
    sched, _ = disagg_scheduler("kv_consumer")
    logprobs = Request(
        "logprobs", list(range(40, 53)), SamplingParams(max_tokens=1, prompt_logprobs=0),
        kv_transfer=KVTransferParams(do_remote_prefill=True),
    )  # fmt: skip
    sched.add_request(logprobs)
    assert "logprobs" in sched.schedule().num_scheduled_tokens


def test_the_remote_index_follows_what_the_buffer_says():
    kv = TieredKVConnector(None, block_bytes=1, remote_bytes=8)
    kv.received([1, 2, 3], [])
    kv.received([4], [1])
    assert kv.lookup([2, 3, 4]) == [TIER_REMOTE] * 3 and kv.lookup([1]) == []
    kv.evicted([(9, 0)])  # a pool eviction is stored into no tier here
    assert kv.take_transfers() is None
    kv.load_failed([(TIER_REMOTE, 3)])
    assert kv.lookup([2, 3]) == [TIER_REMOTE] and kv.load_failures[TIER_REMOTE] == 1


def test_the_remote_index_holds_a_block_once_every_rank_holds_its_part():
    """Tensor-parallel ranks each hold their heads of a block in their own buffer: the core
    loads a block only once every rank reported it, and forgets it once any rank dropped it
    (or a load of it failed on some rank)."""
    kv = TieredKVConnector(None, block_bytes=1, remote_bytes=8, remote_ranks=2)
    kv.received([1, 2, 3], [], rank=0)
    assert kv.lookup([1]) == [] and kv.stored_blocks[TIER_REMOTE] == 0  # rank 1's parts?
    kv.received([1, 2], [], rank=1)
    assert kv.lookup([1, 2, 3]) == [TIER_REMOTE] * 2 and kv.stored_blocks[TIER_REMOTE] == 2
    kv.received([2], [], rank=1)  # a resend: held already, counted once
    assert kv.stored_blocks[TIER_REMOTE] == 2
    kv.received([4], [1], rank=1)  # rank 1 dropped block 1: no whole copy is left
    assert kv.lookup([1]) == [] and kv.lookup([2]) == [TIER_REMOTE]
    kv.received([1], [], rank=1)  # (rank 0 dropped nothing: its part of 1 is still there)
    assert kv.lookup([1]) == [TIER_REMOTE]
    kv.received([4], [3], rank=0)  # 3's part only ever on rank 0, now gone; 4 on both
    assert kv.lookup([4]) == [TIER_REMOTE] and kv.lookup([3]) == []
    kv.received([3], [], rank=1)  # so rank 1's part of 3 alone does not make it held
    assert kv.lookup([3]) == []
    kv.load_failed([(TIER_REMOTE, 2)])  # a rank lost its part between report and load
    assert kv.lookup([2]) == []
    kv.received([2], [], rank=0)  # sent again: held once every rank has it again
    assert kv.lookup([2]) == []
    kv.received([2], [], rank=1)
    assert kv.lookup([2]) == [TIER_REMOTE]


def test_a_ranks_news_decodes_and_one_from_before_ranks_reads_as_rank_0():
    import msgspec

    from zllm.protocol import CoreInput

    decode = msgspec.msgpack.Decoder(CoreInput).decode
    news = KVBlocksReceived(stored=[key(5)], removed=[key(6)], rank=1)
    assert decode(msgspec.msgpack.encode(news)) == news
    old = msgspec.msgpack.encode(KVBlocksReceived(stored=[key(5)], removed=[key(6)]))
    assert decode(old).rank == 0
    refused = KVBlocksReceived(rank=1, rejected=3, rejection=KVRejection.INVALID)
    assert decode(msgspec.msgpack.encode(refused)) == refused


def test_the_core_counts_the_blocks_its_executor_ranks_refused_by_reason():
    """Counted only (the index is not touched), per rank's part, into the heartbeat's
    kv_transfer section (zllm:kv_transfer_rejected_blocks_total{reason})."""
    sched, kv = disagg_scheduler("kv_consumer")
    assert sched.kv.transfer_stats().rejected_blocks == [0, 0]  # present from the start
    sched.kv.rejected(3, KVRejection.LAYOUT)
    sched.kv.rejected(2, KVRejection.LAYOUT)
    sched.kv.rejected(1, KVRejection.INVALID)
    assert sched.kv.transfer_stats().rejected_blocks == [5, 1]
    assert kv.stored_blocks[TIER_REMOTE] == 0


# ---- the executor's bytes ------------------------------------------------------------------


def test_the_buffer_drops_its_oldest_blocks_and_loads_into_the_pool():
    pool = make_pool(num_blocks=8)
    buffer = RemoteKVBuffer(pool, capacity=2, pin_memory=False)
    blocks = pool.gather([0, 1, 2])
    assert buffer.put([key(10), key(11)], blocks[:2]) == ([key(10), key(11)], [])
    assert buffer.put([key(12)], blocks[2:]) == ([key(12)], [key(10)])  # full: the oldest goes
    assert buffer.load([key(10), key(11), key(12)], [5, 6, 7]) == [0]  # 10 is gone
    assert torch.equal(pool.gather([6, 7]), blocks[1:])


@pytest.mark.parametrize(
    ("transport", "dtype"), [("tcp", torch.float32), ("shm", torch.float32), ("tcp", torch.int8)]
)
def test_blocks_travel_from_a_producers_pool_to_a_consumers_buffer(transport, dtype):
    """Blocks move at their stored width: fp32, or int8 rows with their scales."""
    import msgspec
    import zmq

    port = free_port()
    config = KVTransferConfig(role="kv_producer", port=port, transport=transport)
    consumer = KVTransferConfig(role="kv_consumer", port=port, transport=transport)
    producer_pool = make_pool(num_blocks=8, dtype=dtype)
    consumer_pool = make_pool(num_blocks=8, dtype=dtype)
    consumer_pool.tensors = [torch.zeros_like(t) for t in consumer_pool.tensors]
    core_in = f"ipc:///tmp/zllm-test-kv-{port}"
    news = zmq.Context.instance().socket(zmq.PULL)
    news.bind(core_in)
    buffer = RemoteKVBuffer(consumer_pool, capacity=16, pin_memory=False)
    KVReceiver(consumer, buffer, "layout-a", core_in)
    sender = KVSender(config, producer_pool, "layout-a")

    def transfer_files() -> set[str]:  # (only ours: other processes use /dev/shm too)
        return {name for name in os.listdir(SHM_DIR) if name.startswith("zllm-kv-")}

    before = transfer_files()
    deadline = time.monotonic() + 10
    while not news.poll(200):  # (sends before the connection is up are dropped)
        assert time.monotonic() < deadline
        sender.send([(key(111), 3), (key(222), 5)])
    message = msgspec.msgpack.decode(news.recv(), type=KVBlocksReceived)
    assert message.stored == [key(111), key(222)]
    time.sleep(0.3)
    while news.poll(0):  # repeats of a send made while the first was on its way
        news.recv()
    assert buffer.load([key(111), key(222)], [0, 1]) == []
    assert torch.equal(consumer_pool.gather([0, 1]), producer_pool.gather([3, 5]))
    assert transfer_files() <= before  # the consumer deleted the shared-memory files
    # Blocks of another model or layout are refused: the core hears only their count (and
    # a shared-memory file is deleted all the same).
    foreign = KVSender(config, producer_pool, "layout-b")
    deadline = time.monotonic() + 10
    while not news.poll(200):  # (as above: until its connection is up)
        assert time.monotonic() < deadline
        foreign.send([(key(333), 1)])
    message = msgspec.msgpack.decode(news.recv(), type=KVBlocksReceived)
    assert (message.stored, message.rejected, message.rejection) == ([], 1, KVRejection.LAYOUT)
    assert buffer.load([key(333)], [2]) == [0]
    assert wait_until(lambda: transfer_files() <= before, 5)
    news.close(linger=0)
    os.unlink(core_in.removeprefix("ipc://"))  # zmq leaves a bound ipc path behind


def test_each_rank_sends_its_part_of_the_blocks_to_its_peer_rank(tiny_llama_dir):
    """Tensor-parallel rank 1 of a producer reaches rank 1 of the consumer at kv_port + 1,
    which names its rank to the core. The layout names the rank count and the rank, so the
    parts of a producer cut otherwise are dropped (the consumer computes those blocks)."""
    import msgspec
    import zmq

    from zllm.executor.kv.transfer import transfer_layout

    configs = [
        EngineArgs(model=tiny_llama_dir, tensor_parallel_size=tp).create_engine_config()
        for tp in (1, 2)
    ]
    layouts = {transfer_layout(configs[0]), *(transfer_layout(configs[1], r) for r in (0, 1))}
    assert len(layouts) == 3
    port = free_port_range(2)
    consumer = KVTransferConfig(role="kv_consumer", port=port)
    core_in = f"ipc:///tmp/zllm-test-kv-{port}"
    news = zmq.Context.instance().socket(zmq.PULL)
    news.bind(core_in)
    buffer = RemoteKVBuffer(make_pool(num_blocks=8), capacity=4, pin_memory=False)
    KVReceiver(consumer, buffer, "rank-1-layout", core_in, rank=1)
    producer = KVTransferConfig(role="kv_producer", port=port)
    sender = KVSender(producer, make_pool(num_blocks=8), "rank-1-layout", rank=1)
    deadline = time.monotonic() + 10
    while not news.poll(200):  # (sends before the connection is up are dropped)
        assert time.monotonic() < deadline
        sender.send([(key(111), 3)])
    message = msgspec.msgpack.decode(news.recv(), type=KVBlocksReceived)
    assert (message.stored, message.rank) == ([key(111)], 1)
    news.close(linger=0)
    os.unlink(core_in.removeprefix("ipc://"))


def test_a_consumer_reads_only_transfer_files_and_orphans_are_removed():
    """A header naming any other /dev/shm file, or a transfer file's name that links to one,
    is refused and that file left alone; files of producers that are no longer alive are
    deleted."""
    from zllm.executor.kv import transfer as kv_transfer
    from zllm.protocol import KVBlocksHeader

    pool = make_pool(num_blocks=4)
    buffer = RemoteKVBuffer(pool, capacity=4, pin_memory=False)
    config = KVTransferConfig(role="kv_consumer", port=free_port(), transport="shm")
    receiver = KVReceiver(config, buffer, "layout", "ipc:///tmp/zllm-test-unused")
    bystander = os.path.join(SHM_DIR, f"not-zllm-{os.getpid()}")
    with open(bystander, "wb") as f:
        f.write(bytes(pool.block_nbytes))
    link = f"zllm-kv-{os.getpid()}-{config.port}-777"
    os.symlink(bystander, os.path.join(SHM_DIR, link))  # (of the right size and owner)
    others = f"zllm-kv-{os.getpid()}-{config.port + 1}-0"  # another consumer's file
    with open(os.path.join(SHM_DIR, others), "wb") as f:
        f.write(bytes(pool.block_nbytes))
    try:
        header = KVBlocksHeader([1], "layout", "float32", list(pool.block_shape), "x")
        for name in (os.path.basename(bystander), "../etc/passwd", link, others):
            header.shm_file = name
            news = receiver.take(header, [])
            assert (news.rejected, news.rejection) == (1, KVRejection.INVALID), name
        assert os.path.exists(bystander) and os.path.exists(os.path.join(SHM_DIR, others))
    finally:
        for name in (os.path.basename(bystander), link, others):
            if os.path.lexists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = os.path.join(SHM_DIR, f"zllm-kv-{dead.pid}-1-0")
    mine = os.path.join(SHM_DIR, f"zllm-kv-{os.getpid()}-1-999")
    for path in (orphan, mine):
        open(path, "wb").close()
    try:
        kv_transfer.remove_orphaned_shm_files()
        assert not os.path.exists(orphan) and os.path.exists(mine)
    finally:
        for path in (orphan, mine):
            if os.path.exists(path):
                os.unlink(path)


def test_a_producer_that_cannot_write_its_shm_file_drops_the_blocks_and_goes_on():
    """The file's name taken (as a full /dev/shm fails, with ENOSPC): the send is dropped (the
    consumer recomputes), not raised into the executor's step, and its bytes are not held;
    the next send writes the next file and reaches the consumer."""
    import msgspec
    import zmq

    from zllm.protocol import KVBlocksHeader

    pool = make_pool(num_blocks=4)
    config = KVTransferConfig(role="kv_producer", port=free_port(), transport="shm")
    consumer = zmq.Context.instance().socket(zmq.PULL)  # stands in for the consumer's receiver
    consumer.bind(config.engine_address(0, 0, 1))
    sender = KVSender(config, pool, "layout")

    def file(number: int) -> str:
        return os.path.join(SHM_DIR, f"zllm-kv-{os.getpid()}-{config.port}-{number}")

    def received() -> KVBlocksHeader | None:
        if not consumer.poll(200):
            return None
        header = msgspec.msgpack.decode(consumer.recv_multipart()[0], type=KVBlocksHeader)
        os.unlink(os.path.join(SHM_DIR, header.shm_file))  # as the consumer does once read
        return header

    # The sender drops what it cannot hand over at once (ZMQ_IMMEDIATE, no blocking send), so
    # a send before its side of the connection is up is dropped too (on a loaded machine that
    # can take a while after the consumer's side is up). Probe until one arrives.
    probes = 0
    deadline = time.monotonic() + 20
    while True:
        sender.send([(key(100 + probes), 3)])
        probes += 1
        if received() is not None:
            break
        assert time.monotonic() < deadline, "the sender never reached the consumer"
    while received() is not None:  # a slow probe that arrived after the next one was sent
        pass
    taken, free = file(probes), file(probes + 1)  # the next two files' names
    open(taken, "wb").close()  # its next file's name, taken
    try:
        sender.send([(key(1), 0), (key(2), 1)])
        assert sender._queued_bytes == 0
        assert os.path.getsize(taken) == 0  # left as it was
        sender.send([(key(3), 2)])  # the next name is free: sent
        assert consumer.poll(10_000), "the second send never reached the consumer"
        header = msgspec.msgpack.decode(consumer.recv_multipart()[0], type=KVBlocksHeader)
        assert header.hashes == [key(3)]
        assert header.shm_file == os.path.basename(free)
        assert os.path.getsize(free) == pool.block_nbytes
    finally:
        consumer.close(linger=0)
        for path in [taken, free, *(file(i) for i in range(probes))]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_a_consumer_removes_what_its_ports_previous_consumer_left_unread():
    """Files for a port whose consumer died unread stay while their producer lives (this
    test process is that producer); the next consumer to bind that port removes them, and
    only them: a live consumer's files (another port, or this port while a live consumer
    still holds it, so a second one fails to bind) are left alone."""
    live_port, restarted_port = free_port(), free_port()
    pool = make_pool(num_blocks=4)

    def consumer(port: int) -> KVReceiver:
        config = KVTransferConfig(role="kv_consumer", port=port, transport="shm")
        buffer = RemoteKVBuffer(pool, capacity=4, pin_memory=False)
        return KVReceiver(config, buffer, "layout", "ipc:///tmp/zllm-test-unused")

    consumer(live_port)
    left = [os.path.join(SHM_DIR, f"zllm-kv-{os.getpid()}-{restarted_port}-{i}") for i in (0, 1)]
    live = os.path.join(SHM_DIR, f"zllm-kv-{os.getpid()}-{live_port}-0")
    for path in (*left, live):
        open(path, "wb").close()
    try:
        with pytest.raises(RuntimeError, match="cannot listen"):
            consumer(live_port)  # the port is a live consumer's: its file stays
        assert os.path.exists(live)
        consumer(restarted_port)
        assert not any(os.path.exists(p) for p in left) and os.path.exists(live)
    finally:
        for path in (*left, live):
            if os.path.exists(path):
                os.unlink(path)
