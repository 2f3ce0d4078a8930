"""Sampler unit tests: exact asserts where the answer is determined, bounded statistics else."""

from __future__ import annotations

import math

import pytest
import torch

from zllm.executor.sample.logits_processors import apply_penalties
from zllm.executor.sample.sampler import Sampler, SamplingMetadata
from zllm.sampling_params import SamplingParams

VOCAB = 32


def build(
    params: list[SamplingParams],
    vocab_size: int = VOCAB,
    generators: list[torch.Generator | None] | None = None,
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
    banned: list[list[int]] | None = None,
) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata.build(
        params,
        generators or [None] * rows,
        prompt_ids or [[] for _ in range(rows)],
        output_ids or [[] for _ in range(rows)],
        banned or [[] for _ in range(rows)],
        vocab_size,
        "cpu",
    )


def logits_from_probs(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log().expand(rows, -1).contiguous()


def sampled_set(logits: torch.Tensor, metadata: SamplingMetadata) -> set[int]:
    return set(Sampler()(logits, metadata).sampled_token_ids.tolist())


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(6, VOCAB)
    metadata = build([SamplingParams(temperature=0.0, top_k=3, top_p=0.5) for _ in range(6)])
    assert metadata.all_greedy and not metadata.all_random
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.logprobs_token_ids is None
    assert out.sampled_token_ranks is None


def test_input_logits_not_modified() -> None:
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)] * 4
    Sampler()(logits, build(params, output_ids=[[1, 2]] * 4, banned=[[3]] * 4))
    assert torch.equal(logits, before)
    # Greedy, with a ban or a penalty (the sampler copies), and with neither (it reads the
    # logits as they are): the input stays as it was either way.
    greedy = [SamplingParams(temperature=0.0)] * 4
    for metadata in (
        build(greedy, banned=[[int(before[0].argmax())]] * 4),
        build([SamplingParams(temperature=0.0, presence_penalty=2.0)] * 4, output_ids=[[1]] * 4),
        build(greedy),
    ):
        Sampler()(logits, metadata)
        assert torch.equal(logits, before)


def test_first_max_index_is_argmaxs_index_on_ties_and_nan() -> None:
    """The sampler's greedy pick (torch.max's indices, faster than argmax on CPU) gives the
    first of tied maxima and a NaN's index, as argmax does."""
    from zllm.executor.sample.sampler import first_max_index

    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        x = torch.randint(-3, 3, (8, 300), generator=generator).float()  # many ties
        if trial % 3 == 0:
            x[0, [5, 200]] = float("nan")
        x[1] = float("-inf")
        assert torch.equal(first_max_index(x), x.argmax(dim=-1))


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9% quantiles of chi-square with df degrees of freedom: a fixed seed keeps the test
# deterministic, the loose quantile keeps it meaningful if the seed is ever changed.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature: float) -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    rows = 20_000
    logits = base.expand(rows, -1).contiguous()
    out = Sampler()(logits, build([SamplingParams(temperature=temperature)] * rows, 6))
    counts = torch.bincount(out.sampled_token_ids, minlength=6).float()
    expected = torch.softmax(base / temperature, dim=-1)
    assert chi_square(counts, expected) < CHI2_999[5]


def test_top_k_never_outside_top_k() -> None:
    rows = 64
    top_ks = [1 + row % 7 for row in range(rows)]
    params = [SamplingParams(temperature=1.5, top_k=k) for k in top_ks]
    metadata = build(params)
    sampler = Sampler()
    for _ in range(20):
        logits = torch.randn(rows, VOCAB)
        sampled = sampler(logits, metadata).sampled_token_ids
        for row, k in enumerate(top_ks):
            assert sampled[row].item() in logits[row].topk(k).indices.tolist()


def test_top_k_mixed_with_disabled_rows() -> None:
    rows = 2000
    params = [SamplingParams(top_k=2 if row % 2 == 0 else 0) for row in range(rows)]
    logits = logits_from_probs([0.3, 0.3, 0.2, 0.2], rows)
    sampled = Sampler()(logits, build(params, 4)).sampled_token_ids
    assert set(sampled[0::2].tolist()) == {0, 1}
    assert set(sampled[1::2].tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("top_p", "top_k", "nucleus"),
    [
        (0.45, 0, {0}),  # 0.5 >= 0.45
        (0.7, 0, {0, 1}),  # 0.5 < 0.7 <= 0.75
        (0.8, 0, {0, 1, 2}),  # 0.75 < 0.8 <= 0.9
        (0.95, 0, {0, 1, 2, 3}),
        # Top-p looks at probabilities renormalised over the top-k survivors:
        # [0.5, 0.25, 0.15] / 0.9 -> cumulative 0.556, 0.833, 1.0.
        (0.8, 3, {0, 1}),
        (0.9, 3, {0, 1, 2}),
        (0.95, 2, {0, 1}),
    ],
)
def test_top_p_keeps_exactly_the_nucleus(top_p: float, top_k: int, nucleus: set[int]) -> None:
    rows = 4000
    probs = [0.5, 0.25, 0.15, 0.1]
    params = [SamplingParams(top_p=top_p, top_k=top_k)] * rows
    sampled = Sampler()(logits_from_probs(probs, rows), build(params, 4)).sampled_token_ids
    assert set(sampled.tolist()) == nucleus
    counts = torch.bincount(sampled, minlength=4).float()[sorted(nucleus)]
    expected = torch.tensor([probs[t] for t in sorted(nucleus)])
    if len(nucleus) > 1:
        assert chi_square(counts, expected / expected.sum()) < CHI2_999[len(nucleus) - 1]


