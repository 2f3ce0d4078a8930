"""EngineCore's rules with a fake executor and no sockets: what is admitted or refused, which
detokenizer worker hears what and in which order, aborts, dead clients, and statistics."""

from __future__ import annotations

import pytest

from zllm.config.engine import CacheConfig, EngineConfig, SchedulerConfig
from zllm.core.engine_core import EngineCore
from zllm.errors import ParamError
from zllm.model.arch_config import ModelArchConfig
from zllm.protocol import (
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    RequestOptions,
    RequestRejected,
    SchedulerOutput,
)
from zllm.runtime.messaging import detokenizer_index
from zllm.sampling_params import SamplingParams

VOCAB = 100
BLOCK_SIZE = 4
WORKERS = 2


def make_engine(
    num_blocks: int = 64, max_model_len: int = 64, pipeline_stages: int = 1
) -> EngineCore:
    arch = ModelArchConfig(
        architecture="llama",
        family="llama",
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=max_model_len,
        tie_word_embeddings=True,
    )
    config = EngineConfig(
        model="fake",
        model_path="/nowhere",
        arch=arch,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64,
            max_model_len=max_model_len,
            pipeline_stages=pipeline_stages,
        ),
        pipeline_parallel_size=pipeline_stages,
    )
    return EngineCore(config, num_detokenizers=WORKERS)


def request(req_id: str, prompt_len: int = 5, client_id: int = 0, **params) -> EngineCoreRequest:
    params.setdefault("max_tokens", 3)
    params.setdefault("ignore_eos", True)
    return EngineCoreRequest(
        req_id,
        list(range(10, 10 + prompt_len)),
        SamplingParams(**params),
        arrival_time=1.0,
        client_id=client_id,
    )


def run(engine: EngineCore, step: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """A fake executor: one token (n for a forking request) per request that samples."""
    req_ids, sampled = [], []
    for req_id in step.num_scheduled_tokens:
        req = engine.scheduler.requests.get(req_id)
        if req is not None and req.num_pending_tokens and req.num_computed_tokens == req.num_tokens:
            req_ids.append(req_id)
            sampled.append([token + i for i in range(step.num_samples.get(req_id, 1))])
    return ModelRunnerOutput(
        step_id=step.step_id, req_ids=req_ids, sampled_token_ids=sampled, exec_time_s=0.5
    )


def ids_on(worker: int, count: int) -> list[str]:
    """`count` request ids that detokenizer `worker` owns."""
    ids = (f"r{i}" for i in range(1000))
    return [r for r in ids if detokenizer_index(r, WORKERS) == worker][:count]


# ---- admission ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_len, max_tokens, message",
    [
        (0, 3, "The prompt is empty"),
        (64, None, "maximum context length is 64 tokens. However, your request has 64 input"),
        (60, 5, "you requested 65 tokens (60 in the prompt, 5 in the completion)"),
    ],
)
def test_refuses_prompts_that_cannot_run(prompt_len, max_tokens, message):
    engine = make_engine()
    rejected = engine.add_request(request("x", prompt_len, max_tokens=max_tokens))
    assert isinstance(rejected, RequestRejected)
    assert message in rejected.message and rejected.param == "prompt" and rejected.status == 400
    assert not engine.has_unfinished_requests()


def test_refuses_out_of_vocabulary_ids_and_takes_a_sample_s_id_as_a_client_id():
    engine = make_engine()
    bad = EngineCoreRequest("v", [5, VOCAB], SamplingParams())
    assert "out of vocabulary" in engine.add_request(bad).message
    assert engine.add_request(request("a", n=2)) is None
    engine.update(run(engine, engine.schedule()))  # "a" forks: its sample 1 is "a#1"
    # A client request named "a#1" runs too, under a free internal name; its outputs and
    # aborts still go by "a#1".
    assert engine.add_request(request("a#1")) is None
    assert engine.scheduler.is_known("a#1") and engine.scheduler.num_waiting == 1
    batches = engine.update(run(engine, engine.schedule()))
    outputs = [out for batch in batches.values() for out in batch.outputs]
    assert sorted((o.req_id, o.sample_index) for o in outputs) == [("a", 0), ("a", 1), ("a#1", 0)]
    # The same id again is a resend (a tokenizer worker died): ignored, not an error.
    assert engine.add_request(request("a")) is None
    assert engine.scheduler.num_running == 3
    engine.abort(["a#1"])
    assert engine.scheduler.num_running == 2 and not engine.scheduler.is_known("a#1")


