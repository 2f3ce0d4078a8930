"""Tenants and `--scheduling-policy fair` at the scheduler: the ledger's counters, which
requests are admitted and preempted (exact ids), weights, blocks, and no ping-pong. Real
scheduler and block manager at fake sizes, no model; the served starvation test is in
tests/test_tenants.py."""

from __future__ import annotations

import pytest

from zllm.config.engine import SchedulerConfig
from zllm.core.fair_share import FairShare, TenantLedger
from zllm.core.kv.block_manager import BlockManager
from zllm.core.request import Request, RequestStatus
from zllm.core.scheduler import Scheduler
from zllm.protocol import CacheSize, ModelRunnerOutput, SchedulerOutput
from zllm.sampling_params import SamplingParams

BS = 4


def make_scheduler(
    policy: str = "fair",
    max_num_seqs: int = 4,
    num_blocks: int = 200,
    budget: int = 256,
    weights: dict[str, float] | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=256,
        policy=policy,
        tenant_weights=weights or {},
    )
    return Scheduler(config, BlockManager(num_blocks, BS))


_arrivals = iter(range(1, 1_000_000))


def add(
    sched: Scheduler,
    req_id: str,
    tenant: str,
    prompt_len: int = 8,
    max_tokens: int = 50,
    priority: int = 0,
) -> None:
    start = 1000 * next(_arrivals)  # distinct prompts: no prefix-cache hits between them
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(start, start + prompt_len))
    sched.add_request(
        Request(req_id, prompt, params, arrival_time=float(start), tenant=tenant, priority=priority)
    )


def step(sched: Scheduler) -> SchedulerOutput:
    """Schedule a step and answer it as an executor would: one token for each request whose
    known tokens the step completes."""
    so = sched.schedule()
    ids = [
        r
        for r in so.num_scheduled_tokens
        if sched.requests[r].num_pending_tokens
        and sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
    ]
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, ids, [[7] for _ in ids]))
    return so


def running_ids(sched: Scheduler, tenant: str) -> set[str]:
    return {r.req_id for r in sched.running if r.tenant == tenant}


# ---- the ledger ------------------------------------------------------------------------------


def test_ledger_weighs_tokens_and_lifts_a_tenant_back_from_idle() -> None:
    ledger = TenantLedger({"big": 4.0})
    ledger.arrive("big")
    ledger.arrive("small")
    ledger.charge("big", 400)
    ledger.charge("small", 300)
    assert ledger["big"].served == 100.0 and ledger["small"].served == 300.0
    ledger.depart("small")
    ledger.charge("big", 1600)  # big alone for a while: served 500
    ledger.arrive("small")  # back: starts at the lowest active counter, no credit banked
    assert ledger["small"].served == 500.0
    ledger.depart("small")
    ledger.arrive("small")  # back again at once: keeps its own (higher) counter
    assert ledger["small"].served == 500.0 and ledger["small"].num_requests == 3
    assert ledger["big"].num_computed_tokens == 2000


def test_ledger_forgets_the_least_recently_active_idle_tenants() -> None:
    ledger = TenantLedger({}, max_idle=2)
    ledger.arrive("busy")  # never departs: kept whatever the bound
    for name in ["t1", "t2", "t3", "t4"]:
        ledger.arrive(name)
        ledger.depart(name)
    ledger.arrive("t5")
    assert list(ledger.tenants) == ["busy", "t3", "t4", "t5"]


def test_the_ledger_keeps_its_bound_when_tenants_go_idle_too() -> None:
    """At most max_idle idle tenants after every change (departures too, not only at the next
    arrival), beside the active ones: the bound /metrics shows (zllm:cache_capacity)."""
    ledger = TenantLedger({}, max_idle=2)
    for name in ["a", "b", "c"]:
        ledger.arrive(name)
    assert ledger.cache_size() == CacheSize("core", "tenant_ledger", 3, 2 + 3)
    for name in ["a", "b", "c"]:
        ledger.depart(name)
        size = ledger.cache_size()
        assert size.capacity is not None and size.entries <= size.capacity, size
    assert list(ledger.tenants) == ["b", "c"]  # a, the least recently active, forgotten
    assert ledger.cache_size() == CacheSize("core", "tenant_ledger", 2, 2)


# ---- admission and preemption ----------------------------------------------------------------


def test_newcomer_gets_its_share_at_once_from_the_newest_of_the_flooding_tenant() -> None:
    sched = make_scheduler(max_num_seqs=4)
    for i in range(10):
        add(sched, f"a{i}", "A")
    step(sched)
    step(sched)
    assert running_ids(sched, "A") == {"a0", "a1", "a2", "a3"}
    add(sched, "b0", "B")
    add(sched, "b1", "B")
    add(sched, "b2", "B")
    so = step(sched)
    # B is owed 2 of the 4 slots: A's two newest yield them, and B's first two run now.
    assert sched.requests["a3"].status == RequestStatus.PREEMPTED
    assert sched.requests["a2"].status == RequestStatus.PREEMPTED
    assert set(so.num_scheduled_tokens) == {"a0", "a1", "b0", "b1"}
    assert so.num_scheduled_tokens["b0"] == 8
    assert sched.num_preemptions == 2
    for _ in range(20):  # both at their share: nobody is preempted again
        step(sched)
    assert sched.num_preemptions == 2
    assert running_ids(sched, "B") == {"b0", "b1"}


def test_fcfs_makes_the_newcomer_wait_behind_the_flood() -> None:
    sched = make_scheduler("fcfs", max_num_seqs=4)
    for i in range(10):
        add(sched, f"a{i}", "A")
    step(sched)
    add(sched, "b0", "B")
    for _ in range(20):
        so = step(sched)
        assert "b0" not in so.num_scheduled_tokens
    assert sched.num_preemptions == 0


