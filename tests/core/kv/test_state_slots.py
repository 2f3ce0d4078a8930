"""A hybrid model's recurrent-state slots in the core (core/kv/state_slots.py, held by the
block manager): a sequence takes one with its first blocks, all or nothing; gives it back
when it finishes or is preempted; each forked sample gets its own; and the executor hears
each slot with the sequence's blocks (NewRequestData, CachedRequestData, ForkedRequestData)."""

from __future__ import annotations

import pytest
from scheduler_parts import BS, make_request

from zllm.config.engine import SchedulerConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.state_slots import StateSlots, StateSnapshots
from zllm.core.scheduler import Scheduler
from zllm.errors import ParamError
from zllm.kv.state_layout import check_sequences_fit
from zllm.protocol import ModelRunnerOutput
from zllm.sampling_params import SamplingParams


def test_slots_are_taken_lowest_first_and_given_back() -> None:
    slots = StateSlots(3)
    assert [slots.take(s) for s in "abc"] == [0, 1, 2]
    assert slots.take("a") == 0  # its own again
    with pytest.raises(RuntimeError, match="no recurrent-state slot"):
        slots.take("d")
    slots.free("b")
    assert (slots.slot_of("b"), slots.take("d"), slots.num_free) == (-1, 1, 0)


def test_a_sequence_takes_its_slot_with_its_blocks_all_or_nothing() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=False, num_state_slots=2)
    assert bm.allocate_slots("a", list(range(8)), 0, 8)
    assert bm.allocate_slots("b", list(range(4)), 0, 4)
    blocks_before = bm.num_free_blocks
    assert not bm.allocate_slots("c", list(range(4)), 0, 4)  # blocks free, no slot free
    assert bm.num_free_blocks == blocks_before and bm.state_slot("c") == -1
    assert bm.allocate_slots("a", list(range(9)), 8, 1)  # a running sequence keeps its slot
    assert (bm.state_slot("a"), bm.state_slot("b")) == (0, 1)
    # No slot for a fork (a beam group's idle beam yielded its seat): nothing held, it
    # recomputes later (the scheduler's _adopt).
    assert not bm.fork("b", "b1") and bm.num_held_blocks("b1") == 0
    bm.free("a")
    assert bm.state_slot("a") == -1
    assert bm.allocate_slots("c", list(range(4)), 0, 4) and bm.state_slot("c") == 0


def fake_run(sched: Scheduler, so) -> ModelRunnerOutput:
    req_ids, sampled = [], []
    for req_id in so.num_scheduled_tokens:
        req = sched.requests[req_id]
        if req.num_pending_tokens and req.num_computed_tokens == req.num_tokens:
            req_ids.append(req_id)
            sampled.append([7 + i for i in range(so.num_samples.get(req_id, 1))])
    return ModelRunnerOutput(step_id=so.step_id, req_ids=req_ids, sampled_token_ids=sampled)


def hybrid_scheduler(num_blocks: int = 100, max_num_seqs: int = 4) -> Scheduler:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=False, num_state_slots=max_num_seqs)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=1000
    )
    return Scheduler(config, bm)


def test_the_executor_hears_each_slot_and_forks_get_their_own() -> None:
    sched = hybrid_scheduler()
    sched.add_request(make_request("a", 6, n=2, temperature=1.0))
    so = sched.schedule()
    (new,) = so.new_requests
    assert new.state_slot == sched.block_manager.state_slot("a") == 0
    sched.update_from_output(so, fake_run(sched, so))  # the prompt's tokens: a forks
    so = sched.schedule()
    (fork,) = so.forked_requests
    assert fork.state_slot == sched.block_manager.state_slot(fork.req_id) == 1


