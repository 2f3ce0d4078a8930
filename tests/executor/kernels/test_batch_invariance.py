"""Batch-invariant mode (`deterministic=True`): a needle request's full logprob vectors are
bitwise the same alone, inside batches of 1 to 128 other requests, under chunked prefill of
any chunk size, after preemption and recompute, and with a prefix-cache hit. An inverse test
shows the default path does differ, so these tests can fail."""

from __future__ import annotations

import random

import pytest
from tiny_models import write_tiny_model

from zllm import LLM, SamplingParams

NEEDLE_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-det")))


def needle_prompt() -> list[int]:
    return [random.Random(1).randrange(3, 430) for _ in range(70)]


def others(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 430) for _ in range(rng.randrange(1, 90))]}
        for _ in range(count)
    ]


def needle_vectors(llm: LLM, batch: list[dict], *, position: int = 0) -> list[dict]:
    """The needle's output logprobs, every token of the vocabulary at every position, when
    it runs at `position` among `batch` (sampled requests beside it)."""
    vocab = llm.config.arch.vocab_size
    needle = SamplingParams(temperature=0.0, max_tokens=NEEDLE_TOKENS, logprobs=vocab)
    other = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    prompts = [*batch[:position], {"prompt_token_ids": needle_prompt()}, *batch[position:]]
    params = [other] * position + [needle] + [other] * (len(batch) - position)
    out = llm.generate(prompts, params, use_tqdm=False)[position].outputs[0]
    assert len(out.logprobs) == NEEDLE_TOKENS
    return [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]