# ---- detokenizer announcements and outputs ------------------------------------------------------


def test_requests_are_announced_to_their_worker_with_their_first_output():
    engine = make_engine()
    (a,) = ids_on(0, 1)
    b, c = ids_on(1, 2)
    for req_id in (a, b, c):
        assert engine.add_request(request(req_id, stop=["x"])) is None
    step = engine.schedule()
    batches = engine.update(run(engine, step))
    assert sorted(batches) == [0, 1]
    assert [r.req_id for r in batches[0].new_requests] == [a]
    assert [r.req_id for r in batches[1].new_requests] == [b, c]  # arrival order
    announced = batches[1].new_requests[0]
    assert announced.prompt_tail == [10, 11, 12, 13, 14] and announced.stop == ["x"]
    assert [(o.req_id, o.new_token_ids) for o in batches[1].outputs] == [(b, [7]), (c, [7])]
    # Later outputs come without an announcement.
    batches = engine.update(run(engine, engine.schedule(), token=8))
    assert batches[0].new_requests == [] and batches[1].new_requests == []
    assert [o.new_token_ids for o in batches[0].outputs] == [[8]]


def test_abort_tells_only_workers_that_heard_of_the_request():
    engine = make_engine()
    heard, unheard = ids_on(0, 2)
    engine.add_request(request(heard))
    engine.update(run(engine, engine.schedule()))
    engine.add_request(request(unheard))  # queued, never produced output
    batches = engine.abort([heard, unheard, "nobody"])
    assert list(batches) == [0]
    assert batches[0].aborted == [heard] and batches[0].outputs == []
    assert engine.abort([heard]) == {}  # idempotent
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_referenced_blocks() == 0


def test_client_gone_aborts_that_clients_requests_only():
    engine = make_engine()
    for req_id, client in (("a", 11), ("b", 22), ("c", 11)):
        engine.add_request(request(req_id, client_id=client, max_tokens=10))
    engine.update(run(engine, engine.schedule()))
    batches = engine.client_gone(11)
    assert sorted(r for batch in batches.values() for r in batch.aborted) == ["a", "c"]
    assert [r.client_req_id for r in engine.scheduler.requests.values()] == ["b"]


def test_finish_sample_ends_one_sample():
    engine = make_engine()
    engine.add_request(request("p", n=2, max_tokens=5))
    engine.update(run(engine, engine.schedule()))
    engine.finish_sample("p", 1)  # its detokenizer found a stop string
    step = engine.schedule()
    assert list(step.num_scheduled_tokens) == ["p"] and step.forked_requests == []


def test_a_finished_output_carries_its_reason_to_the_worker():
    engine = make_engine()
    engine.add_request(request("a", max_tokens=1))
    (batch,) = engine.update(run(engine, engine.schedule())).values()
    assert batch.outputs[0].finish_reason == FinishReason.LENGTH


# ---- steps in flight ---------------------------------------------------------------------------


