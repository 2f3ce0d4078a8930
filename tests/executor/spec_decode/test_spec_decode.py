"""Speculative decoding: proposals (n-gram lookup, a draft model), the scheduler's handling of
them, and rejection sampling that keeps the target model's distribution exactly.

Greedy: token for token the output of the engine without speculation (and so of
transformers). Sampled: the empirical distribution of verified tokens matches the target's
softmax within a chi-square bound. Both on tiny random models, offline and served.
"""

from __future__ import annotations

import random
import re
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats
from servers import wait_until
from tiny_models import write_tiny_model

from zllm import LLM, SamplingParams
from zllm.executor.sample.sampler import SamplingMetadata, processed_probs, verify_drafts
from zllm.executor.spec_decode.ngram import NgramProposer
from zllm.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-spec")))


@pytest.fixture(scope="module")
def base(model_dir) -> LLM:
    return LLM(model_dir, kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def ngram(model_dir) -> LLM:
    return LLM(model_dir, kv_cache_memory_bytes=32 << 20, speculative_config=NGRAM)


def prompts_with_repeats(count: int, seed: int = 0) -> list[dict]:
    """Random token prompts that repeat a stretch of themselves, so lookup finds n-grams."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        body = [rng.randrange(3, 430) for _ in range(rng.randrange(6, 40))]
        prompts.append({"prompt_token_ids": body + body[: rng.randrange(2, 6)]})
    return prompts


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for out in outputs for c in out.outputs]


def counters(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.heartbeat()
    return s.spec.num_drafts, s.spec.num_draft_tokens, s.spec.num_accepted_tokens


# ---- proposals ------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    lookup = NgramProposer(num_speculative_tokens=3, lookup_min=1, lookup_max=3)
    # "1 2 3" occurred twice; the later occurrence (followed by 7 8 9) wins.
    assert lookup.propose_one([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3]) == [7, 8, 9]
    # The longest suffix n-gram wins over a later shorter one: "5 6" -> 1, not "6" -> 2.
    assert lookup.propose_one([5, 6, 1, 0, 6, 2, 0, 5, 6]) == [1, 0, 6]
    # Near the end only what exists is proposed; no recurrence, no proposal.
    assert lookup.propose_one([4, 9, 4]) == [9, 4]
    assert lookup.propose_one([1, 2, 3, 4]) == []
    strict = NgramProposer(num_speculative_tokens=3, lookup_min=2, lookup_max=2)
    assert strict.propose_one([1, 2, 3, 9, 2]) == []  # only 1-grams recur


# ---- rejection sampling ---------------------------------------------------------------------


def _metadata(rows: int, **params) -> SamplingMetadata:
    sp = SamplingParams(**params)
    return SamplingMetadata.build(
        [sp] * rows, [None] * rows, [[]] * rows, [[]] * rows, [[]] * rows, 16, "cpu"
    )


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=6), dict(temperature=1.3, top_p=0.8)],
)
@pytest.mark.parametrize("draft", [0, 3, 11])
def test_verified_tokens_follow_the_target_distribution(params, draft) -> None:
    """Whatever the proposal (a likely token, an unlikely one, one top-k drops), the
    emitted token is distributed as the target's processed softmax: chi-square p > 1e-4."""
    torch.manual_seed(0)
    logits = torch.randn(16) * 2
    rows = 60_000
    metadata = _metadata(rows, **params)
    expected = processed_probs(logits[None].clone(), _metadata(1, **params))[0]
    sampled, accepted = verify_drafts(
        logits.expand(rows, -1).clone(), None, metadata, torch.full((rows,), draft)
    )
    counts = np.bincount(sampled.numpy(), minlength=16)
    assert counts[expected.numpy() == 0].sum() == 0  # never a token the target excludes
    keep = expected.numpy() > 0
    probs = expected.double().numpy()[keep]
    chi = stats.chisquare(counts[keep], probs / probs.sum() * rows)
    assert chi.pvalue > 1e-4, (counts, expected)
    # Acceptance is the proposal's probability under the target.
    assert accepted.float().mean().item() == pytest.approx(expected[draft].item(), abs=0.01)


def test_greedy_rows_accept_exactly_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    metadata = _metadata(3, temperature=0.0)
    greedy = logits.argmax(dim=-1)
    sampled, accepted = verify_drafts(logits, greedy, metadata, torch.tensor([1, 2, -1]))
    assert sampled.tolist() == [1, 1, 0] and accepted.tolist() == [True, False, False]


# ---- offline engine: greedy parity ----------------------------------------------------------


def test_ngram_greedy_equals_plain_decoding_with_logprobs(base, ngram) -> None:
    """A mixed batch (some sequences with proposals, some without each step): the same
    tokens and the same logprobs as without speculation, and proposals were accepted."""
    prompts = prompts_with_repeats(12)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=3)
    before = counters(ngram)
    plain = base.generate(prompts, params, use_tqdm=False)
    spec = ngram.generate(prompts, params, use_tqdm=False)
    assert token_ids(spec) == token_ids(plain)
    for a, b in zip(plain, spec, strict=True):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(pa) == list(pb)  # the chosen token and the top 3, in order
            for token in pa:
                assert pb[token].logprob == pytest.approx(pa[token].logprob, abs=1e-4)
    drafts, proposed, accepted = (a - b for a, b in zip(counters(ngram), before, strict=True))
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed


