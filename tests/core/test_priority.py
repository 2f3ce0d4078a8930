"""`--scheduling-policy priority` (vLLM's semantics): lower `priority` values are admitted
first, then by arrival; when blocks run out the lowest priority is preempted; under fcfs a
non-zero priority is refused. Scheduler-level order checks, then the offline and served
paths."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from servers import metric, wait_until

from zllm import LLM, SamplingParams
from zllm.config.engine import SchedulerConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.errors import ParamError
from zllm.protocol import ModelRunnerOutput

BS = 4


def make_scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=64, policy=policy
    )
    return Scheduler(config, BlockManager(num_blocks, BS))


def add(sched: Scheduler, req_id: str, priority: int, arrival: float, prompt_len: int = 4):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = list(range(100 * len(sched.requests), 100 * len(sched.requests) + prompt_len))
    sched.add_request(Request(req_id, prompt, params, arrival_time=arrival, priority=priority))


def run(sched: Scheduler, so) -> None:
    """What the executor returns: a token for every request whose known tokens are computed."""
    ids = [
        r
        for r in so.num_scheduled_tokens
        if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
    ]
    out = ModelRunnerOutput(so.step_id, ids, [[7] for _ in ids])
    sched.update_from_output(so, out)


def test_priority_admits_lower_values_first_then_by_arrival() -> None:
    sched = make_scheduler("priority", max_num_seqs=2)
    for req_id, priority, arrival in [("a", 5, 1.0), ("b", 0, 2.0), ("c", 5, 0.5), ("d", 0, 3.0)]:
        add(sched, req_id, priority, arrival)
    assert [r.req_id for r in sched.waiting] == ["b", "d", "c", "a"]
    assert list(sched.schedule().num_scheduled_tokens) == ["b", "d"]


def test_fcfs_keeps_arrival_order() -> None:
    sched = make_scheduler("fcfs", max_num_seqs=2)
    for req_id, arrival in [("a", 1.0), ("b", 2.0), ("c", 3.0)]:
        add(sched, req_id, 0, arrival)
    assert list(sched.schedule().num_scheduled_tokens) == ["a", "b"]


def run_until_preemption(policy: str, requests: list[tuple[str, int]]) -> Scheduler:
    """Three requests of 8-token prompts (name, priority; arriving in order) in 8 blocks of 4
    tokens: their prompts fill 6, and decoding needs more, so one is preempted."""
    sched = make_scheduler(policy, num_blocks=8)
    for arrival, (req_id, priority) in enumerate(requests, start=1):
        add(sched, req_id, priority, float(arrival), prompt_len=8)
    for _ in range(12):
        run(sched, sched.schedule())
        if sched.num_preemptions:
            break
    return sched


def test_priority_preempts_the_lowest_priority_when_blocks_run_out() -> None:
    sched = run_until_preemption("priority", [("low", 9), ("high", 0), ("mid", 5)])
    assert sched.num_preemptions >= 1
    assert sched.requests["low"].status.name == "PREEMPTED"
    assert sched.requests["high"].status.name == "RUNNING"


def test_fcfs_preempts_the_newest() -> None:
    sched = run_until_preemption("fcfs", [("first", 9), ("second", 0), ("third", 5)])
    assert sched.requests["third"].status.name == "PREEMPTED"


def test_offline_priority_needs_the_policy(tiny_llama_dir) -> None:
    plain = LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ParamError, match="scheduling_policy"):
        plain.generate(["a", "b"], params, use_tqdm=False, priority=[1, 0])
    ranked = LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20, scheduling_policy="priority")
    outs = ranked.generate(["a", "b"], params, use_tqdm=False, priority=[1, 0])
    assert [o.outputs[0].text for o in outs] == [
        o.outputs[0].text for o in plain.generate(["a", "b"], params, use_tqdm=False)
    ]


@pytest.mark.e2e
def test_served_priority_jumps_the_queue(tiny_llama_dir, engine_pool, tmp_path) -> None:
    """One sequence at a time: a high-priority request sent behind five low-priority ones
    runs as soon as the running one is done, ahead of the four still waiting.

    The executor is paused (SIGSTOP, far under --executor-timeout) until the core holds all
    six, so the order does not depend on this machine's speed: unpaused, the tiny model
    finishes a 400-token request in ~0.2 s, and CI once saw the high one come 4th after a
    fixed 0.3 s sleep."""
    with engine_pool.serve(
        tiny_llama_dir, tmp_path / "server.log", "--scheduling-policy", "priority",
        "--max-num-seqs", "1",
    ) as server:  # fmt: skip
        executor = server.children()["executor"]
        finished: list[str] = []

        def send(name: str, priority: int) -> None:
            body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "priority": priority}
            r = server.post("/v1/completions", body, timeout=120)
            assert r.status_code == 200, r.text
            finished.append(name)

        def queued() -> tuple[float, float]:
            """(running, waiting) in the core, from its heartbeat."""
            text = server.get("/metrics").text
            return (
                metric(text, "vllm:num_requests_running"),
                metric(text, "vllm:num_requests_waiting"),
            )

        os.kill(executor, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(6) as pool:
                lows = [pool.submit(send, f"low{i}", 10) for i in range(5)]
                assert wait_until(lambda: queued() == (1, 4), 20), queued()
                high = pool.submit(send, "high", -5)
                assert wait_until(lambda: queued() == (1, 5), 20), queued()
                os.kill(executor, signal.SIGCONT)
                for f in [*lows, high]:
                    f.result()
        finally:
            os.kill(executor, signal.SIGCONT)
        # The low running when the high one came finishes first; the high one runs next.
        assert finished.index("high") == 1, finished


@pytest.mark.e2e
def test_served_priority_under_fcfs_is_a_400(tiny_llama_dir, engine_pool, tmp_path) -> None:
    with engine_pool.serve(tiny_llama_dir, tmp_path / "server.log") as server:
        r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 0})
        assert ok.status_code == 200
