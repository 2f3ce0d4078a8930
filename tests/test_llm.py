"""The offline LLM API end to end on a tiny random Llama, checked against transformers."""

from __future__ import annotations

import random

import pytest
import torch
from parity import assert_greedy_parity, hf_greedy

from zllm import LLM, SamplingParams
from zllm.executor.host.kv_cache import kv_bytes_per_token
from zllm.protocol import EngineCoreRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_memory_bytes=64 << 20)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def check_against_hf(hf_model, prompts, outputs, label):
    for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
        theirs = hf_greedy(hf_model, p, len(out.outputs[0].token_ids))
        assert_greedy_parity(hf_model, p, out.outputs[0].token_ids, theirs, label=f"{label}[{i}]")


def test_greedy_batch_of_mixed_lengths_matches_transformers(llm, hf_model):
    vocab = llm.config.arch.vocab_size
    prompts = random_prompts(vocab, [1, 3, 17, 40, 64, 100, 5, 33])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order kept
    for o in outputs:
        assert len(o.outputs[0].token_ids) == 24 and o.outputs[0].finish_reason == "length"
        assert isinstance(o.outputs[0].token_ids, list)
    check_against_hf(hf_model, prompts, outputs, "mixed")


def test_text_prompts_and_detokenized_output(llm, hf_model):
    tok = llm.get_tokenizer()
    texts = ["The quick brown fox", "def add(a, b):", "Emoji 🙂 and CJK 你好"]
    outputs = llm.generate(texts, GREEDY, use_tqdm=False)
    for text, out in zip(texts, outputs, strict=True):
        assert out.prompt == text
        assert out.prompt_token_ids == tok.encode(text)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    check_against_hf(hf_model, [o.prompt_token_ids for o in outputs], outputs, "text")


def test_preemption_and_recompute_keep_greedy_outputs(tiny_llama_dir, hf_model):
    # 12 blocks of 16 tokens for 8 requests growing to ~80 tokens each: preemption is forced.
    small = LLM(tiny_llama_dir, num_gpu_blocks_override=12, max_num_batched_tokens=64)
    prompts = random_prompts(small.config.arch.vocab_size, [40, 50, 30, 60, 45, 20, 55, 35], 1)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert small.engine.heartbeat().load.num_preemptions > 0
    check_against_hf(hf_model, prompts, outputs, "preempted")
    assert small.engine.block_manager.num_referenced_blocks() == 0


def test_alone_equals_inside_batch_of_32(llm):
    vocab = llm.config.arch.vocab_size
    others = random_prompts(vocab, [random.Random(i).randrange(2, 90) for i in range(32)], 2)
    target = random_prompts(vocab, [37], 3)[0]
    alone = llm.generate([{"prompt_token_ids": target}], GREEDY, use_tqdm=False)
    batch = llm.generate(
        [{"prompt_token_ids": p} for p in others[:16] + [target] + others[16:]],
        GREEDY,
        use_tqdm=False,
    )
    assert batch[16].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_chunked_prefill_and_prefix_cache_do_not_change_outputs(tiny_llama_dir, llm):
    prompts = random_prompts(llm.config.arch.vocab_size, [70, 90], 4)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    reference = llm.generate(reqs, GREEDY, use_tqdm=False)
    chunked = LLM(tiny_llama_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    for a, b in zip(reference, chunked.generate(reqs, GREEDY, use_tqdm=False), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_prefix_cache_reports_cached_tokens(llm):
    prefix = random_prompts(llm.config.arch.vocab_size, [80], 5)[0]
    first = llm.generate([{"prompt_token_ids": prefix + [10, 11]}], GREEDY, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": prefix + [12, 13, 14]}], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == 80  # 5 full blocks of 16


def test_seeded_sampling_is_reproducible_and_n_samples_differ(llm):
    prompt = {"prompt_token_ids": random_prompts(llm.config.arch.vocab_size, [12], 6)[0]}
    params = SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, n=4, ignore_eos=True
    )
    a = llm.generate(prompt, params, use_tqdm=False)[0]
    b = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # the samples differ
    other_seed = SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True)
    c = llm.generate(prompt, other_seed, use_tqdm=False)[0]
    assert c.outputs[0].token_ids != a.outputs[0].token_ids


def test_n_greedy_samples_share_the_prompt(llm):
    prompt = {"prompt_token_ids": random_prompts(llm.config.arch.vocab_size, [21], 7)[0]}
    out = llm.generate(
        prompt, SamplingParams(temperature=0, n=3, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs) == 3
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids
    assert llm.engine.block_manager.num_referenced_blocks() == 0


def test_stop_strings_and_stop_tokens(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    tok_stop = full.token_ids[5]
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok_stop], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(tok_stop) + 1]
    assert out.stop_reason == tok_stop


def test_logprobs_and_prompt_logprobs_match_transformers(llm, hf_model):
    ids = random_prompts(llm.config.arch.vocab_size, [20], 8)[0]
    params = SamplingParams(
        temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    full = ids + out.outputs[0].token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos][ids[pos]]
        assert entry.logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        assert len(out.prompt_logprobs[pos]) <= 3
    for k, token in enumerate(out.outputs[0].token_ids):
        pos = out.outputs[0].logprobs[k]
        assert pos[token].rank == 1  # greedy picks the most likely token
        top3 = ref[len(ids) - 1 + k].topk(3)
        assert list(pos)[:1] == [token]
        assert sorted(pos) == sorted(top3.indices.tolist())
        for tid, v in zip(top3.indices.tolist(), top3.values.tolist(), strict=False):
            assert pos[tid].logprob == pytest.approx(v, abs=1e-4)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(out.outputs[0].logprobs[k][t].logprob for k, t in enumerate(out.outputs[0].token_ids))
    )