def test_a_model_drafting_for_itself_accepts_everything(model_dir, base) -> None:
    llm = LLM(
        model_dir,
        kv_cache_memory_bytes=32 << 20,
        speculative_config={
            "method": "draft_model",
            "model": model_dir,
            "num_speculative_tokens": 3,
        },
    )
    prompts = prompts_with_repeats(6, seed=1)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == token_ids(
        base.generate(prompts, GREEDY, use_tqdm=False)
    )
    s = llm.engine.heartbeat()
    assert s.spec.num_draft_tokens > 0
    assert s.spec.num_accepted_tokens == s.spec.num_draft_tokens
    assert s.spec.accepted_per_pos[0] == s.spec.num_drafts


def test_a_different_draft_model_changes_nothing_but_speed(model_dir, base, tmp_path) -> None:
    """Another random model proposes mostly wrong tokens: the output is still the target's,
    under chunked prefill, prefix-cache hits and preemption (a pool so small it preempts)."""
    draft = str(write_tiny_model(tmp_path / "draft", seed=7, num_hidden_layers=1))
    llm = LLM(
        model_dir,
        num_gpu_blocks_override=40,
        block_size=4,
        max_num_batched_tokens=32,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4},
    )
    prompts = prompts_with_repeats(8, seed=2)
    expected = token_ids(base.generate(prompts, GREEDY, use_tqdm=False))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(prompts[-2:], GREEDY, use_tqdm=False)  # prefix-cache hits
    assert [o.num_cached_tokens > 0 for o in again] == [True, True]
    assert token_ids(again) == expected[-2:]
    s = llm.engine.heartbeat()
    assert 0 < s.spec.num_accepted_tokens < s.spec.num_draft_tokens


def test_ngram_under_preemption_chunking_and_prefix_hits(model_dir, base) -> None:
    llm = LLM(
        model_dir,
        num_gpu_blocks_override=40,
        block_size=4,
        max_num_batched_tokens=24,
        speculative_config=NGRAM,
    )
    prompts = prompts_with_repeats(10, seed=3)
    prompts += prompts[:3]
    out = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(out) == token_ids(base.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.spec.num_accepted_tokens > 0


def test_stops_inside_accepted_proposals(base, ngram) -> None:
    """A stop token, a stop string or max_tokens that falls inside a run of accepted
    proposals ends the output exactly where plain decoding ends it."""
    prompts = prompts_with_repeats(8, seed=4)
    plain = base.generate(prompts, GREEDY, use_tqdm=False)
    for i, prompt in enumerate(prompts):
        ids = plain[i].outputs[0].token_ids
        stop_at = ids[10 + i]
        text = plain[i].outputs[0].text
        variants = [
            SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_at]),
            SamplingParams(temperature=0.0, max_tokens=7 + i, ignore_eos=True),
        ]
        if len(text) > 20:
            variants.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[text[12:16]]))
        for params in variants:
            a = base.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            b = ngram.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
                a.token_ids,
                a.text,
                a.finish_reason,
                a.stop_reason,
            )


def test_n_samples_and_penalties_and_min_tokens(base, ngram) -> None:
    """Samples of an n > 1 request speculate each on their own; penalties and min_tokens see
    the proposals before each verified position: greedy outputs as without speculation."""
    prompts = prompts_with_repeats(4, seed=5)
    for params in (
        SamplingParams(temperature=0.0, max_tokens=30, n=3, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.2
        ),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20, presence_penalty=0.5),
    ):
        assert token_ids(ngram.generate(prompts, params, use_tqdm=False)) == token_ids(
            base.generate(prompts, params, use_tqdm=False)
        )


