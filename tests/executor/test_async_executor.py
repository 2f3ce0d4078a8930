"""The asynchronous executor (`--async-executor`, executor/async_steps.py): step N+1 is
launched before step N is finished, and tokens N sampled reach N+1's inputs on the device.

On CPU nothing overlaps in time (the kernels run on the calling thread), but the order of
work is the GPU's: launch N, launch N+1 reading N's pending tokens, finish N. So these tests
check on CPU that the order changes no output. Under batch-invariant execution a request's
logprobs do not depend on how steps are batched (scheduling ahead batches differently), so
the comparison is bitwise. The GPU run (tests/test_cuda.py) checks the same on the device
and that launching a step never waits for the device."""

from __future__ import annotations

import concurrent.futures
import json
import random

import httpx
import pytest
from servers import metric, sse_lines, start_server, stop_server, wait_until
from tiny_models import write_tiny_model

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-async")))


def prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 430) for _ in range(rng.randrange(1, 80))]}
        for _ in range(count)
    ]


# Requests whose next token reads only the device (they overlap) ...
FREE = [
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=3),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=20, logprobs=2),
    SamplingParams(temperature=1.0, min_p=0.05, seed=8, max_tokens=18),
    SamplingParams(temperature=0.0, max_tokens=16, logit_bias={5: 4.0}, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=9, max_tokens=22, allowed_token_ids=list(range(3, 200))),
]
# ... and requests whose next token reads their output on the host (their steps run whole).
HOST = [
    SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.4),
    SamplingParams(temperature=0.8, seed=3, max_tokens=20, presence_penalty=0.8),
    SamplingParams(temperature=0.0, max_tokens=12, min_tokens=10, ignore_eos=False),
    SamplingParams(temperature=0.0, max_tokens=14, bad_words_token_ids=[[17, 18]]),
    SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=10),
]


def run(model_dir: str, mode: str, batch: list[dict], params, **engine) -> tuple[list, LLM]:
    llm = LLM(model_dir, deterministic=True, async_executor=mode, **engine)
    outs = llm.generate(batch, params, use_tqdm=False)
    return [
        [(c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason) for c in o.outputs]
        for o in outs
    ], llm


def overlapped(llm: LLM) -> int:
    return llm.executor.pipeline.num_overlapped


@pytest.mark.parametrize("mix", ["device-only", "with host readers"])
def test_async_outputs_equal_one_step_at_a_time(model_dir, mix) -> None:
    params = FREE * 3 if mix == "device-only" else (FREE + HOST) * 2
    batch = prompts(len(params), seed=len(params))
    sync, sync_llm = run(model_dir, "off", batch, params, max_num_batched_tokens=64)
    ahead, llm = run(model_dir, "on", batch, params, max_num_batched_tokens=64)
    assert not sync_llm.executor.runs_ahead and llm.executor.runs_ahead
    assert ahead == sync
    assert overlapped(sync_llm) == 0
    steps = llm.engine.stats.steps.count
    if mix == "device-only":
        assert overlapped(llm) > steps // 2, (overlapped(llm), steps)
    else:  # host readers run to the end of the batch: fewer steps overlap, none wrongly
        assert 0 < overlapped(llm) < steps
    assert llm.engine.stats.steps.overlapped == overlapped(llm)


