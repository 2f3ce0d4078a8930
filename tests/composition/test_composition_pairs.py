"""Pairs of docs/features.md's combination table that run offline on one rank: sleep mode and the
CPU tier, each with the other features whose outputs they must not change; deterministic
mode's batch invariance with the others; the transformers backend with them (issue 38).

- Sleep × X: the engine sleeps at level 1 (the KV pool freed) and 2 (the weights too),
  its resident memory falls by at least the pool, and after waking it answers as before.
- Offload × X: a pool of 16 blocks of 4 tokens; later prompts push the first prompt's
  blocks out to the CPU tier, and asked again the engine loads them back (tier hits, cached
  tokens) and answers as it did the first time.

- Det × X: a needle request's full logprob vectors are the same bits alone and among 20
  other requests.
- HF × X: the transformers backend gives zllm's code's answers with X on the same model.
- Disagg × HF, KV dtype, Offload, Det: one served producer/consumer pair with all four;
  DP × LoRA, Spec, HF, Det, KV dtype: one server of two data-parallel engines with all
  five; DP × TP, Hybrid, Beam: two engines of two ranks each on a tiny Gemma 3;
  Disagg × Quant, Sleep, Beam: a served pair on a GGUF file, asleep and awake again.

The parallel layouts' pairs are in tests/test_composition.py; the tiers' own rules in
tests/test_kv_offload.py and tests/test_hybrid_tiers.py; sleep's in tests/test_sleep.py.
"""

from __future__ import annotations

import json
import random

import pytest
from offline_answers import NGRAM, needle_vectors, offline_beam_texts, prompts_with_repeats
from resident_memory import resident_bytes
from served_answers import assert_every_engine_served, beam_texts, per_engine
from tiny_models import tiny_gemma3_overrides, write_tiny_model

from zllm import LLM, BeamSearchParams, LoRARequest, SamplingParams
from zllm.kv.tiers import TIER_CPU

POOL = 32 << 20  # zeroed at allocation: resident
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BEAM = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
# Repeats give n-gram lookup something to find.
PROMPTS = [{"prompt_token_ids": [7, 8, 9, 10] * 6}, {"prompt_token_ids": list(range(30, 57))}]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> str:
    """A tiny Gemma 3: sliding, global, sliding layers (window 8): the hybrid KV cache."""
    return str(write_tiny_model(tmp_path_factory.mktemp("gemma3"), **tiny_gemma3_overrides(8)))


@pytest.fixture(scope="module")
def lora(tiny_llama_dir, tmp_path_factory) -> LoRARequest:
    from lora_adapters import ADAPTERS, make_adapter

    name, config = next(iter(ADAPTERS.items()))  # every projection
    path = make_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter") / name, 1, **config)
    return LoRARequest(name, 1, str(path))


def answers(llm: LLM, beam: bool, lora: LoRARequest | None = None) -> list:
    """Greedy token ids per prompt, or with `beam` each prompt's beams (tokens, score)."""
    if beam:
        outs = llm.beam_search(PROMPTS, BEAM, lora_request=lora)
        return [[(s.tokens, round(s.cum_logprob, 4)) for s in o.sequences] for o in outs]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# (model: "llama" or "gemma3", engine options, beam search?)
SLEEP_PAIRS = {
    "transformers-backend": ("llama", {"model_impl": "transformers"}, False),
    "deterministic": ("llama", {"deterministic": True}, False),
    "int8-kv-cache": ("llama", {"kv_cache_dtype": "int8"}, False),
    "ngram-speculation": ("llama", {"speculative_config": NGRAM}, False),
    "beam-search": ("llama", {}, True),
    "hybrid-kv-cache": ("gemma3", {}, False),
}


@pytest.mark.parametrize("pair", list(SLEEP_PAIRS))
def test_sleep_composes_with(tiny_llama_dir, gemma3_dir, pair):
    """Sleep × the transformers backend, deterministic mode, an int8 KV cache, speculation,
    beam search, the hybrid KV cache: at both levels the pool's memory is released and the
    answers after waking equal those before."""
    model, options, beam = SLEEP_PAIRS[pair]
    path = gemma3_dir if model == "gemma3" else tiny_llama_dir
    llm = LLM(path, kv_cache_memory_bytes=POOL, enable_sleep_mode=True, **options)
    before = answers(llm, beam)
    if pair == "ngram-speculation":
        assert llm.engine.heartbeat().spec.num_draft_tokens > 0
    pool = sum(t.nbytes for t in llm.model_runner.kv_tensors)
    for level in (1, 2):
        resident = resident_bytes()
        llm.sleep(level=level)
        assert resident - resident_bytes() >= 0.9 * pool, level
        llm.wake_up()
        assert answers(llm, beam) == before, level