def test_prompt_logprobs_of_a_long_prompt_match_transformers_at_every_position(llm, hf_model):
    """A 300-token prompt is scored 128 positions at a time (step_sampler.PROMPT_LOGPROB_ROWS):
    every position's prompt token, its log-probability, its rank and the top 2, across the
    pieces' seams."""
    from zllm.executor.sample.step_sampler import PROMPT_LOGPROB_ROWS

    ids = random_prompts(llm.config.arch.vocab_size, [300], 9)[0]
    assert len(ids) - 1 > 2 * PROMPT_LOGPROB_ROWS
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        scored, theirs = out.prompt_logprobs[pos], ref[pos - 1]
        entry = scored[ids[pos]]
        assert entry.logprob == pytest.approx(theirs[ids[pos]].item(), abs=1e-4), pos
        assert entry.rank == int((theirs > theirs[ids[pos]]).sum()) + 1, pos
        top2 = theirs.topk(2)
        assert {t: lp.rank for t, lp in scored.items() if t in top2.indices.tolist()} == {
            t: r + 1 for r, t in enumerate(top2.indices.tolist())
        }, pos


def test_chat_applies_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    expected = tok.encode(
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert out.prompt_token_ids == expected


def test_many_prompts_stream_through_continuous_batching(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_num_seqs=32)
    prompts = random_prompts(
        llm.config.arch.vocab_size, [random.Random(i).randrange(1, 30) for i in range(1000)], 9
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    steps_before = llm.engine.scheduler._step_id
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outputs) == 1000 and all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    # 1000 requests x 5 steps each would be 5000 steps one by one; batched they take far fewer.
    assert llm.engine.scheduler._step_id - steps_before < 400


def test_kv_memory_per_token_and_waste(llm):
    arch = llm.config.arch
    # 2 (K and V) x layers x kv_heads x head_dim x 4 bytes (fp32)
    assert kv_bytes_per_token(arch, torch.float32) == 2 * 2 * 2 * 16 * 4
    pool = llm.model_runner.kv_caches
    assert sum(t.numel() * t.element_size() for t in pool) == (
        llm.model_runner.num_blocks
        * llm.config.cache.block_size
        * kv_bytes_per_token(arch, torch.float32)
    )
    # While requests run, allocated-but-unused slots stay under one block per sequence.
    bm = llm.engine.block_manager
    sched = llm.engine.scheduler

    for i, n in enumerate([5, 16, 17, 40]):
        llm.engine.add_request(
            EngineCoreRequest(
                f"w{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=7, ignore_eos=True)
            )
        )
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step(llm.executor)
        steps += 1
        for req in sched.running:
            slots = bm.num_held_blocks(req.req_id) * bm.block_size
            assert 0 <= slots - req.num_computed_tokens < bm.block_size
        allocated, used = sched.kv_slot_usage()
        assert allocated - used < bm.block_size * max(1, sched.num_running)
    assert steps >= 7


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", GREEDY, "empty"),
        ({"prompt_token_ids": []}, GREEDY, "empty"),
        ({"prompt_token_ids": [1] * 600}, GREEDY, "maximum context length"),
        ({"prompt_token_ids": [10**9]}, GREEDY, "out of vocabulary"),
        ({"prompt": "salted", "cache_salt": ""}, GREEDY, "cache_salt must be a non-empty"),
    ],
)
def test_bad_input_gets_clear_error_and_engine_keeps_serving(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["good prompt", prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the good one was not left queued
    assert llm.generate("still serving", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_cache_salt_keeps_prefix_cache_hits_within_the_salt(llm):
    """vLLM's prompt dicts take a `cache_salt`: the prompt's KV blocks are found again only
    under the same salt, and the answer is the same whichever blocks it took."""
    ids = random_prompts(llm.config.arch.vocab_size, [70], seed=55)[0]  # seen by no other test

    def run(salt: str | None):
        prompt = {"prompt_token_ids": ids} | ({} if salt is None else {"cache_salt": salt})
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first_cached, first = run("alice")
    assert first_cached == 0
    again_cached, again = run("alice")
    assert again_cached >= 64 and again == first  # a hit under the same salt
    assert run("bob") == (0, first)  # another salt computes it all
    assert run(None) == (0, first)  # and so does no salt
    assert run("bob")[0] >= 64  # bob's own blocks are found by bob


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n must"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="nope"):
        LLM("/nope/does-not-exist")
