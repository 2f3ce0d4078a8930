"""What the offline engine answers, for the tests that check one feature leaves another's
answers alone: prompts n-gram speculation (NGRAM) finds proposals in, a needle request's
full logprob vectors among a crowd (batch invariance), and beam search's texts."""

from __future__ import annotations

import random

from zllm import LLM, BeamSearchParams, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


def prompts_with_repeats(count: int) -> list[dict]:
    """Prompts that repeat a stretch of themselves: n-gram lookup finds proposals."""
    rng = random.Random(3)
    prompts = []
    for _ in range(count):
        body = [rng.randrange(3, 400) for _ in range(rng.randrange(8, 30))]
        prompts.append({"prompt_token_ids": body + body[:4]})
    return prompts


def needle_vectors(llm: LLM, needle: list[int], count: int, max_tokens: int = 4) -> list[dict]:
    """The full logprob vector of each greedy token of `needle`, run among `count` other
    requests (random prompts, sampled): batch invariance compares count 0 with others."""
    vocab = llm.config.arch.vocab_size
    logprobs = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=vocab, ignore_eos=True
    )
    other = SamplingParams(temperature=1.0, max_tokens=6, seed=5)
    rng = random.Random(count)
    crowd = [
        {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(rng.randrange(1, 50))]}
        for _ in range(count)
    ]
    prompts = [{"prompt_token_ids": needle}, *crowd]
    out = llm.generate(prompts, [logprobs] + [other] * count, use_tqdm=False)[0].outputs[0]
    return [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]


def offline_beam_texts(llm: LLM, prompt: str) -> list[str]:
    """What served_answers.beam_texts answers, from the offline engine: each beam's text."""
    beams = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6))[0]
    prompt_len = len(llm.tokenizer.encode(prompt))
    return [llm.tokenizer.decode(b.tokens[prompt_len:]) for b in beams.sequences]
