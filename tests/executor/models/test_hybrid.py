"""Hybrid models (Gated DeltaNet state layers beside attention: Qwen3-Next, Qwen3.5) in the
engine: the recurrent-state slots (zllm/kv/state_layout.py) keep each sequence's state apart
through batching, chunked prefill, preemption, forks and sleep; prefix hits bring back the
state after the cached prefix (its snapshot); the options that cannot hold a recurrent state
yet are refused naming why. Parity per family is
tests/executor/models/test_families.py's; this runs the tiny Qwen3-Next of its row."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest
import torch
from family_cases import CASES
from llama_cpp_convert import SPM_VOCAB_SIZE, convert_many, rounded_as_stored
from parity import assert_greedy_parity, hf_greedy

from zllm import LLM, BeamSearchParams, SamplingParams
from zllm.errors import ParamError
from zllm.kv.state_layout import state_bytes_per_sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Eight prompts: one token, a few, several blocks, and past the rule's 64-token chunks.
LENGTHS = [1, 7, 17, 40, 55, 70, 90, 130]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(CASES["qwen3_next"].write(tmp_path_factory.mktemp("hybrid") / "qwen3_next"))


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=8, block_size=4)


@pytest.fixture(scope="module")
def plain(model_dir) -> LLM:
    """Without prefix caching: every prompt computed from its first token."""
    return LLM(model_dir, kv_cache_memory_bytes=16 << 20, block_size=4, enable_prefix_caching=False)  # fmt: skip


@pytest.fixture(scope="module")
def alone(plain) -> list[list[int]]:
    """Each prompt's greedy answer, run by itself."""
    return [answer(plain, p) for p in PROMPTS]


def prompts_of(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SPM_VOCAB_SIZE) for _ in range(n)] for n in LENGTHS]


PROMPTS = prompts_of(0)


def answer(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)  # fmt: skip


def batch(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_alone_it_answers_as_transformers(model_dir, alone) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for i in (0, 4, 7):  # one token; one 64-token chunk of the rule; three of them
        prompt = PROMPTS[i]
        assert_greedy_parity(hf, prompt, alone[i], hf_greedy(hf, prompt, len(alone[i])), label=str(i))  # fmt: skip


def test_eight_in_one_batch_answer_as_each_alone(llm, alone) -> None:
    """Prefills and decodes of eight sequences side by side in each step: no state leaks
    from one sequence's slot into another's."""
    assert batch(llm, PROMPTS) == alone


def test_chunked_prefill_and_preemption_leave_the_answers_unchanged(model_dir, alone) -> None:
    """A budget of 16 tokens a step cuts every long prompt into chunks (the state carried
    across each cut), and a pool of 60 blocks of 4 preempts: the preempted sequences are
    recomputed from position 0, their slots reused by others meanwhile."""
    tight = LLM(
        model_dir, num_gpu_blocks_override=60, block_size=4, max_num_batched_tokens=16, max_num_seqs=8
    )  # fmt: skip
    assert batch(tight, PROMPTS) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.state_slots.num_free == 8


def test_an_int8_kv_cache_keeps_each_sequence_apart(model_dir, alone) -> None:
    """The attention layers' K and V in int8 beside the state layers' fp32 state: a batch
    answers as each prompt alone with the same cache, and mostly as the fp32 cache does."""
    narrow = LLM(model_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=8, kv_cache_dtype="int8")
    together = batch(narrow, PROMPTS)
    assert together == [answer(narrow, p) for p in PROMPTS]
    same = sum(a[:4] == b[:4] for a, b in zip(together, alone, strict=True))
    assert same >= 6, (together, alone)


def test_prefix_hits_bring_back_the_state_after_the_prefix(model_dir, plain, alone) -> None:
    """The eight prompts twice: the second time each hits its own prefix up to its last full
    block before its last token (the state there was saved the first time), the answers
    unchanged; then a conversation's next turn (the prompt, its answer, more) hits the
    prompt's snapshot and answers as an engine without prefix caching."""
    llm = LLM(model_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=8, block_size=4)
    bm = llm.engine.block_manager
    assert batch(llm, PROMPTS) == alone
    assert bm.prefix_cache_hits == 0
    assert batch(llm, PROMPTS) == alone
    assert bm.prefix_cache_hits == sum((n - 1) // 4 * 4 for n in LENGTHS)  # blocks of 4
    rng = random.Random(5)
    turn = PROMPTS[5] + alone[5] + [rng.randrange(3, SPM_VOCAB_SIZE) for _ in range(9)]
    hits_before = bm.prefix_cache_hits
    assert answer(llm, turn) == answer(plain, turn)
    assert bm.prefix_cache_hits - hits_before == (len(PROMPTS[5]) - 1) // 4 * 4


def test_the_torch_state_path_answers_as_the_kernels(model_dir, alone, monkeypatch) -> None:
    """Without csrc/cpu/state_layers.cpp (another device, ZLLM_CPU_KERNELS=0) the state
    layers run the torch rule: the same answers, in steps mixing chunks and decodes."""
    from zllm.executor.kernels import cpu_state_ops

    monkeypatch.setattr(cpu_state_ops, "usable", lambda x: False)
    engine = LLM(
        model_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=8, max_num_batched_tokens=16
    )
    assert batch(engine, PROMPTS) == alone


def test_two_samples_each_continue_the_prompt_state(llm, alone) -> None:
    """n = 2 forks after the prompt: each sample's slot gets the prompt's state (the parent
    has stepped on by then), so at temperature 0 both answer as the prompt alone."""
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[2:5]], params, use_tqdm=False)
    for out, expected in zip(outs, alone[2:5], strict=True):
        assert [list(c.token_ids) for c in out.outputs] == [expected, expected]
    assert llm.executor.runner.host.kv.state.num_stashed == 0  # every stash was used and dropped


