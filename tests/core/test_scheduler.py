"""Scheduler tests with real components at fake sizes and no model."""

from __future__ import annotations

from scheduler_parts import BS, make_request

from zllm.config.engine import SchedulerConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.request import Request, RequestStatus
from zllm.core.scheduler import Scheduler
from zllm.protocol import FinishReason, ModelRunnerOutput, SchedulerOutput
from zllm.sampling_params import SamplingParams


def make_scheduler(num_blocks=100, max_num_seqs=16, budget=64, chunked=True, max_model_len=1000):
    bm = BlockManager(num_blocks, BS)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, bm)


def fake_run(sched: Scheduler, so: SchedulerOutput, token=7) -> ModelRunnerOutput:
    """What an executor returns: a token for each request whose known tokens are all computed
    by this step (run synchronously: the scheduler has marked that token pending)."""
    req_ids, sampled = [], []
    for req_id in so.num_scheduled_tokens:
        req = sched.requests[req_id]
        if req.num_pending_tokens and req.num_computed_tokens == req.num_tokens:
            req_ids.append(req_id)
            sampled.append([token + i for i in range(so.num_samples.get(req_id, 1))])
    return ModelRunnerOutput(step_id=so.step_id, req_ids=req_ids, sampled_token_ids=sampled)


def step(sched: Scheduler, token=7):
    so = sched.schedule()
    outs = sched.update_from_output(so, fake_run(sched, so, token))
    return so, outs


def test_budget_and_chunked_prefill():
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("a", 25))
    sched.add_request(make_request("b", 3, start=100))
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 10}  # a takes the whole budget; b waits
    assert outs == []
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 10}
    so, outs = step(sched)
    # a's last 5 prompt tokens plus b's whole prompt, mixed in one step.
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}
    assert [o.req_id for o in outs] == ["a", "b"]
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}  # two decodes
    assert so.total_num_scheduled_tokens == 2


def test_no_chunking_waits_for_budget():
    sched = make_scheduler(budget=10, chunked=False)
    sched.add_request(make_request("a", 25))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {}


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), 4, start=10 * i))
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["0", "1"]
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_new_then_cached_request_data():
    sched = make_scheduler()
    sched.add_request(make_request("a", 6))
    so, _ = step(sched)
    assert [r.req_id for r in so.new_requests] == ["a"]
    assert so.new_requests[0].block_ids == [[0, 1]]  # one table: one KV cache group
    so, _ = step(sched)  # token 7 lands at position 6 in block 1: no new block
    assert so.new_requests == [] and so.cached_requests[0].block_ids is None
    assert so.cached_requests[0].num_computed_tokens == 6
    step(sched)  # position 7: still block 1
    so, _ = step(sched)  # position 8: needs block 2, so the whole table is sent
    assert so.cached_requests[0].block_ids == [[0, 1, 2]]


def test_finish_on_max_tokens_frees_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=3))
    reasons = []
    for _ in range(3):
        _, outs = step(sched)
        reasons += [o.finish_reason for o in outs]
    assert reasons == [None, None, FinishReason.LENGTH]
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_referenced_blocks() == 0
    so = sched.schedule()
    assert so.finished_req_ids == ["a"]


def test_stop_token_and_eos_and_min_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10, stop_token_ids=[7], min_tokens=2))
    _, outs = step(sched, token=7)
    assert outs[0].finish_reason is None  # min_tokens not reached yet
    _, outs = step(sched, token=7)
    assert outs[0].finish_reason == FinishReason.STOP and outs[0].stop_reason == 7
    sched.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=[9]))
    _, outs = step(sched, token=9)
    assert outs[0].finish_reason == FinishReason.STOP and outs[0].stop_reason is None
    # Every eos id ends a request the same way ("stop", no stop_reason), after min_tokens.
    params = SamplingParams(max_tokens=10, min_tokens=2)
    sched.add_request(Request("c", [1, 2, 3], params, eos_token_ids=[9, 4]))
    _, outs = step(sched, token=4)
    assert outs[0].finish_reason is None
    _, outs = step(sched, token=4)
    assert outs[0].finish_reason == FinishReason.STOP and outs[0].stop_reason is None
    ignoring = SamplingParams(max_tokens=2, ignore_eos=True)
    sched.add_request(Request("d", [1, 2, 3], ignoring, eos_token_ids=[9, 4]))
    step(sched, token=4)
    _, outs = step(sched, token=9)
    assert outs[0].finish_reason == FinishReason.LENGTH


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", 6, max_tokens=None))
    step(sched)
    _, outs = step(sched)
    assert outs[0].finish_reason == FinishReason.LENGTH
    assert sched.requests == {}


