"""Data-parallel routing, piece by piece (no processes): the tokenizer workers' Router, the
block hashes it shares with the cores, the block manager's KV cache events, the detokenizer's
per-engine reset and the frontend's merged statistics. The served behaviour is in
tests/test_data_parallel.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zllm.core.kv.block_manager import BlockManager
from zllm.kv.block_hash import cache_salt, hash_full_blocks
from zllm.lora import LoRARequest
from zllm.protocol import (
    DetokenizerBatch,
    DetokRequest,
    EngineStats,
    EngineStatus,
    KVCacheEvents,
    RequestOptions,
    SchedulerLoad,
)
from zllm.tokenizer_proc.router import DOWN_AFTER_S, PREFIX_WEIGHT, RECENT_S, Router

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def heartbeat(engine: int, num_running: int = 0, num_waiting: int = 0) -> EngineStats:
    """An engine's heartbeat as the router reads it: who sent it, and its queues."""
    return EngineStats(EngineStatus(engine), SchedulerLoad(num_running, num_waiting))


def router_with(num_engines: int, policy: str = "cache_aware") -> tuple[Router, Clock]:
    clock = Clock()
    router = Router(num_engines, policy, clock=clock)
    for e in range(num_engines):
        router.on_stats(heartbeat(e))
    return router, clock


def hashes(tokens: list[int]) -> list[int]:
    return hash_full_blocks(tokens, BS)


PREFIX = list(range(100, 140))  # 10 blocks


def test_a_prompt_goes_to_the_engine_that_holds_its_prefix():
    router, _ = router_with(3)
    router.on_kv_events(KVCacheEvents(engine=2, stored=hashes(PREFIX)))
    prompt = hashes([*PREFIX, 1, 2, 3, 4, 5, 6, 7, 8])  # 12 blocks, 10 held by engine 2
    assert router.choose(prompt) == 2
    # Only a leading run counts: the same tokens after a different first block are no hit
    # (their hashes chain from another parent), so the busier engine 2 is passed over.
    router.on_stats(heartbeat(2, num_running=1))
    assert router.choose(hashes([9, 9, 9, 9, *PREFIX])) != 2


def test_without_a_held_prefix_load_spreads_round_robin():
    router, _ = router_with(2)
    chosen = []
    for i in range(8):
        prompt = hashes([i, i + 1, i + 2, i + 3, 7, 7, 7, 7])
        engine = router.choose(prompt)
        router.routed(engine, prompt)
        chosen.append(engine)
    assert chosen.count(0) == chosen.count(1) == 4


def test_prompts_routed_moments_ago_count_as_held_until_events_catch_up():
    """A burst sharing a prefix stays together although no KV event has arrived yet."""
    router, clock = router_with(2)
    prompt = hashes(PREFIX)
    first = router.choose(prompt)
    router.routed(first, prompt)
    for _ in range(3):
        engine = router.choose(hashes([*PREFIX, 5, 5, 5, 5]))
        router.routed(engine, prompt)
        assert engine == first
    clock.now += RECENT_S + 1  # the memory of routing fades; only events hold it now
    for e in range(2):
        router.on_stats(heartbeat(e))  # (heartbeats keep both up)
    router.engines[first].num_running = 1
    assert router.choose(prompt) != first


def test_recently_routed_hashes_stay_bounded_and_drop_their_oldest():
    """More distinct blocks routed within RECENT_S than MAX_RECENT: the table keeps the
    newest MAX_RECENT (it grew past its cap while none had expired: issue 56); expired
    ones leave as later requests are routed."""
    from zllm.tokenizer_proc import router as router_module

    router, clock = router_with(1)
    view = router.engines[0]
    cap = router_module.MAX_RECENT
    for start in range(0, 3 * cap, 1024):
        router.routed(0, list(range(start, start + 1024)))
        assert len(view.recent) <= cap
    assert view.holds(3 * cap - 1, clock.now) and not view.holds(0, clock.now)
    clock.now += RECENT_S + 1
    router.routed(0, [-1])
    assert list(view.recent) == [-1]


def test_a_busy_holder_sheds_work_to_an_idle_engine():
    router, _ = router_with(2)
    router.on_kv_events(KVCacheEvents(engine=0, stored=hashes(PREFIX)))
    prompt = hashes(PREFIX)
    router.on_stats(heartbeat(0, num_running=int(PREFIX_WEIGHT) - 1))
    assert router.choose(prompt) == 0  # a whole-prompt hit outweighs 7 running requests
    router.on_stats(heartbeat(0, num_running=2, num_waiting=2))  # load 10
    assert router.choose(prompt) == 1