def hf_beams(model, prompt: list[int], width: int, max_new: int) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
            do_sample=False, max_new_tokens=max_new, pad_token_id=0,
        )  # fmt: skip
    return out[:, len(prompt) :].tolist()


def test_beam_search_equals_transformers(model_dir, llm) -> None:
    """Beams fork and are dropped every step; each beam's state is its own (transformers
    reorders its cache's states by beam)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hf.generation_config.eos_token_id = None  # (ignore_eos, as our params)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    for prompt in PROMPTS[2:4]:
        (out,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
        ours = [s.tokens[len(prompt) :] for s in out.sequences]
        assert ours == hf_beams(hf, prompt, 3, 8)


def test_sleep_releases_the_state_and_wakes_to_the_same_answers(model_dir, alone) -> None:
    engine = LLM(model_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=8, enable_sleep_mode=True)
    state = engine.executor.runner.host.kv.state
    engine.sleep(1)
    assert state.layers == {}
    engine.wake_up()
    assert batch(engine, PROMPTS[:4]) == alone[:4]


def test_the_state_is_sized_from_the_model_and_logged(model_dir, caplog) -> None:
    """Two state layers, each a conv window of (2 x 32 + 64 channels) x 3 and 4 heads of
    16 x 16: 5,632 fp32 bytes a layer; the log line says the slots and the prefix cache's
    snapshots beside the blocks."""
    with caplog.at_level(logging.INFO):
        engine = LLM(model_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=5)
    arch = engine.config.arch
    assert state_bytes_per_sequence(arch) == 2 * (128 * 3 + 4 * 16 * 16) * 4 == 11264
    state = engine.executor.runner.host.kv.state
    assert (state.num_slots, state.num_snapshots, state.bytes_per_slot) == (5, 5, 11264)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert "; state: 5 slots of 11264 bytes and 5 prefix snapshots" in line


def test_seats_are_lowered_to_the_slots_half_the_budget_holds(model_dir, caplog) -> None:
    """256 seats of 11,264 bytes of state and as many snapshots would take 5.5 MiB of a
    4 MiB cache: half of it holds 93 of both, so the engine seats 93 (said in the log)
    rather than failing to start."""
    with caplog.at_level(logging.WARNING):
        engine = LLM(model_dir, kv_cache_memory_bytes=4 << 20)
    assert engine.config.scheduler.max_num_seqs == (2 << 20) // (2 * 11264) == 93
    assert engine.executor.runner.host.kv.state.num_slots == 93
    assert "--max-num-seqs 256 lowered to 93" in caplog.text
    assert answer(engine, PROMPTS[2])  # and it runs


@pytest.mark.parametrize(
    "kwargs, said",
    [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "roll back"),
        (dict(kv_offload_bytes=8 << 20), "recurrent state"),
        (dict(tensor_parallel_size=2), "split across ranks"),
        (dict(enable_lora=True), "adapters"),
    ],
)
def test_what_a_recurrent_state_cannot_do_yet_is_refused(model_dir, kwargs, said) -> None:
    with pytest.raises(ValueError, match=said):
        LLM(model_dir, kv_cache_memory_bytes=16 << 20, **kwargs)


def test_more_samples_than_slots_is_a_request_error(llm) -> None:
    params = SamplingParams(n=9, temperature=1.0, max_tokens=4)
    with pytest.raises(ParamError, match="recurrent state") as e:
        llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)
    assert e.value.param == "n"
    assert answer(llm, PROMPTS[1]) == answer(llm, PROMPTS[1])  # and it goes on serving


@pytest.mark.e2e
def test_eight_concurrent_served_requests_answer_as_offline(
    model_dir, llm, alone, engine_pool, tmp_path
) -> None:
    from openai import AsyncOpenAI

    with engine_pool.serve(model_dir, tmp_path / "server.log", "--max-num-seqs", "8") as server:

        async def ask_all():
            # (a client per round: each asyncio.run has its own event loop)
            client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            model = (await client.models.list()).data[0].id
            # (the answers' tokens, named "token_id:<id>" in their logprobs: random tokens
            # decode to byte pieces whose text says less)
            extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
            asks = [
                client.completions.create(
                    model=model,
                    prompt=p,
                    max_tokens=12,
                    temperature=0.0,
                    logprobs=0,
                    extra_body=extra,
                )  # fmt: skip
                for p in PROMPTS
            ]
            return await asyncio.gather(*asks)

        def tokens(answers) -> list[list[int]]:
            return [
                [int(t.removeprefix("token_id:")) for t in a.choices[0].logprobs.tokens]
                for a in answers
            ]

        assert tokens(asyncio.run(ask_all())) == alone
        hits = prefix_hits(server)
        assert tokens(asyncio.run(ask_all())) == alone  # again: from the prefix cache
        expected = sum((n - 1) // 16 * 16 for n in LENGTHS)  # the server's blocks of 16
        wait_until(lambda: prefix_hits(server) - hits >= expected)
        assert "state: 8 slots" in server.log_text()


def prefix_hits(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = server.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prefix_cache_hits_total":
                return sample.value
    return 0.0


def wait_until(done, timeout: float = 20.0) -> None:
    """The engine's counters reach /metrics with its heartbeat."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the prefix cache's hits never showed in /metrics"
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# A quantized GGUF file: its matmuls read the file's blocks


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_a_q8_0_file_reads_its_blocks_and_answers_as_its_rounded_checkpoint(
    family: str, tmp_path
) -> None:
    """llama.cpp's converter at Q8_0: every projection of the state and attention layers (and
    the MLPs) reads the file's blocks; under gguf-float (the blocks' exact values, fp32 sums)
    greedy tokens equal transformers' on the checkpoint rounded as the file stores it."""
    import transformers

    from zllm.executor.layers.linear.gguf import GGUFLinear

    directory = CASES[family].write(tmp_path / family)
    (path,) = convert_many([(directory, tmp_path / f"{family}-q8_0.gguf", "q8_0")])
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, max_num_seqs=4, quantization="gguf-float")
    model = llm.executor.runner.model
    for layer in model.layers:
        mixer = layer.linear_attn or layer.self_attn
        projections = ("in_proj", "out_proj") if layer.linear_attn else ("qkv_proj", "o_proj")
        assert all(isinstance(getattr(mixer, p), GGUFLinear) for p in projections)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    s = llm.config.arch.state
    tiled = (s.num_key_heads, s.num_heads // s.num_key_heads, s.value_head_dim) if s.tiled_value_heads else None  # fmt: skip
    assert (tiled is not None) == (family == "qwen3_5")
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(rounded_as_stored(name, param, tiled))
    for prompt in PROMPTS[3:6]:
        ours = answer(llm, prompt)
        assert_greedy_parity(hf, prompt, ours, hf_greedy(hf, prompt, len(ours)), label=family)