def test_max_model_len_bounded_by_pool():
    sched = make_scheduler(num_blocks=3, max_model_len=1000)
    assert sched.max_model_len == 12  # one request alone can always fit


def test_preemption_newest_first():
    # 6 blocks of 4 tokens; three 7-token prompts take 2 blocks each.
    sched = make_scheduler(num_blocks=6, budget=100)
    for name in "abc":
        sched.add_request(make_request(name, 7, max_tokens=20, start=ord(name) * 100))
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["a", "b", "c"]
    assert sched.block_manager.num_free_blocks == 0
    step(sched)  # position 7 fits in each second block
    so, _ = step(sched)  # position 8 needs a third block each
    # a needs a block: c (the newest) is preempted; c's two freed blocks serve a and b.
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert [r.req_id for r in sched.waiting] == ["c"]
    c = sched.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and sched.num_preemptions == 1
    assert c.num_computed_tokens == 0 and c.num_output_tokens == 2


def test_preempted_request_resumes_first_and_recomputes_outputs():
    sched = make_scheduler(num_blocks=4, budget=100)
    sched.add_request(make_request("a", 7, max_tokens=3, start=0))
    sched.add_request(make_request("b", 7, max_tokens=10, start=100))
    step(sched)  # both prefilled, 2 blocks each, each sampled one token
    step(sched)  # position 7
    so, outs = step(sched)  # position 8: a needs a block -> b preempted; a finishes
    assert list(so.num_scheduled_tokens) == ["a"]
    assert outs[0].finish_reason == FinishReason.LENGTH
    b = sched.requests["b"]
    assert b.num_output_tokens == 2
    sched.add_request(make_request("c", 3, start=500))
    so, _ = step(sched)
    # b comes back before c (front of the queue), recomputing prompt + 2 outputs minus its
    # first full block, which is still in the prefix cache.
    assert list(so.num_scheduled_tokens) == ["b", "c"]
    assert so.num_scheduled_tokens["b"] == 9 - 4
    # b is still known to the executor: re-sent as cached data with its new block table.
    assert [r.req_id for r in so.cached_requests] == ["b"]
    assert so.cached_requests[0].block_ids is not None
    assert so.cached_requests[0].num_computed_tokens == 4


def test_no_starvation_under_constant_arrivals():
    sched = make_scheduler(num_blocks=8, max_num_seqs=4, budget=16)
    sched.add_request(make_request("old", 12, max_tokens=6, start=0))
    finished: list[str] = []
    for i in range(60):
        sched.add_request(make_request(f"n{i}", 6, max_tokens=4, start=1000 + 10 * i))
        _, outs = step(sched)
        finished += [o.req_id for o in outs if o.finish_reason is not None]
    while sched.has_unfinished_requests():
        _, outs = step(sched)
        finished += [o.req_id for o in outs if o.finish_reason is not None]
    assert sorted(finished) == sorted(["old"] + [f"n{i}" for i in range(60)])
    # The oldest request is never overtaken for long: it finishes among the first few.
    assert finished.index("old") < 4
    assert sched.block_manager.num_referenced_blocks() == 0


def test_abort_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4, start=10))
    step(sched)
    assert sched.abort_requests(["a", "b", "nope"]) == ["a", "b"]
    assert sched.abort_requests(["a"]) == []  # idempotent
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_referenced_blocks() == 0
    so = sched.schedule()
    assert so.finished_req_ids == ["a"]  # b never reached the executor