def test_a_request_alone_overlaps_every_decode_step(model_dir) -> None:
    """One greedy request: each decode step feeds on the last one's token on the device."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    batch = prompts(1, seed=1)
    sync, _ = run(model_dir, "off", batch, params)
    ahead, llm = run(model_dir, "on", batch, params)
    assert ahead == sync
    assert overlapped(llm) >= 38  # all but the prefill and the first decode


def test_preemption_prefix_hits_and_chunks_under_the_async_executor(model_dir) -> None:
    """A pool too small for the batch (preempted requests resume and recompute), prefill in
    chunks, a repeated prompt (a prefix hit)."""
    params = [FREE[0], FREE[1], FREE[2]] * 3
    batch = prompts(len(params), seed=11)
    batch[4] = batch[0]
    tight = dict(num_gpu_blocks_override=30, block_size=4, max_num_batched_tokens=32)
    sync, _ = run(model_dir, "off", batch, params, **tight)
    ahead, llm = run(model_dir, "on", batch, params, **tight)
    assert llm.engine.scheduler.num_preemptions > 0
    assert ahead == sync
    assert overlapped(llm) > 0


def test_sleep_and_wake_between_runs(model_dir) -> None:
    llm = LLM(model_dir, async_executor="on", enable_sleep_mode=True)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    batch = prompts(4, seed=5)
    first = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    llm.sleep(level=1)
    llm.wake_up()
    again = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert again == first and overlapped(llm) > 0


def test_auto_is_off_on_cpu_and_on_refuses_what_cannot_overlap(model_dir) -> None:
    assert EngineArgs(model=model_dir).create_engine_config().async_executor is False
    assert EngineArgs(model=model_dir, async_executor="on").create_engine_config().async_executor
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineArgs(model=model_dir, async_executor="on", speculative_config=ngram)\
            .create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match="one executor rank"):
        EngineArgs(model=model_dir, async_executor="on", tensor_parallel_size=2)\
            .create_engine_config()  # fmt: skip
    auto = EngineArgs(model=model_dir, speculative_config=ngram).create_engine_config()
    assert auto.async_executor is False


@pytest.mark.e2e
def test_served_async_executor_streams_what_the_offline_engine_returns(model_dir, tmp_path):
    """`zllm serve --async-executor on`: concurrent streams (one cancelled midway) give the
    offline synchronous engine's greedy tokens, and /metrics counts overlapped steps."""
    server = start_server(model_dir, tmp_path / "serve.log", "--async-executor", "on",
                          "--served-model-name", "tiny")  # fmt: skip
    try:
        batch = prompts(6, seed=21)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        want = [
            o.outputs[0].token_ids
            for o in LLM(model_dir, async_executor="off").generate(batch, params, use_tqdm=False)
        ]

        def stream(prompt: list[int], cancel_after: int | None = None) -> list[int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_tokens_as_token_ids": True,
                    "logprobs": 0}  # fmt: skip
            tokens: list[int] = []
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=120) as r:  # fmt: skip
                for line in sse_lines(r.iter_text()):
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    for token in event["choices"][0]["logprobs"]["tokens"]:
                        tokens.append(int(token.removeprefix("token_id:")))
                    if cancel_after is not None and len(tokens) >= cancel_after:
                        return tokens
            return tokens

        with concurrent.futures.ThreadPoolExecutor(7) as pool:
            futures = [pool.submit(stream, p["prompt_token_ids"]) for p in batch]
            cancelled = pool.submit(stream, batch[0]["prompt_token_ids"], 5)
            got = [f.result() for f in futures]
        assert got == want
        assert cancelled.result() == want[0][: len(cancelled.result())]
        assert wait_until(  # (the core's counts reach the frontend every 0.5 s)
            lambda: metric(server.get("/metrics").text, "zllm:executor_overlapped_steps_total"),
            timeout=10,
        )
        assert server.healthy()
    finally:
        assert stop_server(server) == 0


def test_an_interrupted_finish_leaves_the_engine_usable(model_dir, monkeypatch) -> None:
    """Ctrl-C (or an error) while a pending step is being finished: generate raises, the
    step still gets an (empty) answer so the core's steps and answers stay paired, and the
    next generate answers as a fresh engine does."""
    from zllm.executor.model_runner import ModelRunner

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batch = prompts(4, seed=13)
    want, _ = run(model_dir, "off", batch, params)
    llm = LLM(model_dir, deterministic=True, async_executor="on")
    finish = ModelRunner.finish
    calls = []

    def interrupted(self, launched):
        calls.append(launched.so.step_id)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return finish(self, launched)

    monkeypatch.setattr(ModelRunner, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(batch, params, use_tqdm=False)
    assert overlapped(llm) > 0
    monkeypatch.setattr(ModelRunner, "finish", finish)
    again = llm.generate(batch, params, use_tqdm=False)
    got = [[(c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason) for c in o.outputs]
           for o in again]  # fmt: skip
    assert got == want
    assert not llm.engine.has_unfinished_requests() and llm.engine.num_steps_in_flight == 0


@pytest.mark.parametrize(
    "slots",
    [
        [(0, "a"), (1, "b"), (2, "c")],  # every row pending, the launched step's order
        [(3, "b"), (4, "c")],  # after a row whose token the host has
        [(0, "c"), (1, "a"), (2, "b")],  # reordered rows
        [(0, "a"), (2, "b"), (5, "c")],  # rows apart (prompt chunks between)
        [(4, "b")],
    ],
)
def test_pending_tokens_fill_each_slot_from_its_row(slots) -> None:
    """PendingTokens.fill: a consecutive run of slots and rows is one slice copy, any other
    an indexed copy; either writes each request's sampled token where its slot is."""
    import torch

    from zllm.executor.step_inputs import PendingTokens

    sampled = torch.tensor([70, 71, 72], dtype=torch.int64)
    pending = PendingTokens({"a": 0, "b": 1, "c": 2}, sampled)
    input_ids = torch.full((6,), -1, dtype=torch.int64)
    pending.fill(input_ids, slots)
    expected = [-1] * 6
    for index, req_id in slots:
        expected[index] = 70 + "abc".index(req_id)
    assert input_ids.tolist() == expected