def test_load_routing_ignores_the_prefix():
    router, _ = router_with(2, policy="load")
    router.on_kv_events(KVCacheEvents(engine=0, stored=hashes(PREFIX)))
    router.on_stats(heartbeat(0, num_running=1))
    assert router.choose(hashes(PREFIX)) == 1


def test_kv_events_remove_and_clear_what_an_engine_holds():
    router, _ = router_with(2)
    held = hashes(PREFIX)
    router.on_kv_events(KVCacheEvents(engine=0, stored=held))
    router.on_kv_events(KVCacheEvents(engine=0, removed=held[:1]))
    assert router.engines[0].held == set(held[1:])
    router.on_kv_events(KVCacheEvents(engine=0, stored=held[:2], cleared=True))
    assert router.engines[0].held == set(held[:2])  # cleared first, then stored
    router.on_message(KVCacheEvents(engine=7, stored=[1]))  # no such engine: ignored
    router.on_message(heartbeat(7))


def test_silent_or_unreachable_engines_are_down_and_forgotten():
    router, clock = router_with(2)
    router.on_kv_events(KVCacheEvents(engine=1, stored=hashes(PREFIX)))
    clock.now += DOWN_AFTER_S + 0.1
    router.on_stats(heartbeat(0))
    assert router.choose(hashes(PREFIX)) == 0  # engine 1 went silent
    assert router.engines[1].held == set()  # a restarted engine starts empty
    router.on_stats(heartbeat(1))  # back
    router.mark_down(0)  # a send to it failed
    assert router.choose(hashes(PREFIX)) == 1
    assert router.choose(hashes(PREFIX), exclude=[1]) is None


def test_a_new_router_routes_before_any_heartbeat_and_drops_the_silent():
    clock = Clock()
    router = Router(2, clock=clock)
    assert router.choose([]) in (0, 1)  # the engines were ready before the worker started
    clock.now += DOWN_AFTER_S + 0.1
    assert router.choose([]) is None


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router(2, "random")


def test_block_hashes_are_the_same_in_every_process():
    """The tokenizers route by the hashes the cores compute: they must not depend on the
    process (Python randomizes str hashes, and hash(None) is an address before 3.12)."""
    tokens = list(range(37))
    salted = "RequestOptions(lora=LoRARequest('a', 3, '/a'), cache_salt='tenant-7')"
    code = (
        "from zllm.kv.block_hash import hash_full_blocks, cache_salt;"
        "from zllm.lora import LoRARequest; from zllm.protocol import RequestOptions;"
        f"print(hash_full_blocks({tokens}, 4), hash_full_blocks({tokens}, 4, "
        f"salt=cache_salt({salted})))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2)
    }
    salt = cache_salt(RequestOptions(lora=LoRARequest("a", 3, "/a"), cache_salt="tenant-7"))
    here = f"{hash_full_blocks(tokens, 4)} {hash_full_blocks(tokens, 4, salt=salt)}\n"
    assert outputs == {here}
    assert hash_full_blocks(tokens, 4) != hash_full_blocks(tokens, 4, salt=salt)


def test_the_block_manager_reports_what_its_prefix_cache_gains_and_loses():
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.record_kv_events()
    a = list(range(8))
    assert bm.allocate_slots("a", a, 0, 8)
    stored, removed, cleared = bm.take_kv_events()
    assert stored == hash_full_blocks(a, BS) and removed == [] and not cleared
    bm.free("a")
    assert bm.take_kv_events() == ([], [], False)  # freed blocks stay cached
    b = list(range(50, 66))  # needs all 4 blocks: a's two are evicted
    assert bm.allocate_slots("b", b, 0, 16)
    stored, removed, _ = bm.take_kv_events()
    assert set(removed) == set(hash_full_blocks(a, BS))
    assert stored == hash_full_blocks(b, BS)
    bm.free("b")
    bm.reset_prefix_cache()
    assert bm.take_kv_events() == ([], [], True)
    quiet = BlockManager(num_blocks=4, block_size=BS)  # not recording: nothing kept
    assert quiet.allocate_slots("a", a, 0, 8)
    assert quiet.take_kv_events() == ([], [], False)