def conditions(model_dir: str, deterministic: bool):
    """(name, the needle's vectors) for every condition the contract covers."""
    base = dict(kv_cache_memory_bytes=32 << 20, deterministic=deterministic)
    llm = LLM(model_dir, **base)
    yield "alone", needle_vectors(llm, [])
    for size in (1, 16, 128):
        yield f"batch of {size}", needle_vectors(llm, others(size, seed=size), position=size // 2)
    yield "prefix-cache hit", needle_vectors(llm, [])
    for chunk in (5, 48):
        chunked = LLM(model_dir, **base, max_num_batched_tokens=chunk, enable_prefix_caching=False)
        yield f"chunks of {chunk}", needle_vectors(chunked, others(3, seed=chunk), position=1)
    tight = LLM(
        model_dir,
        num_gpu_blocks_override=40,
        block_size=4,
        max_num_batched_tokens=64,
        deterministic=deterministic,
    )
    vectors = needle_vectors(tight, others(8, seed=99), position=3)
    assert tight.engine.scheduler.num_preemptions > 0
    yield "after preemption", vectors


def test_needle_logprobs_are_bitwise_identical_everywhere(model_dir) -> None:
    reference = None
    for name, vectors in conditions(model_dir, deterministic=True):
        if reference is None:
            reference = vectors
            assert all(len(pos) > 400 for pos in reference)  # the whole vocabulary (440)
            continue
        assert vectors == reference, f"{name}: logprobs differ from the needle alone"


def test_the_default_path_is_not_batch_invariant(model_dir) -> None:
    """Without the mode, some condition changes the needle's logprobs in the last bits (or
    more): what the mode exists to prevent, and proof the test above can fail."""
    results = dict(conditions(model_dir, deterministic=False))
    reference = results.pop("alone")
    differing = [name for name, vectors in results.items() if vectors != reference]
    assert differing, "the default path happened to be batch-invariant on this machine"
    # The differences are rounding, not bugs: the same tokens, logprobs within 1e-4.
    for vectors in results.values():
        for pos, ref in zip(vectors, reference, strict=True):
            assert max(pos, key=pos.get) == max(ref, key=ref.get)
            assert max(abs(pos[t] - ref[t]) for t in ref) < 1e-4


@pytest.mark.e2e
def test_served_needle_alone_and_in_a_crowd(model_dir, engine_pool, tmp_path) -> None:
    """`zllm serve --deterministic` through the openai client: the needle's top-20 logprobs
    (JSON floats, exact) are the same alone and among 24 concurrent requests.

    That it ran among them is shown, not hoped for: the executor is paused (SIGSTOP, far
    under --executor-timeout) until the core holds all 25, and the engine's step counter
    then finds fewer steps than the needle's 6 plus another's 16 (ignore_eos), which the
    needle sharing no step with anyone would take."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI
    from servers import metric, wait_until

    # (An engine of its own: its token and step counters are read as totals.)
    log = tmp_path / "server.log"
    with engine_pool.serve(model_dir, log, "--deterministic", shared=False) as server:
        executor = server.children()["executor"]
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id

        def needle():
            choice = client.completions.create(
                model=model, prompt=needle_prompt(), max_tokens=6, temperature=0.0, logprobs=20
            ).choices[0]
            return choice.logprobs.top_logprobs

        def other(prompt):
            client.completions.create(
                model=model, prompt=prompt, max_tokens=16, temperature=1.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        def counters() -> tuple[float, float, float]:
            """(requests in the core, tokens generated, steps), from its latest heartbeat."""
            text = server.get("/metrics").text
            held = metric(text, "vllm:num_requests_running")
            held += metric(text, "vllm:num_requests_waiting")
            tokens = metric(text, "vllm:generation_tokens_total")
            return held, tokens, metric(text, "zllm:engine_steps_total")

        alone = needle()
        # Counters read once a heartbeat holds the needle's 6 tokens, and at the end once it
        # holds everyone's: a heartbeat is a count in the past.
        assert wait_until(lambda: counters()[1] == 6, 30), counters()
        steps_before = counters()[2]
        crowd = [p["prompt_token_ids"] for p in others(24, seed=5)]
        os.kill(executor, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(len(crowd) + 1) as pool:
                futures = [pool.submit(other, p) for p in crowd[:12]]
                among = pool.submit(needle)
                futures += [pool.submit(other, p) for p in crowd[12:]]
                assert wait_until(lambda: counters()[0] == len(crowd) + 1, 60), counters()
                os.kill(executor, signal.SIGCONT)
                assert among.result() == alone
                for f in futures:
                    f.result()
        finally:
            os.kill(executor, signal.SIGCONT)
        total = 6 + 6 + 16 * len(crowd)
        assert wait_until(lambda: counters()[1] == total, 30), counters()
        assert counters()[2] - steps_before < 6 + 16, counters()


@pytest.mark.slow
def test_smollm2_needle_is_bitwise_identical(smollm2_path) -> None:
    """The real model (GGUF kernels): alone, in a batch of 16, and prefilled in chunks of 32."""
    llm = LLM(smollm2_path, kv_cache_memory_bytes=256 << 20, deterministic=True)
    alone = needle_vectors(llm, [])
    assert len(alone[0]) == llm.config.arch.vocab_size
    assert needle_vectors(llm, others(16, seed=2), position=8) == alone
    chunked = LLM(
        smollm2_path,
        kv_cache_memory_bytes=256 << 20,
        deterministic=True,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    assert needle_vectors(chunked, others(2, seed=3), position=1) == alone


def test_gguf_file_with_mixed_type_fused_matmuls_is_bitwise_identical(tmp_path) -> None:
    """q/k Q4_1 beside v Q8_0: the fused qkv runs one kernel call per type (GGUFSplitLinear),
    which the mode must tile like any matmul (Q8_0's 1-2 row path differs from its panel)."""
    from gguf import GGMLQuantizationType as T
    from gguf_files import write_llama_gguf

    path = tmp_path / "v8.gguf"
    write_llama_gguf(path, lambda name: T.Q8_0 if "attn_v" in name else T.Q4_1)
    llm = LLM(str(path), kv_cache_memory_bytes=32 << 20, deterministic=True)
    assert type(llm.model_runner.model.layers[0].self_attn.qkv_proj).__name__ == "Tiled"
    alone = needle_vectors(llm, [])
    assert needle_vectors(llm, others(16, seed=2), position=8) == alone