# (engine options, beam search?, use the adapter?)
OFFLOAD_PAIRS = {
    "transformers-backend": ({"model_impl": "transformers"}, False, False),
    "deterministic": ({"deterministic": True}, False, False),
    "beam-search": ({}, True, False),
    "lora": ({"enable_lora": True}, False, True),
    "gguf-blocks": ({}, False, False),  # a GGUF file: its matmuls read the blocks
}


@pytest.mark.parametrize("pair", list(OFFLOAD_PAIRS))
def test_the_cpu_tier_composes_with(tiny_llama_dir, lora, tmp_path, pair):
    """Offload × the transformers backend, deterministic mode, beam search, LoRA (the
    adapter's blocks under its salt) and quantized matmuls: an evicted prefix comes back
    from the tier and the answers equal the first ones."""
    options, beam, use_lora = OFFLOAD_PAIRS[pair]
    path = tiny_llama_dir
    if pair == "gguf-blocks":
        from gguf import GGMLQuantizationType as T
        from gguf_files import write_llama_gguf

        path = str(tmp_path / "q8.gguf")
        write_llama_gguf(tmp_path / "q8.gguf", lambda name: T.Q8_0)
    kw = dict(block_size=4, num_gpu_blocks_override=16, kv_offload_bytes=4 << 20)
    llm = LLM(path, **kw, **options)
    if pair == "gguf-blocks":
        assert llm.model_runner.quantization == "gguf"
    adapter = lora if use_lora else None
    first = answers(llm, beam, adapter)
    if use_lora:  # (its blocks are salted apart from the base model's)
        assert first != answers(llm, beam)
    for i in range(3):  # other prompts, 10 blocks each: the first ones' blocks are evicted
        other = {"prompt_token_ids": list(range(100 + 50 * i, 140 + 50 * i))}
        llm.generate(other, GREEDY, lora_request=adapter, use_tqdm=False)
    hits = llm.engine.heartbeat().kv_tiers.hits[TIER_CPU]
    assert answers(llm, beam, adapter) == first
    assert llm.engine.heartbeat().kv_tiers.hits[TIER_CPU] > hits


# (model, engine options) deterministic mode runs with
DETERMINISTIC_PAIRS = {
    "hybrid-kv-cache": ("gemma3", {}),
    "int8-kv-cache": ("llama", {"kv_cache_dtype": "int8"}),
    "ngram-speculation": ("llama", {"speculative_config": NGRAM}),
    "transformers-backend": ("llama", {"model_impl": "transformers"}),
}


@pytest.mark.parametrize("pair", list(DETERMINISTIC_PAIRS))
def test_deterministic_mode_composes_with(tiny_llama_dir, gemma3_dir, pair):
    """Det × the hybrid KV cache, an int8 KV cache, speculation, the transformers backend: a
    needle request's full logprob vectors are the same bits alone and among 20 others."""
    model, options = DETERMINISTIC_PAIRS[pair]
    path = gemma3_dir if model == "gemma3" else tiny_llama_dir
    llm = LLM(path, deterministic=True, kv_cache_memory_bytes=POOL, **options)
    needle = [7, 8, 9, 10] * 5 + [random.Random(2).randrange(3, 400) for _ in range(20)]
    alone = needle_vectors(llm, needle, 0, max_tokens=6)
    assert len(alone) == 6 and len(alone[0]) >= llm.config.arch.vocab_size
    assert needle_vectors(llm, needle, 20, max_tokens=6) == alone


# (model, engine options, beam search?) the transformers backend runs with
TRANSFORMERS_PAIRS = {
    "beam-search": ("llama", {}, True),
    "int8-kv-cache": ("llama", {"kv_cache_dtype": "int8"}, False),
    "hybrid-kv-cache": ("gemma3", {}, False),
    "deterministic": ("llama", {"deterministic": True}, False),
}