def test_n_greater_than_one_forks_after_prefill():
    sched = make_scheduler()
    sched.add_request(make_request("p", 6, max_tokens=3, n=3))
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"p": 6}  # the prompt is computed once
    assert so.num_samples == {"p": 3}  # the scheduler tells the executor to draw 3
    assert sorted((o.sample_index, o.new_token_ids[0]) for o in outs) == [(0, 7), (1, 8), (2, 9)]
    assert all(o.req_id == "p" for o in outs)
    so, outs = step(sched)
    assert so.num_samples == {}  # only the first token is drawn n times
    assert [f.req_id for f in so.forked_requests] == ["p#1", "p#2"]
    assert [(f.parent_req_id, f.sample_index) for f in so.forked_requests] == [
        ("p", 1),
        ("p", 2),
    ]
    assert set(so.num_scheduled_tokens) == {"p", "p#1", "p#2"}
    # Position 6 lands in the shared partial block 1: two copies; the last owner (p#2)
    # writes in place.
    assert so.blocks_to_copy == [(1, 2), (1, 3)]
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.block_manager.num_referenced_blocks() == 0


def test_finish_one_sample_keeps_others():
    sched = make_scheduler()
    sched.add_request(make_request("p", 6, max_tokens=5, n=2))
    step(sched)
    assert sched.finish_sequence("p", 1, FinishReason.STOP)
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["p"]
    assert so.forked_requests == []  # the child ended before the executor heard of it


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, max_tokens=1))
    step(sched)
    sched.add_request(make_request("b", 10, max_tokens=1))
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"b": 2}  # 8 of 10 prompt tokens were cached
    assert outs[0].num_cached_tokens == 8
    bm = sched.block_manager
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)


def _sampled(so: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    ids = [r for r in so.num_scheduled_tokens if r in tokens]
    return ModelRunnerOutput(
        step_id=so.step_id, req_ids=ids, sampled_token_ids=[[tokens[r]] for r in ids]
    )


def test_schedule_next_step_while_one_is_in_flight():
    sched = make_scheduler()
    sched.add_request(make_request("a", 6, max_tokens=3))
    so1 = sched.schedule()  # the prompt; samples token 1
    so2 = sched.schedule()  # sent before so1 returns: computes token 1, unknown to the core
    assert so2.num_scheduled_tokens == {"a": 1}
    assert so2.cached_requests[0].num_computed_tokens == 6
    outs = sched.update_from_output(so1, _sampled(so1, {"a": 7}))
    assert outs[0].new_token_ids == [7]
    so3 = sched.schedule()
    assert so3.num_scheduled_tokens == {"a": 1}
    assert so3.cached_requests[0].num_computed_tokens == 7
    assert sched.update_from_output(so2, _sampled(so2, {"a": 8}))[0].new_token_ids == [8]
    outs = sched.update_from_output(so3, _sampled(so3, {"a": 9}))
    assert outs[0].finish_reason == FinishReason.LENGTH
    assert sched.block_manager.num_referenced_blocks() == 0


def test_request_finishing_while_next_step_in_flight_is_dropped():
    sched = make_scheduler()
    sched.add_request(make_request("a", 6, max_tokens=1))
    so1 = sched.schedule()
    so2 = sched.schedule()  # one wasted token: the core does not know yet that a is done
    assert so2.num_scheduled_tokens == {"a": 1}
    assert sched.update_from_output(so1, _sampled(so1, {"a": 7}))[0].finish_reason is not None
    assert sched.update_from_output(so2, _sampled(so2, {"a": 8})) == []
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == ["a"]


def test_first_output_reports_queue_time():
    sched = make_scheduler(max_num_seqs=1)
    a = make_request("a", 4, max_tokens=2)
    b = make_request("b", 4, max_tokens=2, start=10)
    a.arrival_time = b.arrival_time = 1.0  # long ago
    sched.add_request(a)
    sched.add_request(b)
    _, outs = step(sched)
    assert outs[0].queue_time_s > 1000  # wall-clock seconds since arrival
    _, outs = step(sched)
    assert outs[0].queue_time_s == 0.0  # only on the first output


def test_chunked_n_request_forks_at_the_chunk_that_ends_its_prompt():
    sched = make_scheduler(budget=4)
    sched.add_request(make_request("p", 10, max_tokens=2, n=2))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"p": 4} and so.num_samples == {}
    so, _ = step(sched)
    assert so.num_samples == {}
    so, outs = step(sched)  # the last 2 prompt tokens: this step samples
    assert so.num_scheduled_tokens == {"p": 2} and so.num_samples == {"p": 2}
    assert sorted(o.sample_index for o in outs) == [0, 1]


