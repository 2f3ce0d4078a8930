"""Pipeline stages with the KV tiers whose loads can fail (the disk tier) and with KV
transfers (issue 38): a hit that loads from such a tier is prefetched in a step of its own,
single-group models too (core/kv/prefetch.py), so no stage computes on a block whose load
may fail; each stage loads its own layers' part and ORs its failures into a mask that goes
down the pipeline with the step (executor/ranks/pipeline_stage.py); the last stage reports the
union.

The scheduler's flow as an executable spec, the mask across stages over an in-memory
pipeline, then engines: 2 stages keep a disk tier each (a prefix comes back; a block
damaged on one stage only is recomputed), and a prefill/decode pair of 2-stage servers
behind `zllm proxy`."""

from __future__ import annotations

import collections

import pytest
import torch
from kv_tiers import tiered_connector
from servers import wait_until

from zllm import LLM, SamplingParams
from zllm.config.engine import SchedulerConfig
from zllm.config.kv_layout import tier_directory
from zllm.config.kv_transfer import KVTransferConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.connector import TieredKVConnector
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.executor.parallel.pipeline_stage import PipelineStage, failed_loads, failure_mask
from zllm.kv.block_hash import hash_full_blocks
from zllm.kv.tiers import TIER_CPU, TIER_DISK, TIER_REMOTE, block_file_name
from zllm.protocol import KVTransferParams, ModelRunnerOutput

BS = 4
PROMPT = list(range(50, 63))  # 13 tokens: 3 full blocks a hit can take
HASHES = hash_full_blocks(PROMPT[:12], BS)
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


# ---- the core: one group, two stages -----------------------------------------------------------
def staged_scheduler(disk: tuple[int, ...] = (0, 1, 2), cpu: tuple[int, ...] = ()) -> Scheduler:
    """Two stages, one KV cache group, an empty pool; the disk tier holds the prompt's
    blocks `disk`, the cpu tier its blocks `cpu`."""
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, pipeline_stages=2
    )
    bm = BlockManager(16, BS, record_evictions=True)
    kv = tiered_connector(cpu_blocks=4, disk_blocks=16)
    for i in disk:
        kv.tiers[TIER_DISK].add(HASHES[i], set())
    for i in cpu:
        kv.tiers[TIER_CPU].add(HASHES[i], set())
    return Scheduler(config, bm, kv_connector=kv)


def test_with_stages_a_disk_hit_is_prefetched_in_a_step_of_its_own():
    """The disk tier's blocks load in a step in which the request computes nothing (no
    other request either: the step carries only the loads); while it is out the request
    is passed over, then admitted through the lookup with the pool holding them."""
    sched = staged_scheduler()
    bm, kv = sched.block_manager, sched.kv.tiers
    sched.add_request(Request("c", PROMPT, ONE_TOKEN))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {} and not so.new_requests
    assert so.kv_transfers.loads == [(TIER_DISK, HASHES[i], i) for i in range(3)]
    assert all(bm.pool.blocks[b].block_hash is None for b in range(3))  # not a hit for anyone yet
    ahead = sched.schedule()  # while the prefetch is out (a pipeline holds P steps)
    assert ahead.num_scheduled_tokens == {} and ahead.kv_transfers is None
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, [], []))
    so = sched.schedule()
    (new,) = so.new_requests
    assert so.num_scheduled_tokens == {"c": 1} and so.kv_transfers is None
    assert new.num_computed_tokens == 12 and new.block_ids == [[0, 1, 2, 3]]
    c = sched.requests["c"]
    assert c.num_cached_tokens == 12 and c.num_steps_in_flight == 1
    assert kv.hit_tokens == [0, 12, 0] and bm.prefix_cache_hits == 0  # a block counts once