@pytest.mark.parametrize("pair", list(TRANSFORMERS_PAIRS))
def test_the_transformers_backend_composes_with(tiny_llama_dir, gemma3_dir, pair):
    """HF × beam search, an int8 KV cache, the hybrid KV cache (Gemma 3's sliding and
    global layers in their own groups), deterministic mode: the answers zllm's own code
    gives with the same feature on the same model."""
    model, options, beam = TRANSFORMERS_PAIRS[pair]
    path = gemma3_dir if model == "gemma3" else tiny_llama_dir
    ours = LLM(path, kv_cache_memory_bytes=POOL, **options)
    theirs = LLM(path, kv_cache_memory_bytes=POOL, model_impl="transformers", **options)
    assert hasattr(theirs.model_runner.model, "hf")
    expected = answers(ours, beam)
    if beam:  # scores: fp32 sums in another order
        got = answers(theirs, beam)
        assert [[t for t, _ in b] for b in got] == [[t for t, _ in b] for b in expected]
        for b_got, b_expected in zip(got, expected, strict=True):
            assert [s for _, s in b_got] == pytest.approx([s for _, s in b_expected], abs=1e-3)
    else:
        assert answers(theirs, beam) == expected


@pytest.fixture(scope="module")
def gemma3_lora(gemma3_dir, tmp_path_factory) -> LoRARequest:
    from lora_adapters import ADAPTERS, make_adapter

    name, config = next(iter(ADAPTERS.items()))  # every projection
    path = make_adapter(gemma3_dir, tmp_path_factory.mktemp("gemma3-adapter") / name, 1, **config)
    return LoRARequest(name, 1, str(path))


@pytest.mark.parametrize("pair", ["beam-search", "lora"])
def test_the_hybrid_cache_composes_with(gemma3_dir, gemma3_lora, pair):
    """Hybrid × beam search (beams forking blocks in every group), LoRA: the answers of the
    same model with one KV cache group (every layer keeping every block)."""
    beam, options = pair == "beam-search", {"enable_lora": pair == "lora"}
    adapter = gemma3_lora if pair == "lora" else None
    hybrid = LLM(gemma3_dir, kv_cache_memory_bytes=POOL, **options)
    assert len(hybrid.engine.scheduler.block_manager.windows) == 3
    one_group = LLM(gemma3_dir, kv_cache_memory_bytes=POOL, hybrid_kv_cache=False, **options)
    got = answers(hybrid, beam, adapter)
    assert got == answers(one_group, beam, adapter)
    if adapter is not None:  # (a tiny random Gemma repeats one token: compare logprobs)
        scored = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)

        def first_logprob(lora: LoRARequest | None) -> float:
            out = hybrid.generate(PROMPTS[1], scored, lora_request=lora, use_tqdm=False)
            position = out[0].outputs[0].logprobs[0]
            return next(iter(position.values())).logprob

        assert abs(first_logprob(adapter) - first_logprob(None)) > 1e-3