def test_a_preempted_sequence_gives_its_slot_back_and_hears_its_new_one() -> None:
    """Two sequences in a pool of 6 blocks of 4: the newer is preempted when the older grows,
    frees its slot, and on its return is told its slot again with its blocks."""
    sched = hybrid_scheduler(num_blocks=6)
    sched.add_request(make_request("a", 8, max_tokens=20))
    sched.add_request(make_request("b", 8, max_tokens=20, start=100))
    seen_resumed = False
    for _ in range(60):
        so = sched.schedule()
        for cached in so.cached_requests:
            if cached.resumed:
                seen_resumed = True
                assert cached.state_slot == sched.block_manager.state_slot(cached.req_id) >= 0
        sched.update_from_output(so, fake_run(sched, so))
        held = [sched.block_manager.state_slot(r.req_id) for r in sched.running]
        assert -1 not in held and len(set(held)) == len(held)
        for req in sched.waiting:
            assert sched.block_manager.state_slot(req.req_id) == -1
        if not sched.has_unfinished_requests():
            break
    assert sched.num_preemptions > 0 and seen_resumed
    assert sched.block_manager.state_slots.num_free == 4


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(n=5, temperature=1.0), "n"),
        (SamplingParams(use_beam_search=True, beam_width=5, max_tokens=4), "beam_width"),
    ],
)
def test_more_samples_than_slots_are_refused_naming_the_field(params, field) -> None:
    with pytest.raises(ParamError, match="recurrent state") as e:
        check_sequences_fit(params, 4)
    assert e.value.param == field
    check_sequences_fit(SamplingParams(n=4, temperature=1.0), 4)  # as many: fine


def test_snapshots_are_usable_from_the_next_step_and_the_oldest_goes_first() -> None:
    snapshots = StateSnapshots(2)
    a = snapshots.take(b"a")
    assert snapshots.has(b"a") and not snapshots.ready(b"a")  # written by this step's forward
    snapshots.step_taken()
    assert snapshots.ready(b"a")
    b = snapshots.take(b"b")
    snapshots.step_taken()
    assert snapshots.use(b"a") == a  # a is now the most recently used
    assert snapshots.take(b"c") == b and not snapshots.has(b"b")  # b was the oldest
    snapshots.clear()
    assert len(snapshots) == 0 and not snapshots.has(b"a")


def test_a_prompt_saves_its_state_where_a_later_prompt_can_hit_it(monkeypatch) -> None:
    """At the prompt's last full block before its last token, and at each interval; a hit
    is cut back to the longest cached run that ends at a ready snapshot, which the step
    that admits it copies into the new sequence's slot."""
    from zllm.core.kv import block_manager

    monkeypatch.setattr(block_manager, "SNAPSHOT_INTERVAL", 8)
    bm = BlockManager(64, BS, num_state_slots=4)
    prompt = list(range(100, 121))  # 21 tokens: blocks of 4 end at 4, 8, ..., 20
    assert bm.allocate_slots("a", prompt, 0, 10)
    bm.save_state_at("a", len(prompt), 0, 10)  # passes the interval's 8
    assert bm.allocate_slots("a", prompt, 10, 11)
    bm.save_state_at("a", len(prompt), 10, 11)  # passes 16 (interval) and 20 (the last)
    restores, saves = bm.take_state_work()
    assert restores == [] and [(r, p) for r, p, _ in saves] == [("a", 8), ("a", 20)]
    snapshot_at = {position: snapshot for _, position, snapshot in saves}
    # The same prompt again hits 20 tokens; one that shares 13 tokens hits at 8.
    assert bm.find_cached_prefix(prompt).num_tokens == 20
    other = prompt[:13] + [7] * 8
    hit = bm.find_cached_prefix(other)
    assert hit.num_tokens == 8
    assert bm.allocate_slots("b", other, 8, 13, hit)
    restores, _ = bm.take_state_work()
    assert restores == [(snapshot_at[8], bm.state_slot("b"))]


def test_a_fork_without_a_free_slot_waits_and_recomputes() -> None:
    """A pool of one slot under four seats (as when a beam group's idle beam yielded its
    seat to others): an n = 2 request's sample finds no slot when it forks, so it waits in
    the queue, known to the executor without a slot, and runs from position 0 once the
    other sample's slot is free."""
    bm = BlockManager(100, BS, enable_prefix_caching=False, num_state_slots=1)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1000)
    sched = Scheduler(config, bm)
    sched.add_request(make_request("a", 6, max_tokens=3, n=2, temperature=1.0))
    so = sched.schedule()
    sched.update_from_output(so, fake_run(sched, so))  # the prompt: two samples
    so = sched.schedule()
    (fork,) = so.forked_requests
    assert fork.state_slot == -1 and bm.state_slot(fork.req_id) == -1
    child = sched.requests[fork.req_id]
    assert child in sched.waiting and child.num_computed_tokens == 0
    resumed = []
    for _ in range(20):
        sched.update_from_output(so, fake_run(sched, so))
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        resumed += [c for c in so.cached_requests if c.req_id == fork.req_id and c.resumed]
    assert [(c.num_computed_tokens, c.state_slot) for c in resumed] == [(0, 0)]
    assert not sched.has_unfinished_requests() and bm.state_slots.num_free == 1