class FakeExecutor:
    """The Executor protocol (core/executors.py) with `run` as its model: `submit` records
    the step and computes its answer (from the state the step was scheduled in), `poll`
    hands answers back in submit order. `runs_ahead` as a separate process's executor
    (True) or an in-process one (False)."""

    def __init__(self, engine: EngineCore, runs_ahead: bool = True) -> None:
        self.engine = engine
        self.runs_ahead = runs_ahead
        self.submitted: list[SchedulerOutput] = []
        self.answers: list[ModelRunnerOutput] = []
        self.answered = 0
        self.hold = False  # poll answers nothing (a step still running)

    def submit(self, step: SchedulerOutput) -> None:
        self.submitted.append(step)
        if step.step_id < 0:  # sleep mode's control steps
            self.answers.append(ModelRunnerOutput(step.step_id, [], []))
        else:  # every request whose prompt this step completes samples a token
            token = 8 + len(self.answers)
            requests = self.engine.scheduler.requests
            req_ids = [
                r
                for r in step.num_scheduled_tokens
                if requests[r].num_computed_tokens >= len(requests[r].prompt_token_ids)
            ]
            sampled = [[token] for _ in req_ids]
            self.answers.append(ModelRunnerOutput(step.step_id, req_ids, sampled))

    def poll(self, timeout_s: float | None) -> ModelRunnerOutput | None:
        if self.hold or self.answered == len(self.submitted):
            return None
        self.answered += 1
        return self.answers[self.answered - 1]

    def close(self) -> None:
        pass

    @property
    def num_outstanding(self) -> int:
        return len(self.submitted) - self.answered


def test_an_executor_that_runs_ahead_holds_two_steps_answered_in_order():
    engine = make_engine()
    executor = FakeExecutor(engine)
    engine.add_request(request("a", max_tokens=3))
    executor.hold = True
    assert engine.step(executor, wait_s=0) is None  # both steps out, neither answered
    first, second = executor.submitted
    assert executor.num_outstanding == engine.num_steps_in_flight == 2
    assert second.num_scheduled_tokens == {"a": 1}  # computes the token `first` samples
    executor.hold = False
    (batch,) = engine.step(executor).values()
    assert batch.outputs[0].new_token_ids == [8]  # first's answer
    # After an answer the loop submits at once (the executor never waits for the publish).
    assert executor.num_outstanding == 2
    (batch,) = engine.step(executor).values()
    assert batch.outputs[0].new_token_ids == [9]  # second's
    (batch,) = engine.step(executor).values()
    assert batch.outputs[0].finish_reason == FinishReason.LENGTH
    assert engine.step(executor) == {}  # the step scheduled ahead: nothing left to say
    assert engine.step(executor) is None and not engine.has_unfinished_requests()
    assert engine.num_steps_in_flight == executor.num_outstanding == 0


def test_an_in_process_executor_gets_one_step_at_a_time():
    engine = make_engine()
    executor = FakeExecutor(engine, runs_ahead=False)
    engine.add_request(request("a", max_tokens=3))
    for expected in ([8], [9], [10]):
        (batch,) = engine.step(executor).values()
        assert batch.outputs[0].new_token_ids == expected
        assert engine.num_steps_in_flight == executor.num_outstanding == 0
    assert len(executor.submitted) == 3 and not engine.has_unfinished_requests()


def test_pipeline_stages_keep_one_step_per_stage_in_flight():
    engine = make_engine(pipeline_stages=4)
    executor = FakeExecutor(engine)
    for name in "abcd":
        engine.add_request(request(name, max_tokens=4))
    engine.step(executor)  # the four prompts in one step; once it is answered, decodes
    assert engine.num_steps_in_flight == 4 == engine.max_steps_in_flight(executor)
    # A micro-batch per stage, a request in one of them at a time.
    batches = [set(s.num_scheduled_tokens) for s in executor.submitted[1:]]
    assert all(len(b) == 1 for b in batches) and set().union(*batches) == set("abcd")
    assert engine.max_steps_in_flight(FakeExecutor(engine, runs_ahead=False)) == 1


def test_a_stalled_engine_submits_nothing_and_says_so():
    """Nothing schedulable and nothing out: step returns None at once (the core process
    then waits for inputs, the offline LLM raises)."""
    engine = make_engine()
    executor = FakeExecutor(engine)
    assert engine.step(executor) is None and executor.submitted == []