# name -> (model, the pair's options, the reference's options, beam search?, the adapter?):
# the pair must give the reference's tokens (beams: their tokens, scores within 1e-2)
REFERENCE_PAIRS = {
    # Beam requests get no drafts (features.md note 6): the beams of an engine without speculation.
    "spec-beam": ("llama", {"speculative_config": NGRAM}, {}, True, False),
    # A target on the transformers backend speculates as zllm's code does.
    "spec-transformers": (
        "llama", {"model_impl": "transformers", "speculative_config": NGRAM},
        {"model_impl": "transformers"}, False, False,
    ),
    # An adapter's beams on zllm's code and on transformers' modules wrapped (features.md ✓21).
    "lora-beam": (
        "llama", {"enable_lora": True}, {"enable_lora": True, "model_impl": "transformers"},
        True, True,
    ),
    "lora-bf16-kv-cache": (
        "llama", {"enable_lora": True, "kv_cache_dtype": "bf16"}, {"enable_lora": True},
        False, True,
    ),
    "gguf-int8-kv-cache": ("gguf", {"kv_cache_dtype": "int8"}, {}, False, False),
    # Beams forking int8 blocks (rows and their scales), on zllm's code and transformers'.
    "beam-int8-kv-cache": (
        "llama", {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "int8", "model_impl": "transformers"},
        True, False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("pair", list(REFERENCE_PAIRS))
def test_pairs_answer_as_their_reference(tiny_llama_dir, lora, tmp_path, pair):
    """Spec × Beam, Spec × HF, LoRA × Beam, LoRA × KV dtype, KV dtype × Quant, Beam × KV
    dtype: each pair's tokens equal its reference's (the same requests without the second feature, or on the
    other model code)."""
    model, options, reference_options, beam, use_lora = REFERENCE_PAIRS[pair]
    path = tiny_llama_dir
    if model == "gguf":
        from gguf import GGMLQuantizationType as T
        from gguf_files import write_llama_gguf

        path = str(tmp_path / "q8.gguf")
        write_llama_gguf(tmp_path / "q8.gguf", lambda name: T.Q8_0)
    adapter = lora if use_lora else None
    llm = LLM(path, kv_cache_memory_bytes=POOL, **options)
    reference = LLM(path, kv_cache_memory_bytes=POOL, **reference_options)
    if pair == "spec-transformers":  # (a random model's greedy loops give lookup matches)
        prompts = prompts_with_repeats(6)
        long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

        def greedy(engine: LLM) -> list[list[int]]:
            return [o.outputs[0].token_ids for o in engine.generate(prompts, long, use_tqdm=False)]

        assert greedy(llm) == greedy(reference)
        assert llm.engine.heartbeat().spec.num_accepted_tokens > 0
        return
    got, expected = answers(llm, beam, adapter), answers(reference, beam, adapter)
    if pair == "gguf-int8-kv-cache":
        assert llm.model_runner.quantization == "gguf"
    if not beam:
        assert got == expected
        return
    assert [[t for t, _ in b] for b in got] == [[t for t, _ in b] for b in expected]
    for ours, theirs in zip(got, expected, strict=True):
        assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], abs=1e-2)
    if use_lora:
        assert got != answers(llm, beam)  # the adapter's beams are not the base model's


def test_beam_search_is_batch_invariant_under_deterministic(tiny_llama_dir):
    """Det × Beam: a prompt's beams (tokens and scores, every bit) are the same searched
    alone and beside two other prompts' searches."""
    llm = LLM(tiny_llama_dir, deterministic=True, kv_cache_memory_bytes=POOL)
    crowd = [{"prompt_token_ids": list(range(200, 200 + n))} for n in (5, 33)]

    def beams(prompts: list) -> list:
        out = llm.beam_search(prompts, BEAM)[0]
        return [(s.tokens, s.cum_logprob) for s in out.sequences]

    alone = beams(PROMPTS[1:])
    assert len(alone) == 3 and beams([PROMPTS[1], *crowd]) == alone


@pytest.mark.e2e
def test_a_served_pair_composes_with_the_backend_a_narrow_cache_a_tier_and_determinism(
    tiny_llama_dir, tmp_path
):
    """Disagg × HF, KV dtype, Offload, Det, in one producer/consumer pair (both servers with
    --model-impl transformers --kv-cache-dtype int8 --deterministic and a CPU tier): through
    the proxy the producer's own answers, the consumer loading every full prompt block from
    the transfer (int8 rows and their scales) with no wait timing out."""
    from disagg_pairs import PROMPTS, assert_pair_answers_as_one_server, served_pair
    from servers import free_port

    flags = (
        "--model-impl", "transformers", "--kv-cache-dtype", "int8", "--deterministic",
        "--kv-offload-bytes", "8M",
    )  # fmt: skip
    with served_pair(tiny_llama_dir, tmp_path, free_port(), *flags) as pair:
        assert_pair_answers_as_one_server(*pair, PROMPTS[:2])