def test_top_p_tiny_keeps_the_most_likely_token() -> None:
    rows = 16
    logits = torch.randn(rows, VOCAB) * 0.01  # nearly flat: only the best token survives
    params = [SamplingParams(top_p=1e-6)] * rows
    out = Sampler()(logits, build(params))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_p_per_row_values() -> None:
    rows = 3000
    cutoffs = [0.45, 0.7, 1.0]
    params = [SamplingParams(top_p=cutoffs[row % 3]) for row in range(rows)]
    sampled = Sampler()(logits_from_probs([0.5, 0.25, 0.15, 0.1], rows), build(params, 4))
    ids = sampled.sampled_token_ids
    assert set(ids[0::3].tolist()) == {0}
    assert set(ids[1::3].tolist()) == {0, 1}
    assert set(ids[2::3].tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize(("min_p", "kept"), [(0.0, {0, 1, 2, 3}), (0.4, {0, 1, 2}), (0.6, {0, 1})])
def test_min_p(min_p: float, kept: set[int]) -> None:
    rows = 3000
    params = [SamplingParams(min_p=min_p)] * rows
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1], rows)  # thresholds 0.16 and 0.24
    assert sampled_set(logits, build(params, 4)) == kept


def test_min_p_applies_after_temperature() -> None:
    rows = 3000
    # At T=0.5 the probabilities become [0.4^2, 0.3^2, 0.2^2, 0.1^2] / 0.3, i.e. 0.533, 0.3,
    # 0.133, 0.033; min_p=0.3 cuts at 0.16, dropping token 2 that T=1 would keep (0.2 >= 0.12).
    params = [SamplingParams(temperature=0.5, min_p=0.3)] * rows
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1], rows)
    assert sampled_set(logits, build(params, 4)) == {0, 1}


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run_steps(
    step_logits: list[torch.Tensor], params: list[SamplingParams], gens: list
) -> torch.Tensor:
    """Sample one step per logits tensor with the same generators; [steps, B] token ids."""
    sampler = Sampler()
    metadata = build(params, generators=gens)
    return torch.stack([sampler(logits, metadata).sampled_token_ids for logits in step_logits])


def test_seeded_rows_reproducible_and_independent_of_batch() -> None:
    steps, rows, seeded_row = 10, 8, 3
    step_logits = [torch.randn(rows, VOCAB) for _ in range(steps)]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=10),
        SamplingParams(temperature=1.0, seed=42),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.0),
    ]
    gens = [seeded(p.seed) if p.seed is not None else None for p in params]
    batch = run_steps(step_logits, params, gens)

    solo_logits = [logits[seeded_row : seeded_row + 1] for logits in step_logits]
    solo = run_steps(solo_logits, [params[seeded_row]], [seeded(42)])
    again = run_steps(solo_logits, [params[seeded_row]], [seeded(42)])
    assert torch.equal(batch[:, seeded_row], solo[:, 0])
    assert torch.equal(solo, again)
    assert len(set(solo[:, 0].tolist())) > 1  # it really samples, not argmax

    other_seed = run_steps(solo_logits, [params[seeded_row]], [seeded(43)])
    assert not torch.equal(solo, other_seed)


def test_unseeded_rows_differ() -> None:
    rows = 64
    logits = torch.zeros(rows, 1000)
    sampler = Sampler()
    metadata = build([SamplingParams()] * rows, 1000)
    first = sampler(logits, metadata).sampled_token_ids
    second = sampler(logits, metadata).sampled_token_ids
    assert len(set(first.tolist())) > rows // 2
    assert not torch.equal(first, second)