def test_structured_output_checks_and_rolls_back_proposals(base, ngram) -> None:
    """The grammar matcher masks every verified position after the proposals before it and
    comes back: outputs match the grammar and equal plain decoding's."""
    structured = StructuredOutputsParams(regex=r"(ab|cd){3,12}x")
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=structured)
    prompts = [f"ab cd ab cd {i}" for i in range(6)]
    before = counters(ngram)
    spec = ngram.generate(prompts, params, use_tqdm=False)
    assert [c.text for out in spec for c in out.outputs] == [
        c.text for out in base.generate(prompts, params, use_tqdm=False) for c in out.outputs
    ]
    for out in spec:
        assert re.fullmatch(r"(ab|cd){3,12}x", out.outputs[0].text), out.outputs[0].text
    _, proposed, accepted = (a - b for a, b in zip(counters(ngram), before, strict=True))
    assert proposed > 0 and accepted > 0


def test_disable_by_batch_size(model_dir, base) -> None:
    llm = LLM(
        model_dir,
        kv_cache_memory_bytes=32 << 20,
        speculative_config={**NGRAM, "disable_by_batch_size": 2},
    )
    prompts = prompts_with_repeats(6, seed=6)
    params = [
        SamplingParams(temperature=0.0, max_tokens=5 + 10 * i, ignore_eos=True) for i in range(6)
    ]
    out = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(out) == token_ids(base.generate(prompts, params, use_tqdm=False))
    many = llm.engine.scheduler.spec.num_drafts
    assert many > 0  # speculates once the batch has drained to two sequences
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.spec.num_drafts - many >= 5  # alone, it speculates at once


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "unknown key"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
    ],
)
def test_bad_speculative_configs_are_refused(model_dir, config, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, speculative_config=config)