def test_a_tenant_with_fewer_requests_than_its_share_leaves_the_rest_to_others() -> None:
    sched = make_scheduler(max_num_seqs=4)
    for i in range(10):
        add(sched, f"a{i}", "A")
    step(sched)
    add(sched, "b0", "B")
    step(sched)
    assert running_ids(sched, "B") == {"b0"}
    assert len(running_ids(sched, "A")) == 3 and sched.num_preemptions == 1


def test_weights_split_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=8, weights={"gold": 3.0})
    for i in range(12):
        add(sched, f"s{i}", "silver")
    step(sched)
    for i in range(12):
        add(sched, f"g{i}", "gold")
    for _ in range(5):
        step(sched)
    assert len(running_ids(sched, "gold")) == 6 and len(running_ids(sched, "silver")) == 2
    stats = {t.name: t for t in sched.tenant_stats()}
    assert stats["gold"].weight == 3.0 and stats["gold"].num_running == 6
    assert stats["silver"].num_waiting == 10 and stats["silver"].num_preemptions == 6


def test_free_slots_go_to_the_least_served_tenant_first() -> None:
    sched = make_scheduler(max_num_seqs=2)
    add(sched, "a0", "A", max_tokens=3)
    add(sched, "a1", "A", max_tokens=40)
    step(sched)
    for i in range(2, 5):
        add(sched, f"a{i}", "A")
    add(sched, "b0", "B", max_tokens=3)
    add(sched, "b1", "B")
    step(sched)  # B is owed 1 slot: a1, A's newest running, yields it to b0
    assert running_ids(sched, "B") == {"b0"}
    while "b0" in sched.requests:
        step(sched)
    # b0 done: the free slot goes to B again (below its share, and less served), not to A.
    step(sched)
    assert running_ids(sched, "B") == {"b1"}


def test_a_tenant_short_of_blocks_gets_them_from_the_over_served_one() -> None:
    # 12 blocks of 4 tokens, room for 8 sequences: blocks, not slots, are what run out.
    sched = make_scheduler(max_num_seqs=8, num_blocks=12)
    for i in range(6):
        add(sched, f"a{i}", "A", prompt_len=7)
    step(sched)
    step(sched)
    assert len(running_ids(sched, "A")) == 6
    add(sched, "b0", "B", prompt_len=16)  # needs 5 blocks; 0 are free
    for _ in range(6):
        step(sched)
        if "b0" in running_ids(sched, "B"):
            break
    assert running_ids(sched, "B") == {"b0"}
    assert sched.tenants["A"].num_preemptions >= 1
    assert sched.tenants["B"].num_preemptions == 0


def test_priority_orders_requests_within_a_tenant() -> None:
    sched = make_scheduler(max_num_seqs=2)
    add(sched, "a-low", "A", priority=5)
    add(sched, "b-low", "B", priority=5)
    add(sched, "a-high", "A", priority=-1)
    # One slot each: A's is its higher-priority request, though it came later.
    assert set(step(sched).num_scheduled_tokens) == {"a-high", "b-low"}


def test_ledger_counts_what_each_tenant_was_served() -> None:
    sched = make_scheduler("fcfs", max_num_seqs=4)
    add(sched, "a0", "A", prompt_len=8, max_tokens=5)
    add(sched, "b0", "B", prompt_len=12, max_tokens=3)
    for _ in range(10):
        step(sched)
    assert not sched.has_unfinished_requests()
    a, b = sched.tenants["A"], sched.tenants["B"]
    # The prompt, then a decode of each generated token but the last.
    assert (a.num_computed_tokens, a.num_generation_tokens) == (8 + 4, 5)
    assert (b.num_computed_tokens, b.num_generation_tokens) == (12 + 2, 3)
    assert a.num_active == 0 and a.num_requests == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_other_policies_never_preempt_for_fairness(policy: str) -> None:
    sched = make_scheduler(policy, max_num_seqs=4)
    for i in range(6):
        add(sched, f"a{i}", "A")
    step(sched)
    add(sched, "b0", "B")
    step(sched)
    assert sched.num_preemptions == 0 and not running_ids(sched, "B")


def test_a_blocked_tenant_never_yields_its_own_blocks_to_itself() -> None:
    """Slots free, blocks short: only another tenant above its share of the pool yields."""
    ledger = TenantLedger({})
    fair = FairShare(ledger, max_num_seqs=4)
    params = SamplingParams(max_tokens=4)
    b_long = Request("b-long", [1] * 8, params, arrival_time=1.0, tenant="B")
    a_short = Request("a-short", [2] * 8, params, arrival_time=2.0, tenant="A")
    b_waiting = Request("b-next", [3] * 8, params, arrival_time=3.0, tenant="B")
    for name in ("A", "B", "B"):
        ledger.arrive(name)
    ledger.charge("B", 100)  # B is the most served and holds most of the pool
    blocks = {"b-long": 9, "a-short": 1}
    held = blocks.__getitem__  # the blocks each request holds, by its id
    fair.begin_step([b_long, a_short], [b_waiting])
    fair.blocked = b_waiting  # B runs 1 of its 2 slots; its next request did not fit
    assert fair.victims([b_long, a_short], 2, held, num_blocks=10) == []
    blocks["a-short"] = 6  # now A holds more than its half of the pool: A yields
    fair.begin_step([b_long, a_short], [b_waiting])
    fair.blocked = b_waiting
    assert fair.victims([b_long, a_short], 2, held, num_blocks=10) == [a_short]