def test_mixed_batch_greedy_random_seeded() -> None:
    rows = 6
    logits = torch.randn(rows, VOCAB)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=0.0, seed=6),  # greedy wins over the seed
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, seed=5),
    ]
    gens = [seeded(p.seed) if p.seed is not None else None for p in params]
    metadata = build(params, generators=gens)
    assert not metadata.all_greedy and not metadata.all_random
    assert sorted(metadata.generators) == [2, 5]
    sampled = Sampler()(logits, metadata).sampled_token_ids
    argmax = logits.argmax(dim=-1)
    assert sampled[0] == argmax[0] and sampled[3] == argmax[3] and sampled[4] == argmax[4]
    assert sampled[1].item() in logits[1].topk(2).indices.tolist()
    for row in (2, 5):
        solo = Sampler()(logits[row : row + 1], build([params[row]], generators=[seeded(5)]))
        assert sampled[row] == solo.sampled_token_ids[0]


def naive_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
) -> torch.Tensor:
    out = logits.clone()
    for row, p in enumerate(params):
        for token in set(prompt_ids[row]) | set(output_ids[row]):
            value = out[row, token].item()
            r = p.repetition_penalty
            out[row, token] = value / r if value > 0 else value * r
        for token in set(output_ids[row]):
            count = output_ids[row].count(token)
            out[row, token] -= p.frequency_penalty * count + p.presence_penalty
    return out


@pytest.mark.parametrize(
    "penalties",
    [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=-0.7),
        dict(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1),
    ],
)
def test_penalties_match_naive_reference(penalties: dict[str, float]) -> None:
    rows = 5
    generator = torch.Generator().manual_seed(1)
    prompt_ids = [torch.randint(VOCAB, (n,), generator=generator).tolist() for n in (0, 3, 9, 1, 5)]
    output_ids = [
        torch.randint(VOCAB, (n,), generator=generator).tolist() for n in (4, 0, 12, 1, 7)
    ]
    output_ids[2] += [7, 7, 7]  # repeats, so frequency counts exceed one
    params = [SamplingParams(**penalties) for _ in range(rows - 1)] + [SamplingParams()]
    metadata = build(params, prompt_ids=prompt_ids, output_ids=output_ids)
    logits = torch.randn(rows, VOCAB) * 3
    expected = naive_penalties(logits, params, prompt_ids, output_ids)
    actual = logits.clone()
    apply_penalties(actual, metadata)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(actual[-1], logits[-1])  # the row without penalties is untouched


def test_penalties_steer_greedy() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5)]
    metadata = build(params, 4, output_ids=[[0]])
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1]


def test_unused_features_stay_none() -> None:
    metadata = build([SamplingParams(), SamplingParams(temperature=0.0)])
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.presence_penalty is None and metadata.frequency_penalty is None
    assert metadata.repetition_penalty is None
    assert metadata.prompt_token_ids is None and metadata.output_token_ids is None
    assert metadata.banned_tokens is None and metadata.max_num_logprobs is None
    assert metadata.temperature.tolist() == [1.0, 0.0]

    metadata = build(
        [SamplingParams(frequency_penalty=0.5), SamplingParams()],
        prompt_ids=[[1, 2], [3]],
        output_ids=[[4], [5, 6, 7]],
    )
    assert metadata.prompt_token_ids is None  # only repetition reads the prompt
    assert metadata.output_token_ids.tolist() == [[4, VOCAB, VOCAB], [5, 6, 7]]


def test_banned_tokens_never_sampled() -> None:
    rows = 500
    logits = logits_from_probs([0.7, 0.2, 0.05, 0.05], rows)
    params = [SamplingParams(temperature=0.0 if row % 5 == 0 else 1.0) for row in range(rows)]
    banned = [[0, 1] if row % 2 == 0 else [0] for row in range(rows)]
    sampled = Sampler()(logits, build(params, 4, banned=banned)).sampled_token_ids
    assert set(sampled[0::2].tolist()) <= {2, 3}
    assert set(sampled[1::2].tolist()) <= {1, 2, 3}
    assert sampled[5].item() == 1  # greedy, odd row: best token left is 1