def test_a_draft_with_another_vocabulary_is_refused(model_dir, tmp_path) -> None:
    other = str(write_tiny_model(tmp_path / "other", vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model_dir, speculative_config={"model": other, "num_speculative_tokens": 2})


# ---- offline engine: sampling keeps the distribution ----------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_tokens_keep_the_targets_distribution(model_dir, base, method) -> None:
    """The second token of every request is verified against top-k 3 of the target (a
    proposal outside it is always rejected): n-gram lookup proposes from a prompt holding
    every token once, the model drafting for itself proposes its argmax (accepted often).
    Given each first token, the second's empirical distribution matches the target's
    (chi-square over the groups together)."""
    rng = random.Random(8)
    prompt = list(range(base.config.arch.vocab_size))
    rng.shuffle(prompt)
    config = {"method": method, "num_speculative_tokens": 1}
    config.update({"prompt_lookup_min": 1} if method == "ngram" else {"model": model_dir})
    llm = LLM(model_dir, kv_cache_memory_bytes=64 << 20, speculative_config=config)
    params = [
        SamplingParams(temperature=1.0, top_k=3, max_tokens=2, seed=s, ignore_eos=True)
        for s in range(1500)
    ]
    out = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    s = llm.engine.heartbeat()
    assert s.spec.num_drafts == len(params)
    if method == "draft_model":
        assert 0.2 * len(params) < s.spec.num_accepted_tokens < 0.9 * len(params)
    pairs = [tuple(o.outputs[0].token_ids) for o in out]
    statistic, dof = 0.0, 0
    for first, count in Counter(p[0] for p in pairs).items():
        seconds = Counter(p[1] for p in pairs if p[0] == first)
        # The target's top 3 after `first`, from the engine without speculation.
        lp = (
            base.generate(
                {"prompt_token_ids": prompt + [first]},
                SamplingParams(temperature=1.0, max_tokens=1, logprobs=3),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .logprobs[0]
        )
        top = sorted(lp.items(), key=lambda kv: kv[1].rank)[:3]
        probs = np.exp([v.logprob for _, v in top])
        expected = probs / probs.sum() * count
        observed = np.array([seconds[t] for t, _ in top])
        assert observed.sum() == count  # nothing outside the top 3
        statistic += float(((observed - expected) ** 2 / expected).sum())
        dof += 2
    assert stats.chi2.sf(statistic, dof) > 1e-4, (statistic, dof)


# ---- served ---------------------------------------------------------------------------------


@pytest.mark.e2e
def test_served_with_ngram_speculation(model_dir, base, engine_pool, tmp_path) -> None:
    """`zllm serve --speculative-config`: the openai client gets plain decoding's greedy
    text, streamed and not, and /metrics counts drafts and accepted tokens."""
    import json

    from openai import OpenAI

    with engine_pool.serve(
        model_dir, tmp_path / "server.log", "--speculative-config", json.dumps(NGRAM)
    ) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        # Prompts that hold the model's own continuation of their ending: lookup pays.
        bodies = [p["prompt_token_ids"] for p in prompts_with_repeats(3, seed=10)]
        firsts = base.generate([{"prompt_token_ids": b} for b in bodies], params, use_tqdm=False)
        prompts = [b + o.outputs[0].token_ids + b for b, o in zip(bodies, firsts, strict=True)]
        token_prompts = [{"prompt_token_ids": p} for p in prompts]
        expected = [o.outputs[0].text for o in base.generate(token_prompts, params, use_tqdm=False)]
        for prompt, text in zip(prompts, expected, strict=True):
            kwargs = dict(model=model, prompt=prompt, max_tokens=32, temperature=0.0)
            extra = {"ignore_eos": True}
            got = client.completions.create(**kwargs, extra_body=extra).choices[0].text
            streamed = "".join(
                c.choices[0].text
                for c in client.completions.create(**kwargs, stream=True, extra_body=extra)
            )
            assert got == text and streamed == text
        names = (
            "vllm:spec_decode_num_drafts_total",
            "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total",
        )

        def read() -> tuple[str, dict[str, float]]:
            text = server.get("/metrics").text
            found = {n: re.search(rf"^{n}{{[^}}]*}} (\S+)$", text, re.M) for n in names}
            return text, {n: float(m.group(1)) if m else 0.0 for n, m in found.items()}

        # A heartbeat (every 0.5 s) carries the counters to the frontend.
        wait_until(lambda: read()[1]["vllm:spec_decode_num_accepted_tokens_total"] > 0, 10)
        metrics, values = read()
        assert values["vllm:spec_decode_num_drafts_total"] > 0
        assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"]
        assert re.search(
            r'^vllm:spec_decode_num_accepted_tokens_per_pos_total{.*position="0".*} [1-9]',
            metrics,
            re.M,
        )


# ---- the core: one step in flight for a speculating request ---------------------------------


def test_a_speculating_request_waits_for_its_step_while_others_schedule_ahead(base, ngram) -> None:
    """The core schedules step N+1 before step N returns. Without speculation a request that
    samples in N computes its pending token in N+1; with it, the request is held until N
    says how many proposals were accepted, then verifies the next proposals."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    from zllm.protocol import EngineCoreRequest

    prompt = list(range(base.config.arch.vocab_size))  # every token: lookup always proposes
    random.Random(9).shuffle(prompt)
    for llm, held in ((base, False), (ngram, True)):
        engine, runner = llm.engine, llm.model_runner
        engine.add_request(EngineCoreRequest("held", prompt, params, eos_token_ids=[0]))
        first = engine.schedule()
        ahead = engine.schedule()  # before the first step has returned
        assert (ahead is None) == held
        engine.update(runner.execute_model(first))
        if ahead is not None:
            engine.update(runner.execute_model(ahead))
        step = engine.schedule()
        if held:
            drafts = step.spec_token_ids["held"]
            assert drafts and step.num_scheduled_tokens["held"] == 1 + len(drafts)
        engine.abort(["held"])
        engine.update(runner.execute_model(step))
        while engine.has_unfinished_requests() or engine.num_steps_in_flight:
            step = engine.schedule()
            if step is not None:
                engine.update(runner.execute_model(step))


@pytest.mark.slow
def test_smollm2_ngram_greedy_equals_plain_and_accepts(smollm2_path) -> None:
    """The real model on edit-style chats (the answer repeats the prompt): prompt lookup's
    proposals are mostly accepted and the greedy tokens are exactly plain decoding's."""
    from zllm.bench.datasets import chat_prompts

    prompts = [{"prompt_token_ids": p} for p in chat_prompts("edit", 3, smollm2_path, seed=0)]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = LLM(smollm2_path, kv_cache_memory_bytes=256 << 20)
    spec = LLM(smollm2_path, kv_cache_memory_bytes=256 << 20, speculative_config=NGRAM)
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == token_ids(
        plain.generate(prompts, params, use_tqdm=False)
    )
    s = spec.engine.heartbeat()
    assert s.spec.num_accepted_tokens > 0.4 * s.spec.num_draft_tokens
