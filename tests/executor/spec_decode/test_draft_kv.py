"""Features that compose (issue 38): speculative decoding with a draft model, with KV offload
and KV transfers. The draft keeps its KV under the target's block ids, so a block that a
tier or a producer hands back brings the draft's layers with the target's, under one key
(executor/kv/pool.py).

Here: a pool with a draft part gathers and scatters both parts exactly, the CPU tier's
buffer and the disk tier's files hold both (and a file of one layout is not read by the
other), the layout fingerprint and the transfer layout name the draft; then an engine whose
prefix left the pool for the CPU or the disk tier loads it back, answers as without offload
and still accepts the draft's proposals as often (a draft whose KV did not come back would
propose from the wrong context); then a served producer/consumer pair, both with the draft.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.config.kv_layout import block_bytes, layout_fingerprint, tier_directory
from zllm.executor.kv.connector import CpuTier, DiskTier, KVPool
from zllm.executor.kv.quant import narrow
from zllm.executor.kv.transfer import transfer_layout
from zllm.kv.tiers import TIER_CPU, TIER_DISK, block_file_name, existing_disk_blocks

BS = 4


# ---- the pool's two parts --------------------------------------------------------------------
def make_pool(num_blocks: int = 8, dtype=torch.float32, seed: int = 5) -> KVPool:
    """Target: 3 layers of 2 KV heads of 8 (stored as `dtype`); draft: 2 layers of 1 KV head
    of 16 in bf16 (another shape and dtype, as a draft's model dtype beside an int8 cache)."""
    gen = torch.Generator().manual_seed(seed)
    target = [narrow(torch.randn(2, num_blocks, BS, 2, 8, generator=gen), dtype) for _ in "abc"]
    draft = [torch.randn(2, num_blocks, BS, 1, 16, generator=gen).bfloat16() for _ in "ab"]
    return KVPool(target, draft)


def target_block(pool: KVPool, block_id: int) -> torch.Tensor:
    return torch.stack([kv[:, block_id] for kv in pool.tensors])


def draft_block(pool: KVPool, block_id: int) -> torch.Tensor:
    return torch.stack([kv[:, block_id] for kv in pool.draft])


def assert_same_block(pool: KVPool, a: int, other: KVPool, b: int) -> None:
    assert torch.equal(target_block(pool, a), target_block(other, b))
    assert torch.equal(draft_block(pool, a), draft_block(other, b))


def zero(pool: KVPool) -> None:
    for kv in [*pool.tensors, *pool.draft]:
        kv.zero_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_pool_with_a_draft_part_gathers_and_scatters_both_parts(dtype):
    pool = make_pool(dtype=dtype)
    target_only = KVPool(pool.tensors)
    target_bytes = target_only.block_nbytes
    assert pool.block_nbytes == target_bytes + 2 * 2 * BS * 1 * 16 * 2  # bf16 draft rows
    assert pool.block_shape == (pool.block_nbytes,) and pool.block_dtype == torch.uint8
    data = pool.gather([5, 2])
    assert data.shape == (2, pool.block_nbytes)
    # The target's part is the single-model block's bytes; the draft's follows it.
    single = target_only.gather([5, 2])
    assert torch.equal(data[:, :target_bytes].contiguous().view(dtype).view(single.shape), single)
    draft = data[:, target_bytes:].contiguous().view(torch.bfloat16).view(2, 2, 2, BS, 1, 16)
    assert torch.equal(draft[0], draft_block(pool, 5))
    assert torch.equal(draft[1], draft_block(pool, 2))
    before = make_pool(dtype=dtype)  # the same draws: the blocks as they were
    pool.scatter([0, 1], data)
    assert_same_block(pool, 0, before, 5) and assert_same_block(pool, 1, before, 2)
    assert_same_block(pool, 3, before, 3)  # others untouched


def test_the_cpu_tier_holds_both_parts():
    pool, before = make_pool(), make_pool()
    tier = CpuTier(pool, capacity=2, pin_memory=False)
    assert tier.buffer.shape == (2, pool.block_nbytes) and tier.buffer.dtype == torch.uint8
    tier.store([30, 40], [3, 4])
    zero(pool)
    assert tier.load([40, 99, 30], [0, 1, 2]) == [1]
    assert_same_block(pool, 0, before, 4) and assert_same_block(pool, 2, before, 3)


KEY_A, KEY_B = (
    b"\xa7" * 16,
    bytes(range(16)),
)  # block keys named by hand (16 bytes, as the engine's)


def test_the_disk_tier_files_hold_both_parts_and_only_their_layout_reads_them(tmp_path):
    pool, before = make_pool(dtype=torch.int8), make_pool(dtype=torch.int8)
    tier = DiskTier(pool, tmp_path / "tier", pool.block_nbytes, bytes(32))
    tier.store([KEY_A, KEY_B], [6, 1])
    tier.flush()
    path = tmp_path / "tier" / block_file_name(KEY_A)
    assert path.stat().st_size == 64 + pool.block_nbytes  # the header, then both parts
    assert existing_disk_blocks(tmp_path / "tier") == [KEY_A, KEY_B]
    assert not tier._pending  # (written: they load from the files)
    zero(pool)
    assert tier.load([KEY_B, KEY_A], [2, 3]) == []
    assert_same_block(pool, 2, before, 1) and assert_same_block(pool, 3, before, 6)
    # The target's part alone is not this file's size: a tier without the draft refuses it.
    single = KVPool(make_pool(dtype=torch.int8).tensors)
    other = DiskTier(single, tmp_path / "other", single.block_nbytes, bytes(32))
    shutil.copy(path, tmp_path / "other" / path.name)
    assert other.load([KEY_A], [0]) == [0]


def draft_of(target: str, path: Path) -> str:
    """The target with a third layer that adds nothing to the residual stream (zero output
    projections): a draft of another KV shape (3 layers) that proposes the target's tokens,
    so the acceptance says whether its KV was right."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(target) / name).exists():
            shutil.copy(Path(target) / name, path / name)
    config = json.loads((Path(target) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = layers + 1
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(str(Path(target) / "model.safetensors"))
    for name in [n for n in weights if n.startswith("model.layers.0.")]:
        copy = weights[name].clone()
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            copy.zero_()
        weights[name.replace("layers.0.", f"layers.{layers}.")] = copy
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir, tmp_path_factory) -> str:
    return draft_of(tiny_llama_dir, tmp_path_factory.mktemp("draft"))


def spec(draft_dir: str) -> dict:
    return {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}


def test_the_layouts_name_the_draft_and_a_block_counts_its_bytes(tiny_llama_dir, draft_dir):
    plain = EngineArgs(model=tiny_llama_dir).create_engine_config()
    drafted = EngineArgs(model=tiny_llama_dir, speculative_config=spec(draft_dir))
    config = drafted.create_engine_config()
    draft_bytes = 2 * 3 * 2 * 16 * 4 * config.cache.block_size  # 3 layers, 2 KV heads, fp32
    assert block_bytes(config) == block_bytes(plain) + draft_bytes
    assert layout_fingerprint(config) != layout_fingerprint(plain)
    assert transfer_layout(config).startswith(transfer_layout(plain) + ":draft:")
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with_ngram = EngineArgs(model=tiny_llama_dir, speculative_config=ngram)
    assert layout_fingerprint(with_ngram.create_engine_config()) == layout_fingerprint(plain)


# ---- the engine --------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def random_prompt(rng: random.Random, n: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(n)]}


def acceptance(llm: LLM) -> tuple[int, int]:
    s = llm.engine.heartbeat().spec
    return s.num_accepted_tokens, s.num_draft_tokens


def run(llm: LLM, prompts: list[dict]) -> tuple[list[list[int]], float]:
    """The prompts' greedy tokens and the share of proposals accepted while making them."""
    accepted, proposed = acceptance(llm)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    now_accepted, now_proposed = acceptance(llm)
    assert now_proposed > proposed
    return tokens, (now_accepted - accepted) / (now_proposed - proposed)


def prompts_evicted_and_asked_again(llm: LLM) -> tuple[list[list[int]], float]:
    """Two prompts, then more distinct traffic than the pool holds, then the two again:
    their tokens and acceptance the second time."""
    rng = random.Random(1)
    prompts = [random_prompt(rng, 250), random_prompt(rng, 90)]
    run(llm, prompts)
    for _ in range(3):
        run(llm, [random_prompt(rng, 300) for _ in range(2)])
    return run(llm, prompts)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_draft_models_kv_comes_back_from_the_tier(tiny_llama_dir, draft_dir, tmp_path, tier):
    """The prefix evicted to the tier loads back with the draft's part: the greedy tokens of
    the engine without offload, and proposals accepted as often as there (the draft is the
    target's function: all of them, where its KV is right)."""
    config = EngineArgs(model=tiny_llama_dir, speculative_config=spec(draft_dir))
    pool = 64 * block_bytes(config.create_engine_config())
    kw = dict(kv_cache_memory_bytes=pool, speculative_config=spec(draft_dir))
    expected, expected_rate = prompts_evicted_and_asked_again(LLM(tiny_llama_dir, **kw))
    offload = (
        dict(kv_offload_bytes=256 * block_bytes(config.create_engine_config()))
        if tier == "cpu"
        else dict(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 24)
    )
    llm = LLM(tiny_llama_dir, **kw, **offload)
    tokens, rate = prompts_evicted_and_asked_again(llm)
    stats = llm.engine.heartbeat()
    assert stats.kv_tiers.hits[TIER_CPU if tier == "cpu" else TIER_DISK] == 320
    assert stats.prefix_cache.hits == 0  # (all of it from the tier)
    assert tokens == expected
    assert expected_rate > 0.9 and rate >= expected_rate - 0.05, (rate, expected_rate)
    if tier == "disk":
        disk = llm.model_runner.kv_tiers.tiers[TIER_DISK]
        disk.flush()
        files = existing_disk_blocks(tier_directory(llm.config))
        assert files and disk.block_nbytes == block_bytes(llm.config)


def test_a_corrupt_block_is_recomputed_by_the_draft_too(tiny_llama_dir, draft_dir, tmp_path):
    """A block file damaged in its draft part fails its load whole: the target and the draft
    both recompute from that block (the draft's catch-up rewinds with the target's), so the
    tokens and the acceptance are those without offload."""
    from zllm.kv.block_hash import hash_full_blocks

    kw = dict(kv_cache_memory_bytes=8 << 20, speculative_config=spec(draft_dir))
    prompt = random_prompt(random.Random(4), 250)
    expected, expected_rate = run(LLM(tiny_llama_dir, **kw), [prompt])
    llm = LLM(tiny_llama_dir, **kw, kv_offload_dir=str(tmp_path), enable_sleep_mode=True)
    run(llm, [prompt])
    llm.sleep()  # (stores the cached prefix to the tier, and empties the pool)
    llm.wake_up()
    llm.model_runner.kv_tiers.tiers[TIER_DISK].flush()
    hashes = hash_full_blocks(prompt["prompt_token_ids"][:240], 16)
    victim = tier_directory(llm.config) / block_file_name(hashes[2])
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x01  # (the draft's part: it follows the target's)
    victim.write_bytes(bytes(data))
    tokens, rate = run(llm, [prompt])
    stats = llm.engine.heartbeat()
    assert stats.kv_tiers.load_failures[TIER_DISK] == 1 and stats.kv_tiers.hits[TIER_DISK] == 240
    assert tokens == expected and rate >= expected_rate - 0.05 > 0.85, (rate, expected_rate)


def test_after_sleep_the_draft_reads_its_kv_from_the_tier(tiny_llama_dir, draft_dir):
    """Sleep stores the cached prefixes to the tier and releases the pool and the draft; on
    waking the draft is made again with new tensors, which the pool's draft part follows:
    the prefixes load back into both, and the draft's proposals are accepted as before."""
    kw = dict(kv_cache_memory_bytes=8 << 20, speculative_config=spec(draft_dir))
    rng = random.Random(3)
    prompts = [random_prompt(rng, 250), random_prompt(rng, 90)]
    expected, expected_rate = run(LLM(tiny_llama_dir, **kw), prompts)
    llm = LLM(tiny_llama_dir, **kw, kv_offload_bytes=16 << 20, enable_sleep_mode=True)
    run(llm, prompts)
    llm.sleep()
    llm.wake_up()
    host = llm.model_runner.host
    assert host.kv.pool.draft and host.kv.pool.draft[0] is host.kv.proposer.kv_caches[0]
    tokens, rate = run(llm, prompts)
    assert llm.engine.heartbeat().kv_tiers.hits[TIER_CPU] == 320
    assert tokens == expected and rate >= expected_rate - 0.05 > 0.85, (rate, expected_rate)


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_ranks_offload_the_drafts_kv_with_their_part(tiny_llama_dir, draft_dir, layout):
    """Each tensor-parallel rank runs the whole draft, so each stores and loads the draft's
    layers with its heads' part of a block; of pipeline stages only the last runs the draft
    and keeps its part. The evicted prefix comes back with one rank's tokens and the draft's
    proposals accepted as there."""
    kw = dict(block_size=4, num_gpu_blocks_override=24, speculative_config=spec(draft_dir))
    rng = random.Random(5)
    first = [random_prompt(rng, 40)]  # 10 blocks of 4
    others = [[random_prompt(rng, 40)] for _ in range(3)]
    expected, expected_rate = run(LLM(tiny_llama_dir, **kw), first)
    llm = LLM(tiny_llama_dir, **kw, kv_offload_bytes=4 << 20, **layout)
    assert run(llm, first)[0] == expected
    for prompt in others:
        run(llm, prompt)
    tokens, rate = run(llm, first)
    assert llm.engine.heartbeat().kv_tiers.hits[TIER_CPU] > 0
    assert tokens == expected and rate >= expected_rate - 0.05 > 0.85, (rate, expected_rate)


# ---- transfers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_blocks_travel_with_their_draft_part(transport):
    """A producer's blocks (both parts, as bytes) reach a consumer's buffer and load into both
    parts of its pool."""
    import msgspec
    import zmq
    from servers import free_port

    from zllm.config.kv_transfer import KVTransferConfig
    from zllm.executor.kv.transfer import KVReceiver, KVSender, RemoteKVBuffer
    from zllm.protocol import KVBlocksReceived

    port = free_port()
    producer_pool, consumer_pool = make_pool(dtype=torch.int8), make_pool(seed=6)
    consumer_pool.tensors = [torch.zeros_like(t) for t in producer_pool.tensors]
    zero(consumer_pool)
    core_in = f"ipc:///tmp/zllm-test-draft-kv-{port}"
    news = zmq.Context.instance().socket(zmq.PULL)
    news.bind(core_in)
    try:
        buffer = RemoteKVBuffer(consumer_pool, capacity=4, pin_memory=False)
        role = dict(port=port, transport=transport)
        KVReceiver(KVTransferConfig(role="kv_consumer", **role), buffer, "layout", core_in)
        sender = KVSender(KVTransferConfig(role="kv_producer", **role), producer_pool, "layout")
        while not news.poll(200):  # (sends before the connection is up are dropped)
            sender.send([(KEY_A, 3), (KEY_B, 5)])
        assert msgspec.msgpack.decode(news.recv(), type=KVBlocksReceived).stored == [KEY_A, KEY_B]
        assert buffer.load([KEY_A, KEY_B], [0, 1]) == []
        assert_same_block(consumer_pool, 0, producer_pool, 3)
        assert_same_block(consumer_pool, 1, producer_pool, 5)
    finally:
        news.close(linger=0)
        Path(core_in.removeprefix("ipc://")).unlink(missing_ok=True)


@pytest.mark.e2e
def test_a_pair_with_draft_models_answers_as_one_server(tiny_llama_dir, draft_dir, tmp_path):
    """Both servers speculate with the draft: the producer sends each prompt block's target and
    draft layers, the consumer loads both (remote hits), answers as the producer does asked
    unmarked, and accepts the draft's proposals as often as it does."""
    from disagg_pairs import PROMPTS, remote_hits, served_pair
    from served_answers import greedy
    from servers import free_port, metric, wait_until

    drafted = ("--speculative-config", json.dumps(spec(draft_dir)))

    # (Counters come with the core's heartbeat, every 0.5 s: a moment behind the requests.)
    def counted(server, name: str) -> float:
        return metric(server.get("/metrics").text, name)

    def rate(server) -> float:
        accepted = counted(server, "vllm:spec_decode_num_accepted_tokens_total")
        return accepted / counted(server, "vllm:spec_decode_num_draft_tokens_total")

    def proposed(server) -> bool:
        return counted(server, "vllm:spec_decode_num_draft_tokens_total") > 0

    pair = served_pair(tiny_llama_dir, tmp_path, free_port(), *drafted)
    with pair as (prefill, decode, proxy):
        # First through the pair: the producer computes the prompts (a prefix it had cached
        # would have the draft's KV from an earlier step, whatever the sends did).
        answers = greedy(proxy.url, PROMPTS)
        assert wait_until(lambda: remote_hits(decode) > 0 and proposed(decode), 30)
        assert answers == greedy(prefill.url, PROMPTS)  # unmarked: the producer decodes them
        assert wait_until(lambda: proposed(prefill), 30), prefill.log_tail()
        sent = "zllm:kv_transfer_sent_blocks_total"
        assert wait_until(lambda: counted(prefill, sent) > 0, 30), prefill.log_tail()
        # The rates once the heartbeats after the last requests came (a read between two
        # counts the proxy's one-token prefills, whose proposals cannot be accepted).
        drafts = "vllm:spec_decode_num_draft_tokens_total"
        for server in (prefill, decode):
            seen: list[float] = []
            assert wait_until(lambda s=server, seen=seen: seen.append(counted(s, drafts)) or seen[-2:-1] == seen[-1:], 30, 1.0)  # fmt: skip
        assert rate(prefill) > 0.9 and rate(decode) >= rate(prefill) - 0.05, decode.log_tail()