def test_a_restarted_engine_resets_only_its_own_requests_in_the_detokenizer(tiny_llama_dir):
    from zllm.detokenizer_proc.detokenizer import Detokenizer
    from zllm.text.tokenizer import load_tokenizer

    detok = Detokenizer(load_tokenizer(tiny_llama_dir, None))
    params = {"prompt_tail": [1, 2], "n": 1}
    detok.process(DetokenizerBatch(new_requests=[DetokRequest("a", **params)], engine=0))
    detok.process(DetokenizerBatch(new_requests=[DetokRequest("b", **params)], engine=1))
    detok.process(DetokenizerBatch(reset=True, engine=1))
    assert set(detok.requests) == {"a"}


def test_a_disaggregation_consumers_marked_request_is_pinned_to_its_blocks_engine():
    """do_remote_prefill requests go to the engine their blocks are sent to, whatever the
    prefix affinity, the load or the policy; if it is down, where the policy says."""
    for policy in ("cache_aware", "load"):
        router, _ = router_with(3, policy)
        router.on_kv_events(KVCacheEvents(engine=2, stored=hashes(PREFIX)))
        router.on_stats(heartbeat(1, num_waiting=50))
        assert router.choose(hashes(PREFIX), pinned=1) == 1
        router.mark_down(1)
        expected = {2} if policy == "cache_aware" else {0, 2}  # (load: a tie, round robin)
        assert router.choose(hashes(PREFIX), pinned=1) in expected
        assert router.choose(hashes(PREFIX), exclude=[0], pinned=0) == 2


def test_the_consumer_engine_of_a_prompt_is_its_first_blocks_hash_modulo_the_engines():
    from zllm.config.kv_transfer import consumer_engine

    first = int.from_bytes(hashes(PREFIX)[0][:8], "little")  # its first 8 bytes, as documented
    assert consumer_engine(hashes(PREFIX), 3) == first % 3
    assert consumer_engine(hashes(PREFIX[:5]), 3) == first % 3  # only the first block counts
    assert consumer_engine([], 3) is None  # no full block: nothing is sent, any engine will do
    assert consumer_engine([bytes([7]) + bytes(15)], 2) == 1
    salted = hash_full_blocks(PREFIX, BS, salt=cache_salt(RequestOptions(cache_salt="x")))
    spread = {consumer_engine(hash_full_blocks([i, *PREFIX], BS), 4) for i in range(64)}
    assert salted[0] != first and spread == {0, 1, 2, 3}


class FakeSocket:
    def __init__(self, refuses: bool = False) -> None:
        self.refuses = refuses
        self.sent: list[bytes] = []

    def send(self, data: bytes, flags: int = 0) -> None:
        import zmq

        if self.refuses:
            raise zmq.Again()
        self.sent.append(data)


def test_a_tokenizer_routes_a_marked_request_to_its_blocks_engine_or_unmarks_it():
    """A consumer's tokenizer worker sends a do_remote_prefill request to the engine its
    prompt's blocks go to; when that engine's core refuses the send (it is down), another
    engine gets it unmarked: its blocks will not come there, so it computes the prompt at
    once instead of waiting its timeout."""
    import msgspec

    from zllm.config.kv_transfer import consumer_engine
    from zllm.protocol import EngineCoreRequest, KVTransferParams
    from zllm.sampling_params import SamplingParams
    from zllm.tokenizer_proc.main import EngineSender

    sender = EngineSender.__new__(EngineSender)  # (its sockets faked: no ZeroMQ here)
    sender.encoder = msgspec.msgpack.Encoder()
    sender.block_size, sender.prefix_caching, sender.consumes = BS, True, True
    sender.to_frontend = FakeSocket()
    sender.router, _ = router_with(2)
    marked = RequestOptions(kv_transfer=KVTransferParams(do_remote_prefill=True))
    prompt = next(  # a prompt whose blocks go to engine 1 (engine 0 holds nothing of it)
        p for i in range(64) if consumer_engine(hashes(p := [i, *PREFIX]), 2) == 1
    )
    request = EngineCoreRequest("r1", prompt, SamplingParams(max_tokens=1), options=marked)
    decode = msgspec.msgpack.Decoder(EngineCoreRequest).decode
    for target_down in (False, True):
        sender.to_cores = [FakeSocket(), FakeSocket(refuses=target_down)]
        sender.router.on_stats(heartbeat(1, num_waiting=50))  # busy, and up
        sender.send(request)
        engine = 0 if target_down else 1
        (sent,) = sender.to_cores[engine].sent
        assert decode(sent).options.kv_transfer.do_remote_prefill is not target_down
        assert decode(sent).prompt_token_ids == prompt
