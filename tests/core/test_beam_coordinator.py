"""BeamCoordinator's rules through a real Scheduler and BlockManager at fake sizes: which
beams continue, fork or end each round, what the executor is told, and what is freed."""

from __future__ import annotations

from zllm.config.engine import SchedulerConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.protocol import (
    FinishReason,
    ForkedRequestData,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from zllm.sampling_params import BeamSearchParams

BS = 4
EOS = 0


def make_scheduler() -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, BlockManager(32, BS))


def add_beam_request(sched: Scheduler, width: int = 2, max_tokens: int = 3) -> None:
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens).to_sampling_params()
    prompt = list(range(1, 9))  # two full blocks
    sched.add_request(Request("b", prompt, params, eos_token_ids=[EOS]))


def report(so: SchedulerOutput, candidates: dict[str, list[tuple[int, float]]]):
    """The executor's answer: each beam's sampled token, then its candidates."""
    req_ids = list(candidates)
    logprobs = [
        LogprobsLists(
            token_ids=[[candidates[r][0][0]] + [t for t, _ in candidates[r]]],
            logprobs=[[candidates[r][0][1]] + [lp for _, lp in candidates[r]]],
            ranks=[1],
        )
        for r in req_ids
    ]
    return ModelRunnerOutput(
        step_id=so.step_id,
        req_ids=req_ids,
        sampled_token_ids=[[candidates[r][0][0]] for r in req_ids],
        logprobs=logprobs,
    )


def running_ids(sched: Scheduler) -> list[tuple[str, float]]:
    return [(beam.req_id, round(cum, 6)) for beam, cum in sched.beams.groups["b"].running]


def test_a_round_forks_the_beam_continued_twice_and_shares_its_blocks() -> None:
    sched = make_scheduler()
    add_beam_request(sched)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 8}
    cands = [(10, -0.1), (11, -0.5), (12, -3.0), (13, -4.0)]
    assert sched.update_from_output(so, report(so, {"b": cands})) == []
    assert running_ids(sched) == [("b", -0.1), ("b#1", -0.5)]
    assert sched.requests["b"].output_token_ids == [10]
    assert sched.requests["b#1"].output_token_ids == [11]
    bm = sched.block_manager
    assert bm.block_ids("b#1")[:2] == bm.block_ids("b")[:2]  # the prompt, shared
    so = sched.schedule()
    assert so.beam_tokens == {"b": 10}
    assert so.forked_requests == [
        ForkedRequestData(req_id="b#1", parent_req_id="b", sample_index=0, first_token_id=11)
    ]
    assert so.num_scheduled_tokens == {"b": 1, "b#1": 1}
    assert sched.schedule().beam_tokens == {}  # sent once


def test_a_beam_no_candidate_continues_ends_and_frees_its_blocks() -> None:
    sched = make_scheduler()
    add_beam_request(sched)
    so = sched.schedule()
    sched.update_from_output(so, report(so, {"b": [(10, -0.1), (11, -0.5), (12, -3), (13, -4)]}))
    so = sched.schedule()
    first_report = {"b": [(30, -0.1), (31, -0.2), (32, -5.0), (33, -6.0)]}
    # One beam has reported: nothing happens until its sibling has too.
    assert sched.update_from_output(so, report(so, first_report)) == []
    assert sched.beams.is_idle(sched.requests["b"])
    assert not sched.beams.is_idle(sched.requests["b#1"])
    so2 = sched.schedule()
    assert so2.num_scheduled_tokens == {}  # b is idle, b#1's token is computed
    sibling = {"b#1": [(40, -3.0), (41, -4.0), (42, -5.0), (43, -6.0)]}
    sched.update_from_output(so2, report(so2, sibling))
    # b's two candidates are the best two: b#1 ends, b continues and forks b#2.
    assert running_ids(sched) == [("b", -0.2), ("b#2", -0.3)]
    assert "b#1" not in sched.requests
    assert sched.requests["b#2"].output_token_ids == [10, 31]
    so = sched.schedule()
    assert so.finished_req_ids == ["b#1"]
    assert so.beam_tokens == {"b": 30}
    assert [f.req_id for f in so.forked_requests] == ["b#2"]
    assert so.forked_requests[0].num_parent_outputs == 1


def test_the_length_limit_finishes_the_group_with_its_best_hypotheses() -> None:
    sched = make_scheduler()
    add_beam_request(sched, max_tokens=2)
    so = sched.schedule()
    sched.update_from_output(so, report(so, {"b": [(10, -0.1), (11, -0.5), (12, -3), (13, -4)]}))
    so = sched.schedule()
    outs = sched.update_from_output(
        so,
        report(
            so,
            {
                "b": [(20, -1.0), (21, -2.0), (22, -5.0), (23, -6.0)],
                "b#1": [(24, -0.1), (25, -3.0), (26, -5.0), (27, -6.0)],
            },
        ),
    )
    assert [(o.sample_index, o.new_token_ids, o.finish_reason) for o in outs] == [
        (0, [11, 24], FinishReason.LENGTH),
        (1, [10, 20], FinishReason.LENGTH),
    ]
    assert [round(o.cumulative_logprob, 6) for o in outs] == [-0.6, -1.1]
    assert not sched.has_unfinished_requests()
    assert sched.beams.groups == {}
    assert sched.block_manager.num_referenced_blocks() == 0
    assert sorted(sched.schedule().finished_req_ids) == ["b", "b#1"]


def test_abort_ends_every_beam_and_drops_the_group() -> None:
    sched = make_scheduler()
    add_beam_request(sched)
    so = sched.schedule()
    sched.update_from_output(so, report(so, {"b": [(10, -0.1), (11, -0.5), (12, -3), (13, -4)]}))
    assert sched.abort_requests(["b"]) == ["b"]
    assert sched.beams.groups == {} and sched.requests == {}
    assert sched.block_manager.num_referenced_blocks() == 0
    so = sched.schedule()
    assert so.beam_tokens == {} and so.forked_requests == []  # nothing unsent goes out