@pytest.mark.e2e
def test_data_parallel_engines_compose_with_adapters_speculation_the_backend_and_more(
    tiny_llama_dir, lora, tmp_path
):
    """DP × LoRA, Spec, HF, Det, KV dtype: two engines, each with an adapter, ngram
    speculation, the transformers backend, deterministic mode and an int8 KV cache, answer
    every prompt (base and adapter) as the offline engine with the same options does, and
    both engines serve some of them."""
    import openai
    from servers import start_server, stop_server

    options = dict(
        enable_lora=True, speculative_config=NGRAM, model_impl="transformers",
        deterministic=True, kv_cache_dtype="int8",
    )  # fmt: skip
    prompts = [f"Request {i}: " + "tick tock " * (2 + i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    offline = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL, **options)
    expected = {}
    for adapter in (None, lora):
        outs = offline.generate(prompts, params, lora_request=adapter, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            expected[prompt, adapter is None] = out.outputs[0].text
    del offline
    assert any(expected[p, True] != expected[p, False] for p in prompts)  # the adapter acts
    flags = (
        "--data-parallel-size", "2", "--enable-lora", "--lora-modules", f"{lora.lora_name}={lora.lora_path}",
        "--speculative-config", json.dumps(NGRAM), "--model-impl", "transformers",
        "--deterministic", "--kv-cache-dtype", "int8",
    )  # fmt: skip
    server = start_server(tiny_llama_dir, tmp_path / "server.log", *flags)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        base = client.models.list().data[0].id
        for (prompt, is_base), text in expected.items():
            model = base if is_base else lora.lora_name
            answer = client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0
            )
            assert answer.choices[0].text == text, (prompt, model)
        assert_every_engine_served(server, len(expected))
        drafts = per_engine(server.get("/metrics").text, "vllm:spec_decode_num_draft_tokens_total")
        assert sum(drafts.values()) > 0, drafts
    finally:
        stop_server(server)


@pytest.mark.e2e
def test_data_parallel_engines_of_tensor_parallel_ranks_serve_a_hybrid_model_and_beams(
    gemma3_dir, tmp_path
):
    """DP × TP, Hybrid, Beam: two engines of two tensor-parallel ranks each, on a tiny Gemma
    3 (its sliding and global layers in their own KV cache groups), answer greedy and beam
    search requests as the offline engine on two ranks does, both engines serving."""
    from served_answers import greedy
    from servers import start_server, stop_server

    prompts = [f"Question {i}: " + "how far " * (1 + i) for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    offline = LLM(gemma3_dir, kv_cache_memory_bytes=POOL, tensor_parallel_size=2)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]
    expected_beams = offline_beam_texts(offline, prompts[0])
    del offline
    flags = ("--data-parallel-size", "2", "--tensor-parallel-size", "2")
    server = start_server(gemma3_dir, tmp_path / "server.log", *flags)
    try:
        assert greedy(server.url, prompts, max_tokens=10) == expected
        assert beam_texts(server.url, prompts[0]) == expected_beams
        assert_every_engine_served(server, len(prompts) + 1)
    finally:
        stop_server(server)


@pytest.mark.e2e
def test_a_served_pair_of_a_gguf_file_sleeps_and_wakes(tmp_path):
    """Disagg × Quant, Sleep, Beam: a producer/consumer pair on a Q8_0 GGUF file (its matmuls
    read the blocks), both servers in sleep mode: the pair answers as the producer, both
    sleep and wake, and the pair answers the same again, loading the new prompts from the
    transfer; a beam search through the proxy gives the producer's own beams."""
    from disagg_pairs import PROMPTS, assert_pair_answers_as_one_server, remote_hits, served_pair
    from gguf import GGMLQuantizationType as T
    from gguf_files import write_llama_gguf
    from served_answers import greedy
    from servers import free_port, wait_until

    path = tmp_path / "q8.gguf"
    write_llama_gguf(path, lambda name: T.Q8_0)
    with served_pair(str(path), tmp_path, free_port(), "--enable-sleep-mode") as pair:
        assert_pair_answers_as_one_server(*pair, PROMPTS[:2])
        prefill, decode, proxy = pair
        for server in (prefill, decode):
            assert "read GGUF blocks" in server.log_text()
            assert server.post("/sleep?level=2", {}).status_code == 200
            assert server.post("/wake_up", {}).status_code == 200
        hits = remote_hits(decode)
        reference = greedy(prefill.url, PROMPTS[2:], max_tokens=16)
        assert greedy(proxy.url, PROMPTS[2:], max_tokens=16) == reference
        assert wait_until(lambda: remote_hits(decode) > hits, 30), decode.log_tail()
        # Disagg × Beam: the proxy's prefill leg drops the beams; the consumer runs them.
        beams = [beam_texts(url, PROMPTS[0]) for url in (prefill.url, proxy.url)]
        assert len(beams[0]) == 3 and beams[1] == beams[0]