def test_with_stages_a_failed_load_gives_a_shorter_hit_and_cpu_loads_go_with_the_compute():
    """Block 1's load failed on some stage: forgotten, never cached; the re-admission's hit
    stops before it. The cpu tier's loads (which cannot fail) are no prefetch: they go in
    the admitting step."""
    sched = staged_scheduler()
    kv = sched.kv.tiers
    sched.add_request(Request("c", PROMPT, ONE_TOKEN))
    so = sched.schedule()
    failed = [(TIER_DISK, HASHES[1])]
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, [], [], kv_load_failed=failed))
    assert kv.load_failures == [0, 1, 0] and HASHES[1] not in kv.tiers[TIER_DISK]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"c": 9} and so.new_requests[0].num_computed_tokens == 4
    assert sched.requests["c"].num_cached_tokens == 4

    cpu_only = staged_scheduler(disk=(), cpu=(0, 1))
    cpu_only.add_request(Request("d", PROMPT, ONE_TOKEN))
    so = cpu_only.schedule()
    assert so.num_scheduled_tokens == {"d": 5} and so.new_requests[0].num_computed_tokens == 8
    assert so.kv_transfers.loads == [(TIER_CPU, HASHES[0], 0), (TIER_CPU, HASHES[1], 1)]


def test_one_stage_still_recomputes_a_failed_disk_load_in_its_step():
    """Without stages nothing changes: the disk tier's blocks after the pool's hit load in
    the step that computes the request (a failure is recomputed there)."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    kv = tiered_connector(disk_blocks=16)
    for h in HASHES:
        kv.tiers[TIER_DISK].add(h, set())
    sched = Scheduler(config, BlockManager(16, BS, record_evictions=True), kv_connector=kv)
    sched.add_request(Request("c", PROMPT, ONE_TOKEN))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"c": 1} and len(so.kv_transfers.loads) == 3


def test_a_staged_consumer_waits_for_every_ranks_part_then_prefetches():
    """A consumer of 2 stages x 2 tensor-parallel ranks: a block is held once all four
    ranks have their part; then the hit loads in a step of its own."""
    transfer = KVTransferConfig(role="kv_consumer", buffer_bytes=64, wait_timeout_s=60.0)
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, pipeline_stages=2
    )
    kv = TieredKVConnector(None, block_bytes=1, remote_bytes=64, remote_ranks=4)
    sched = Scheduler(config, BlockManager(16, BS), kv_connector=kv, kv_transfer=transfer)
    params = KVTransferParams(do_remote_prefill=True)
    sched.add_request(Request("c", PROMPT, ONE_TOKEN, kv_transfer=params))
    for rank in range(3):
        kv.received(HASHES, [], rank)
    assert sched.schedule().num_scheduled_tokens == {}  # rank 3's parts are yet to come
    assert len(kv.tiers[TIER_REMOTE]) == 0
    kv.received(HASHES, [], 3)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {} and not so.new_requests
    assert so.kv_transfers.loads == [(TIER_REMOTE, h, i) for i, h in enumerate(HASHES)]
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, [], []))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"c": 1} and so.new_requests[0].num_computed_tokens == 12
    assert kv.hit_tokens == [0, 0, 12] and sched.kv.num_wait_timeouts == 0


# ---- the failure mask down the pipeline ---------------------------------------------------------
class FakeStages:
    """The stages' point-to-point channels in memory: what stage s sends, stage s + 1
    receives, in order (as gloo and NCCL match a pair's messages)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues = [collections.deque() for _ in range(size)]  # into stage s

    def stage(self, s: int) -> PipelineStage:
        stages = self

        class Link:
            stage, size = s, stages.size
            is_first, is_last, enabled = s == 0, s == stages.size - 1, True

            @staticmethod
            def send(tensors):
                stages.queues[s + 1].extend(t.clone() for t in tensors)
                return [Done() for _ in tensors]

            @staticmethod
            def recv(shapes, dtypes, device):
                got = [stages.queues[s].popleft() for _ in shapes]
                assert [tuple(t.shape) for t in got] == [tuple(x) for x in shapes]
                assert [t.dtype for t in got] == list(dtypes)
                return got

        return PipelineStage(Link(), 8, torch.float32, torch.device("cpu"))


class Done:
    def wait(self) -> None:
        pass


LOADS = [(TIER_DISK, 11, 0), (TIER_DISK, 12, 1), (TIER_REMOTE, 13, 2), (TIER_DISK, 12, 3)]


def test_the_failure_mask_marks_this_stages_failed_loads():
    mask = failure_mask(LOADS, [(TIER_DISK, 12, 3), (TIER_REMOTE, 13, 2)], torch.device("cpu"))
    assert mask.tolist() == [0, 0, 1, 1]
    # A hash loaded into two blocks is reported once, in load order.
    assert failed_loads(LOADS, torch.tensor([0, 1, 1, 1])) == [(TIER_DISK, 12), (TIER_REMOTE, 13)]
    assert failed_loads([], failure_mask([], [], torch.device("cpu"))) == []


@pytest.mark.parametrize("with_stream", [True, False], ids=["with-the-stream", "alone"])
def test_the_last_stage_reports_every_stages_failures(with_stream):
    """Three stages, each failing one load (stage 1 none): the last reports the union, with
    the residual stream of a step that computes, or alone in a step that does not."""
    pipeline = FakeStages(3)
    own = [[LOADS[0]], [], [LOADS[2]]]
    reported = None
    for s in range(3):
        stage = pipeline.stage(s)
        stage.loads_failed(LOADS, own[s])
        if with_stream:
            stream = stage.receive(torch.zeros(2, dtype=torch.long), lambda ids: torch.ones(2, 8))
            hidden, _ = stage.send(stream, 0.0, 0.0)
            assert (hidden is None) == (s < 2)
        else:
            stage.pass_failures()
        if s == 2:
            reported = stage.failed_loads()
    assert reported == [(TIER_DISK, 11), (TIER_REMOTE, 13)]
    assert not any(pipeline.queues)  # every stage took what the one before sent


def test_a_step_without_loads_sends_no_mask():
    pipeline = FakeStages(2)
    first, last = pipeline.stage(0), pipeline.stage(1)
    for stage in (first, last):
        stage.loads_failed([], [])
    first.pass_failures()
    assert not pipeline.queues[1]  # nothing exchanged in a step with neither stream nor loads
    first.send(first.receive(torch.zeros(1, dtype=torch.long), lambda ids: torch.ones(1, 8)), 0, 0)
    assert len(pipeline.queues[1]) == 2  # the stream and the times table, as before
    last.receive(torch.zeros(1, dtype=torch.long), None)
    assert last.failed_loads() == []


# ---- engines: two stages, a disk tier each ------------------------------------------------------
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FIRST = {"prompt_token_ids": list(range(5, 45))}  # 10 blocks of 4
OTHERS = [{"prompt_token_ids": list(range(100 + 50 * i, 140 + 50 * i))} for i in range(3)]
FRESH = {"prompt_token_ids": list(range(300, 310))}  # 3 blocks: beside the 9 prefetched


@pytest.fixture(scope="module")
def one_rank(tiny_llama_dir) -> tuple[list[int], list[int]]:
    """One rank's greedy tokens for FIRST and FRESH."""
    outs = LLM(tiny_llama_dir, kv_cache_memory_bytes=32 << 20).generate(
        [FIRST, FRESH], PARAMS, use_tqdm=False
    )
    return outs[0].outputs[0].token_ids, outs[1].outputs[0].token_ids


def staged_with_disk(tiny_llama_dir, tmp_path, tp: int = 1) -> LLM:
    """2 stages (of `tp` ranks each), a pool of 16 blocks, a disk tier: FIRST is computed,
    then OTHERS push its blocks out of the pool to every rank's directory."""
    llm = LLM(
        tiny_llama_dir,
        pipeline_parallel_size=2,
        tensor_parallel_size=tp,
        block_size=4,
        num_gpu_blocks_override=16,
        kv_offload_dir=str(tmp_path / "tier"),
    )
    llm.generate(FIRST, PARAMS, use_tqdm=False)
    for prompt in OTHERS:
        llm.generate(prompt, PARAMS, use_tqdm=False)
    return llm


def block_files(llm: LLM, rank: int) -> list:
    hashes = hash_full_blocks(FIRST["prompt_token_ids"], BS)
    return [tier_directory(llm.config, rank) / block_file_name(h) for h in hashes]


def test_two_stages_keep_a_disk_tier_each_and_load_a_prefix_back(
    tiny_llama_dir, tmp_path, one_rank
):
    """Each stage writes its layers' part of an evicted block to a directory of its own
    (rank-0, rank-1); asked again, the prefix comes back from the disk (a prefetch step,
    then a pool hit) with one rank's outputs."""
    llm = staged_with_disk(tiny_llama_dir, tmp_path)
    files = block_files(llm, 0) + block_files(llm, 1)
    assert wait_until(lambda: all(f.exists() for f in files[:9] + files[10:19]), 10)
    assert files[0].parent.name == "rank-0" and files[10].parent.name == "rank-1"
    again = llm.generate(FIRST, PARAMS, use_tqdm=False)[0]
    stats = llm.engine.heartbeat().kv_tiers
    assert again.outputs[0].token_ids == one_rank[0]
    assert again.num_cached_tokens == 36
    assert stats.hits[TIER_DISK] > 0 and stats.load_failures == [0, 0, 0], stats


@pytest.mark.parametrize(
    "victim, with_fresh, tp",
    [(0, False, 1), (1, False, 1), (0, True, 1), (1, True, 2)],
    ids=[
        "first-stage-alone",
        "last-stage-alone",
        "first-stage-beside-a-computing-request",
        "2x2-ranks-the-first-stages-second-rank",
    ],
)
def test_a_block_damaged_on_one_stage_is_recomputed(
    tiny_llama_dir, tmp_path, one_rank, victim, with_fresh, tp
):
    """One rank's part of the prompt's third block is damaged: its load fails there only,
    the mask brings that down the pipeline (alone in a step that only loads, or with the
    stream of a request computing beside the prefetch; with 2 x 2 ranks the first stage's
    ranks first take the union of theirs), the core counts the failure and the request
    computes from that block: one rank's tokens."""
    llm = staged_with_disk(tiny_llama_dir, tmp_path, tp)
    files = block_files(llm, victim)
    assert wait_until(lambda: all(f.exists() for f in files[:9]), 10)
    data = bytearray(files[2].read_bytes())
    data[-1] ^= 0x01
    files[2].write_bytes(bytes(data))
    prompts = [FIRST, FRESH] if with_fresh else [FIRST]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == list(one_rank[: len(prompts)])
    assert outs[0].num_cached_tokens == 8  # the hit stopped before the damaged block
    stats = llm.engine.heartbeat().kv_tiers
    assert stats.load_failures[TIER_DISK] == 1, stats


# ---- a served pair: two stages on both sides ----------------------------------------------------
@pytest.mark.e2e
def test_a_pipeline_parallel_pair_sends_each_stages_layers(tiny_llama_dir, tmp_path):
    """Both servers with --pipeline-parallel-size 2: producer stage s sends its layers' part
    of each prompt block, after its forward, to consumer stage s (kv_port + s). Through
    the proxy the greedy answers equal the producer's own, and the consumer loaded every
    full prompt block from the transfer (held once both stages had their part, loaded in
    a prefetch step), with no wait timing out."""
    from disagg_pairs import (
        PROMPTS,
        assert_pair_answers_as_one_server,
        free_port_range,
        served_pair,
    )
    from servers import metric

    pp2 = ("--pipeline-parallel-size", "2")
    with served_pair(tiny_llama_dir, tmp_path, free_port_range(2), *pp2) as pair:
        text = assert_pair_answers_as_one_server(*pair, PROMPTS[:2])
        assert metric(text, "zllm:kv_offload_load_failures_total", 'tier="remote"') == 0