def test_sampler_runs_its_processors_in_order_after_the_raw_logprobs() -> None:
    """Banned tokens, then penalties (logits_processors.SAMPLER_PROCESSORS), on the fp32
    copy: the logprobs stay those of the raw logits; a sampler without processors ignores
    the bans."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=0.0, logprobs=1, frequency_penalty=1.5)]
    metadata = build(params, 4, output_ids=[[2]], banned=[[1]])
    out = Sampler()(logits, metadata)
    # 1 is banned, 2 pays 1.5 for its one earlier use: 3 (1.0) beats it (0.5).
    assert out.sampled_token_ids.tolist() == [3]
    assert out.logprobs_token_ids.tolist() == [[3, 1]]  # the raw logits' best is still 1
    assert Sampler(processors=())(logits, metadata).sampled_token_ids.tolist() == [1]


@pytest.mark.parametrize("num_logprobs", [0, 3, VOCAB + 5])
def test_logprobs_from_raw_logits(num_logprobs: int) -> None:
    rows = 8
    logits = torch.randn(rows, VOCAB) * 2
    params = [
        SamplingParams(
            temperature=0.0 if row < 2 else 0.7,
            repetition_penalty=1.5,
            logprobs=num_logprobs if row % 2 == 0 else None,
        )
        for row in range(rows)
    ]
    metadata = build(params, prompt_ids=[[0, 1, 2]] * rows, banned=[[5]] * rows)
    assert metadata.max_num_logprobs == num_logprobs
    out = Sampler()(logits, metadata)
    k = min(num_logprobs, VOCAB)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.shape == (rows, k + 1) and out.logprobs_token_ids.shape == (rows, k + 1)
    assert out.logprobs.dtype == torch.float32 and out.logprobs_token_ids.dtype == torch.int64

    sampled = out.sampled_token_ids
    assert torch.equal(out.logprobs_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top_values, top_ids = raw.topk(k, dim=-1)
    assert torch.equal(out.logprobs_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_values)
    assert bool((out.logprobs[:, 1:].diff(dim=-1) <= 0).all())
    expected_ranks = [1 + int((raw[row] > raw[row, sampled[row]]).sum()) for row in range(rows)]
    assert out.sampled_token_ranks.tolist() == expected_ranks
    assert 5 not in sampled.tolist()


def test_logprobs_of_half_precision_logits_are_fp32() -> None:
    logits = torch.randn(3, VOCAB).to(torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=2)] * 3))
    expected = torch.log_softmax(logits.float(), dim=-1).topk(2, dim=-1).values
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs[:, 1:], expected)
    assert math.isclose(float(out.logprobs[0, 0]), float(expected[0, 0]), rel_tol=1e-6)


# ---- the model runner: how many samples a request draws --------------------------------------
@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    from zllm.config.engine import CacheConfig, EngineConfig, SchedulerConfig
    from zllm.executor.model_runner import ModelRunner
    from zllm.model.arch import read_arch_config

    config = EngineConfig(
        model=tiny_llama_dir,
        model_path=tiny_llama_dir,
        arch=read_arch_config(tiny_llama_dir),
        cache=CacheConfig(block_size=4, num_blocks=16),
        scheduler=SchedulerConfig(max_model_len=64),
    )
    return ModelRunner(config)


def run_step(runner, step_id: int, scheduled: dict[str, int], **changes):
    from zllm.protocol import SchedulerOutput

    return runner.execute_model(
        SchedulerOutput(
            step_id=step_id,
            new_requests=changes.pop("new_requests", []),
            cached_requests=[],
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            **changes,
        )
    )


def new_request(req_id: str, params: SamplingParams, blocks: list[int], sample_index: int = 0):
    from zllm.protocol import NewRequestData

    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=[5, 6, 7, 8, 9],
        output_token_ids=[],
        sampling_params=params,
        block_ids=[blocks],
        num_computed_tokens=0,
        sample_index=sample_index,
    )


def test_runner_draws_the_samples_the_scheduler_asks_for(runner) -> None:
    from zllm.protocol import ForkedRequestData

    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=4)
    # A client id may hold '#': the scheduler, not the id, says how many samples to draw.
    out = run_step(
        runner, 1, {"a#b": 5}, new_requests=[new_request("a#b", params, [0, 1])],
        num_samples={"a#b": 3},
    )  # fmt: skip
    assert out.req_ids == ["a#b"] and len(out.sampled_token_ids[0]) == 3
    first, second, _ = out.sampled_token_ids[0]
    assert runner.requests["a#b"].output_token_ids == [first]
    assert set(runner.sampling.child_generators) == {("a#b", 1), ("a#b", 2)}

    # Sample 1 draws from its own seeded stream: the same prompt as sample 1 alone agrees.
    alone = run_step(runner, 2, {"one": 5}, new_requests=[new_request("one", params, [2, 3], 1)])
    assert alone.sampled_token_ids == [[second]]

    # The fork of sample 1 takes its parked generator; when the parent finishes, sample 2's
    # (never forked: say it stopped at its first token) goes too.
    parked = runner.sampling.child_generators[("a#b", 1)]
    fork = ForkedRequestData(req_id="a#b.1", parent_req_id="a#b", sample_index=1,
                             first_token_id=second)  # fmt: skip
    run_step(runner, 3, {}, forked_requests=[fork], finished_req_ids=["a#b", "one"])
    child = runner.requests["a#b.1"]
    assert child.generator is parked and child.output_token_ids == [second]
    assert "a#b" not in runner.requests and runner.sampling.child_generators == {}

    # Without num_samples an n > 1 request draws one token: forking is the scheduler's call.
    out = run_step(runner, 4, {"c": 5}, new_requests=[new_request("c", params, [4, 5])])
    assert [len(tokens) for tokens in out.sampled_token_ids] == [1]