def test_sleep_collects_the_steps_in_flight_then_sends_the_sleep_step():
    engine = make_engine()
    executor = FakeExecutor(engine)
    engine.add_request(request("a", max_tokens=2))
    executor.hold = True
    engine.step(executor, wait_s=0)
    with pytest.raises(ParamError, match="requests are running"):
        engine.sleep(executor)
    executor.hold = False
    engine.step(executor)  # a's first token
    engine.step(executor)  # a's second: a finishes, with the step scheduled ahead still out
    assert not engine.has_unfinished_requests() and engine.num_steps_in_flight == 1
    engine.sleep(executor, level=2)
    assert engine.asleep and engine.heartbeat().status.asleep
    assert engine.num_steps_in_flight == executor.num_outstanding == 0
    assert executor.submitted[-1].sleep_level == 2
    engine.sleep(executor)  # idempotent: nothing more is sent
    assert sum(bool(s.sleep_level) for s in executor.submitted) == 1
    engine.wake_up(executor, ["kv_cache"])  # in parts: asleep until both are back
    assert engine.asleep and executor.submitted[-1].wake_up == ["kv_cache"]
    engine.wake_up(executor)  # what is still asleep, only
    assert not engine.asleep and not engine.heartbeat().status.asleep
    assert executor.submitted[-1].wake_up == ["weights"]
    engine.wake_up(executor)
    assert sum(bool(s.wake_up) for s in executor.submitted) == 2


def test_after_no_work_marks_the_first_step_after_idling():
    engine = make_engine()
    engine.add_request(request("a", max_tokens=2))
    first = engine.schedule()
    assert first.after_no_work
    engine.update(run(engine, first))
    second = engine.schedule()
    assert not second.after_no_work
    engine.update(run(engine, second))
    assert not engine.has_unfinished_requests()
    engine.add_request(request("b"))
    assert engine.schedule().after_no_work


def test_a_step_goes_out_only_when_it_carries_something():
    engine = make_engine()
    assert engine.schedule() is None
    engine.add_request(request("a", max_tokens=5))
    engine.update(run(engine, engine.schedule()))
    engine.abort(["a"])
    step = engine.schedule()  # no tokens, but the executor must drop a's state
    assert step.total_num_scheduled_tokens == 0 and step.finished_req_ids == ["a"]
    assert engine.schedule() is None


# ---- statistics -------------------------------------------------------------------------------


def test_heartbeat_fills_the_wire_struct():
    engine = make_engine(num_blocks=16)
    engine.add_request(request("a", prompt_len=9, max_tokens=2))
    engine.add_request(request("b", prompt_len=3, max_tokens=2))
    engine.update(run(engine, engine.schedule()))
    stats = engine.heartbeat()
    assert stats is engine.stats  # one struct, updated in place, sent as is
    assert (stats.load.num_running, stats.load.num_waiting) == (2, 0)
    assert stats.tokens.prompt == 12 and stats.tokens.generated == 2
    assert stats.steps.count == 1 and stats.steps.executor_busy_s == 0.5
    pool = stats.kv_pool
    assert pool.num_blocks == 16 and pool.num_free_blocks == 16 - 3 - 1
    assert pool.usage == pytest.approx(4 / 16)
    assert pool.block_states == bytes([1, 1, 1, 1] + [0] * 12)
    assert pool.slots_allocated == 4 * BLOCK_SIZE and pool.slots_used == 12
    assert stats.status.time > 0


def test_heartbeat_counts_per_tenant_and_a_malformed_tenant_is_refused():
    engine = make_engine(num_blocks=16)
    bad = request("bad")
    bad.options = RequestOptions(tenant="two words")
    rejected = engine.add_request(bad)
    assert isinstance(rejected, RequestRejected)
    assert rejected.status == 400 and rejected.param == "tenant"
    a, b = request("a", prompt_len=9, max_tokens=2), request("b", prompt_len=3, max_tokens=2)
    a.options = RequestOptions(tenant="alice")
    engine.add_request(a)
    engine.add_request(b)  # no tenant: the default one
    engine.update(run(engine, engine.schedule()))
    tenants = {t.name: t for t in engine.heartbeat().tenants}
    assert set(tenants) == {"alice", "default"}
    alice = tenants["alice"]
    assert (alice.num_running, alice.num_requests, alice.num_computed_tokens) == (1, 1, 9)
    assert alice.num_generation_tokens == 1 and alice.weight == 1.0
    assert tenants["default"].num_computed_tokens == 3