def test_sample_ids_never_collide_with_client_ids_holding_hashes():
    """Client ids are free-form: "a#1" may be a client's own request while "a" forks."""
    sched = make_scheduler()
    sched.add_request(make_request("a#1", 4, max_tokens=3, start=50))
    sched.add_request(make_request("a", 4, max_tokens=3, n=2))
    step(sched)
    so, _ = step(sched)
    (fork,) = so.forked_requests
    assert fork.parent_req_id == "a" and fork.sample_index == 1
    assert fork.req_id not in ("a", "a#1")
    assert sched.requests["a#1"].client_req_id == "a#1"  # untouched
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.block_manager.num_referenced_blocks() == 0


def running_seqs_per_step(sched: Scheduler) -> list[int]:
    """Run every request to its end; the sequences each step schedules."""
    counts = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        counts.append(len(so.num_scheduled_tokens))
    return counts


def test_max_num_seqs_counts_the_samples_a_request_forks() -> None:
    """Two n=4 requests under max_num_seqs=4: the second waits for the first's samples to
    end (admitted as one sequence, the first would fork past the limit: 1 + 4 + 3)."""
    sched = make_scheduler(max_num_seqs=4)
    sched.add_request(make_request("a", 6, max_tokens=3, n=4))
    sched.add_request(make_request("b", 6, max_tokens=3, n=4, start=100))
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["a"] and sched.num_waiting == 1
    counts = running_seqs_per_step(sched)
    assert max(counts) == 4, counts
    assert sched.block_manager.num_referenced_blocks() == 0


def test_a_chunked_prompt_keeps_the_seats_of_its_samples() -> None:
    """A prompt in chunks has not forked yet: a short request arriving meanwhile does not
    take the seats its samples will need."""
    sched = make_scheduler(max_num_seqs=3, budget=4)
    sched.add_request(make_request("p", 10, max_tokens=2, n=3))
    step(sched)  # the first chunk
    sched.add_request(make_request("q", 2, start=100))
    counts = running_seqs_per_step(sched)
    assert max(counts) == 3, counts


def test_a_request_wider_than_the_batch_runs_alone() -> None:
    """n=6 under max_num_seqs=4 cannot fit: it runs once the batch is empty (over the limit
    by its own samples only) rather than never; the request behind it waits its turn."""
    sched = make_scheduler(max_num_seqs=4)
    sched.add_request(make_request("s", 3, max_tokens=2))
    sched.add_request(make_request("wide", 6, max_tokens=3, n=6, start=100))
    sched.add_request(make_request("t", 3, max_tokens=2, start=200))
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["s"]  # wide waits, and t behind it (FIFO)
    counts = running_seqs_per_step(sched)
    assert 6 in counts and not sched.has_unfinished_requests()


def test_a_beam_search_holds_its_width_from_the_start() -> None:
    """Its first beam forks into beam_width beams after one step: it takes that many seats."""
    sched = make_scheduler(max_num_seqs=4)
    sched.add_request(make_request("beam", 4, max_tokens=3, use_beam_search=True, beam_width=3))
    sched.add_request(make_request("x", 3, max_tokens=2, start=100))
    sched.add_request(make_request("y", 3, max_tokens=2, start=200))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["beam", "x"]  # 3 seats + 1: y waits
    assert sched.num_waiting == 1
