"""Features that compose (issue 38): each pair runs and equals its single-feature reference.
docs/features.md's combination table names these tests; pairs tested in their own feature's file
are named there too (e.g. data-parallel engines sleeping: test_data_parallel.py).

Here: tensor- and pipeline-parallel ranks with sleep mode (every rank releases its memory
and wakes to the outputs it gave before, which are one rank's outputs); LoRA adapters with
deterministic execution (a request's logprobs bit for bit whatever shares its adapter);
tensor- and pipeline-parallel ranks with speculative decoding (ngram and a draft model: one
rank's greedy tokens, proposals accepted), with the CPU KV tier (each rank stores and loads
its own part of a block under the block's one hash; tensor-parallel ranks keep a disk tier
each and agree on failed loads) and with LoRA adapters (each rank its part of every
update); LoRA on the transformers backend (transformers' own linear modules wrapped); the
transformers backend over tensor-parallel ranks (its modules cut by transformers' plan) and
pipeline stages (transformers' forward over a stage's layers)."""

from __future__ import annotations

import random

import pytest
from offline_answers import needle_vectors, prompts_with_repeats
from resident_memory import resident_bytes
from servers import wait_until
from tiny_models import write_tiny_model

from zllm import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Tensor parallelism splits every matmul across the ranks of one engine.",
    "Pipeline stages hold consecutive layers and pass the residual stream on.",
]
POOL = 32 << 20  # each rank's KV pool, zeroed at allocation: resident


def token_ids(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def one_rank(tiny_llama_dir) -> list[list[int]]:
    return token_ids(LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL))


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> list[LoRARequest]:
    """tests/lora_adapters.py's three adapters of the tiny model (every projection; q/v with
    rsLoRA; the MLP), ids 1-3, written once for the module."""
    from lora_adapters import ADAPTERS, make_adapter

    root = tmp_path_factory.mktemp("adapters")
    return [
        LoRARequest(name, i, str(make_adapter(tiny_llama_dir, root / name, seed=i, **config)))
        for i, (name, config) in enumerate(ADAPTERS.items(), start=1)
    ]


def each_adapter_and_the_base(count: int, adapters: list[LoRARequest]) -> list:
    """One adapter (or None, the base model) per prompt, in turn: every step mixes them."""
    return [[*adapters, None][i % (len(adapters) + 1)] for i in range(count)]


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_every_rank_sleeps_and_wakes(tiny_llama_dir, one_rank, layout):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL, enable_sleep_mode=True, **layout)
    assert token_ids(llm) == one_rank
    pids = ["self", *(str(p.pid) for p in llm.executor.ranks.processes)]
    pool = sum(t.nbytes for t in llm.model_runner.kv_tensors)  # rank 0's
    assert pool > 0.8 * POOL
    for level in (1, 2):
        awake = [resident_bytes(pid) for pid in pids]
        llm.sleep(level=level)
        released = [a - resident_bytes(pid) for a, pid in zip(awake, pids, strict=True)]
        assert all(r >= 0.8 * pool for r in released), (level, released, pool)
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert token_ids(llm) == one_rank


def test_an_adapters_rows_are_batch_invariant_under_deterministic(tiny_llama_dir, adapters):
    """--deterministic with LoRA: the adapter's update runs in fixed row tiles too, so a
    needle request's full logprob vectors are the same bits alone and among 1 or 20 other
    requests of its adapter (and of the base); the adapter does change them."""
    lora = adapters[0]  # every projection
    llm = LLM(tiny_llama_dir, enable_lora=True, deterministic=True, kv_cache_memory_bytes=POOL)
    vocab = llm.config.arch.vocab_size
    needle = [random.Random(2).randrange(3, 400) for _ in range(40)]
    logprobs = SamplingParams(temperature=0.0, max_tokens=4, logprobs=vocab)
    other = SamplingParams(temperature=1.0, max_tokens=6, seed=5)

    def vectors(count: int, with_adapter: LoRARequest | None = lora) -> list[dict]:
        rng = random.Random(count)
        crowd = [
            {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(rng.randrange(1, 60))]}
            for _ in range(count)
        ]
        prompts = [{"prompt_token_ids": needle}, *crowd]
        params = [logprobs] + [other] * count
        loras = [with_adapter] + [lora if i % 3 else None for i in range(count)]
        out = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)[0].outputs[0]
        return [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]

    alone = vectors(0)
    assert vectors(1) == alone
    assert vectors(20) == alone
    assert vectors(0, with_adapter=None) != alone


@pytest.mark.parametrize(
    "layout, method",
    [({"tensor_parallel_size": 2}, "ngram"), ({"pipeline_parallel_size": 2}, "draft_model")],
    ids=["tp2-ngram", "pp2-draft_model"],
)
def test_ranks_speculate_and_answer_as_one_rank(tiny_llama_dir, layout, method):
    """Proposals are made where the step's tokens are sampled (every rank samples alike, the
    answering rank's proposals reach the core), verified by every rank: the greedy tokens of
    one rank without speculation, and proposals accepted (the draft model is the target
    itself, so it proposes what the target then samples; n-gram lookup finds the loops a
    random model's greedy text falls into)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    if method == "draft_model":
        spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3}
    prompts = prompts_with_repeats(6)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    def greedy(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = greedy(LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL))
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL, speculative_config=spec, **layout)
    assert greedy(llm) == expected
    stats = llm.engine.heartbeat().spec
    assert stats.num_accepted_tokens > 0, stats
    if method == "draft_model":  # drafting for itself: every proposal is the target's token
        assert stats.num_accepted_tokens == stats.num_draft_tokens, stats


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_ranks_offload_a_prefix_and_load_it_back(tiny_llama_dir, layout):
    """A pool of 16 blocks: later prompts push the first one's blocks out to the CPU tier
    (every rank its heads' or its layers' part), and asked again it loads back (tier hits)
    and answers as one rank does."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = {"prompt_token_ids": list(range(5, 45))}  # 10 blocks of 4
    others = [{"prompt_token_ids": list(range(100 + 50 * i, 140 + 50 * i))} for i in range(3)]
    kw = dict(block_size=4, num_gpu_blocks_override=16, kv_offload_bytes=4 << 20)
    reference = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL)
    expected = reference.generate(first, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny_llama_dir, **kw, **layout)
    assert llm.generate(first, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    for prompt in others:
        llm.generate(prompt, params, use_tqdm=False)
    again = llm.generate(first, params, use_tqdm=False)[0]
    assert llm.engine.heartbeat().kv_tiers.hits[0] > 0
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == expected


@pytest.mark.parametrize(
    "layout",
    [
        {"pipeline_parallel_size": 2},
        {"tensor_parallel_size": 4},
        {"tensor_parallel_size": 4, "model_impl": "transformers"},
        {"pipeline_parallel_size": 2, "model_impl": "transformers"},
    ],
    ids=["pp2", "tp4-replicated-kv-heads", "tp4-transformers-backend", "pp2-transformers-backend"],
)
def test_ranks_serve_adapters_as_one_rank(tiny_llama_dir, adapters, layout):
    """Three adapters (every projection; q/v with rsLoRA; the MLP) and the base model mixed in
    one batch: each rank keeps its part of an update (a column-parallel matmul its outputs'
    columns of B, a row-parallel one its input rows of A, summed by the all-reduce), so the
    greedy tokens are one rank's; the adapters change them. On the transformers backend the
    ranks cut transformers' modules by its plan, each of 4 ranks holding one of the 2 KV heads,
    and an adapter's row-parallel update joins the partial product before the all-reduce; on
    its 2 stages each wraps its own layers' modules with their layers' updates."""
    prompts = prompts_with_repeats(8)
    per_prompt = each_adapter_and_the_base(len(prompts), adapters)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def greedy(llm: LLM, adapters) -> list[list[int]]:
        outs = llm.generate(prompts, params, lora_request=adapters, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    kw = dict(enable_lora=True, max_loras=4, kv_cache_memory_bytes=POOL)
    one = LLM(tiny_llama_dir, **kw)
    expected = greedy(one, per_prompt)
    assert expected != greedy(one, None)
    assert greedy(LLM(tiny_llama_dir, **kw, **layout), per_prompt) == expected


def test_the_transformers_backend_serves_adapters_as_zllm_code_does(tiny_llama_dir, adapters):
    """--model-impl transformers with LoRA: transformers' q/k/v/o and MLP linear modules are
    wrapped one by one (zllm's models fuse them), over the [1, T] batch transformers' code
    sees: three adapters and the base mixed in one batch give zllm's model code's tokens."""
    prompts = prompts_with_repeats(8)
    per_prompt = each_adapter_and_the_base(len(prompts), adapters)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def greedy(impl: str) -> list[list[int]]:
        llm = LLM(
            tiny_llama_dir,
            model_impl=impl,
            enable_lora=True,
            max_loras=4,
            kv_cache_memory_bytes=POOL,
        )
        outs = llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    expected = greedy("zllm")
    assert greedy("transformers") == expected


def test_tensor_parallel_ranks_keep_a_disk_tier_each_and_agree_on_a_failed_load(
    tiny_llama_dir, tmp_path
):
    """Each rank writes its part of an evicted block to a directory of its own. Rank 1's copy
    of one block is then damaged: its load fails there and succeeds on rank 0; the ranks
    recompute the block together (what failed on any rank), so the tokens are still one
    rank's, and the core counts one failed load."""
    from zllm.config.kv_layout import tier_directory
    from zllm.kv.block_hash import hash_full_blocks
    from zllm.kv.tiers import TIER_DISK, block_file_name

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = {"prompt_token_ids": list(range(5, 45))}  # 10 blocks of 4
    others = [{"prompt_token_ids": list(range(100 + 50 * i, 140 + 50 * i))} for i in range(3)]
    reference = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL)
    expected = reference.generate(first, params, use_tqdm=False)[0].outputs[0].token_ids
    tier = str(tmp_path / "tier")
    kw = dict(block_size=4, num_gpu_blocks_override=16, kv_offload_dir=tier)
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **kw)
    assert llm.generate(first, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    for prompt in others:  # push the first prompt's blocks out of the pool, to the disk
        llm.generate(prompt, params, use_tqdm=False)
    files = [
        [
            tier_directory(llm.config, rank) / block_file_name(h)
            for h in hash_full_blocks(first["prompt_token_ids"], 4)
        ]
        for rank in (0, 1)
    ]
    assert wait_until(lambda: all(f.exists() for f in files[0][:4] + files[1][:4]), 10)
    victim = files[1][2]  # rank 1's part of the prompt's third block
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    again = llm.generate(first, params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == expected
    stats = llm.engine.heartbeat().kv_tiers
    assert stats.hits[TIER_DISK] > 0 and stats.load_failures[TIER_DISK] == 1, stats


@pytest.mark.parametrize("level", [1, 2])
def test_adapters_serve_again_after_sleep(tiny_llama_dir, adapters, level):
    """Sleep mode with LoRA: at level 2 the wrapped model is rebuilt and adapters are read
    again on first use; at level 1 they stay. Either way the adapter's tokens are the same
    after waking, and differ from the base model's."""
    lora = adapters[0]  # every projection
    llm = LLM(tiny_llama_dir, enable_lora=True, enable_sleep_mode=True, kv_cache_memory_bytes=POOL)
    prompts = prompts_with_repeats(3)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def tokens(adapter) -> list[list[int]]:
        outs = llm.generate(prompts, params, lora_request=adapter, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    before, base = tokens(lora), tokens(None)
    assert before != base
    llm.sleep(level=level)
    llm.wake_up()
    assert tokens(lora) == before and tokens(None) == base


def test_tensor_parallel_ranks_are_batch_invariant_under_deterministic(tiny_llama_dir):
    """--deterministic over two ranks: a needle's full logprob vectors are the same bits
    alone and among 20 other requests (each rank's matmuls in fixed tiles, the all-reduce
    over the same partial sums whatever the batch)."""
    llm = LLM(
        tiny_llama_dir, tensor_parallel_size=2, deterministic=True, kv_cache_memory_bytes=POOL
    )
    needle = [random.Random(5).randrange(3, 400) for _ in range(30)]
    assert needle_vectors(llm, needle, 20) == needle_vectors(llm, needle, 0)


@pytest.mark.parametrize("case", ["int8-kv", "hybrid-gemma3"])
def test_speculation_over_a_narrow_or_hybrid_cache(tiny_llama_dir, tmp_path, case):
    """ngram speculation verifies its proposals through whatever cache the model has: an
    int8 KV cache, or Gemma 3's hybrid groups (sliding and full): the greedy tokens of the
    same engine without speculation, with proposals accepted."""
    from tiny_models import tiny_gemma3_overrides, write_tiny_model

    path, kw = tiny_llama_dir, {"kv_cache_dtype": "int8"}
    if case == "hybrid-gemma3":
        path, kw = str(write_tiny_model(tmp_path, **tiny_gemma3_overrides(8))), {}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    prompts = prompts_with_repeats(6)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    def greedy(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = greedy(LLM(path, kv_cache_memory_bytes=POOL, **kw))
    llm = LLM(path, kv_cache_memory_bytes=POOL, speculative_config=spec, **kw)
    assert greedy(llm) == expected
    assert llm.engine.heartbeat().spec.num_draft_tokens > 0


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_ranks_run_beam_search_and_an_int8_cache_as_one_rank(tiny_llama_dir, layout):
    """Beam search over ranks (forks copy blocks on every rank) and an int8 KV cache split by
    heads or layers: one rank's beams and tokens."""
    from zllm import BeamSearchParams

    prompts = [p["prompt_token_ids"] for p in prompts_with_repeats(2)]
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(kv_cache_memory_bytes=POOL, kv_cache_dtype="int8")

    def run(llm: LLM):
        found = llm.beam_search([{"prompt_token_ids": p} for p in prompts], beams)
        greedy = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return (
            [[s.tokens for s in out.sequences] for out in found],
            [o.outputs[0].token_ids for o in greedy],
        )

    assert run(LLM(tiny_llama_dir, **kw, **layout)) == run(LLM(tiny_llama_dir, **kw))


def test_the_transformers_backend_splits_over_ranks_by_its_plan(tiny_llama_dir):
    """--model-impl transformers with two tensor-parallel ranks: transformers' q/k/v and
    gate/up cut by output rows, o/down by input columns and all-reduced (Llama's
    base_model_tp_plan), each rank attending with its heads over its part of the KV cache:
    one rank's greedy tokens, and its logprobs to 1e-4 (only the all-reduce's sum order
    differs)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    kw = dict(model_impl="transformers", kv_cache_memory_bytes=POOL)

    def run(llm: LLM) -> tuple[list, list]:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        steps = [zip(o.token_ids, o.logprobs, strict=True) for o in outs]
        logprobs = [[pos[t].logprob for t, pos in each] for each in steps]
        return [o.token_ids for o in outs], logprobs

    tokens, logprobs = run(LLM(tiny_llama_dir, **kw))
    split = LLM(tiny_llama_dir, tensor_parallel_size=2, **kw)
    assert split.model_runner.host.layout.arch.num_heads == 2  # rank 0's share of 4 query heads
    split_tokens, split_logprobs = run(split)
    assert split_tokens == tokens
    for ours, theirs in zip(split_logprobs, logprobs, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)


def tokens_and_logprobs(llm: LLM, prompts: list[str]) -> tuple[list, list]:
    """Greedy tokens and each one's logprob, per prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    logprobs = [
        [pos[t].logprob for t, pos in zip(o.token_ids, o.logprobs, strict=True)] for o in outs
    ]
    return [o.token_ids for o in outs], logprobs


def assert_stages_equal_one_rank(path: str, prompts: list[str], *layouts: dict) -> None:
    kw = dict(model_impl="transformers", kv_cache_memory_bytes=POOL)
    tokens, logprobs = tokens_and_logprobs(LLM(path, **kw), prompts)
    for layout in layouts:
        llm = LLM(path, **layout, **kw)
        staged_tokens, staged_logprobs = tokens_and_logprobs(llm, prompts)
        del llm
        assert staged_tokens == tokens, layout
        for ours, theirs in zip(staged_logprobs, logprobs, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-4), layout


@pytest.mark.parametrize(
    "layout",
    [{"pipeline_parallel_size": 2}, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}],
    ids=["pp2", "pp2-tp2"],
)
def test_the_transformers_backend_runs_pipeline_stages_as_one_rank(tiny_llama_dir, layout):
    """--model-impl transformers over 2 pipeline stages, and 2 stages x 2 tensor-parallel
    ranks: each stage runs transformers' base-model forward over its own decoder layers (the
    second from the received stream, the first stopping before the final norm), attending
    through its layers' part of the KV cache: one rank's greedy tokens and logprobs (to 1e-4:
    tensor parallelism's all-reduce sums in another order)."""
    assert_stages_equal_one_rank(tiny_llama_dir, PROMPTS, layout)


def test_the_transformers_backends_stages_split_gemma3s_sliding_and_global_layers(tmp_path):
    """A tiny Gemma 3 on the transformers backend over 2 stages: a sliding layer (window 4)
    on the first, the global one on the second, whose forward must pick the global mask and
    rotary table for its first layer (the stage's `layer_types`) and take the received stream
    as it is (Gemma scales its embeddings: not again). One rank's tokens and logprobs."""
    from tiny_models import randomize_norms_and_biases, tiny_gemma3_overrides

    overrides = {
        **tiny_gemma3_overrides(4),
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    path = randomize_norms_and_biases(write_tiny_model(tmp_path / "gemma3", **overrides))
    prompts = [p + " " + p for p in PROMPTS]  # past the window
    assert_stages_equal_one_rank(str(path), prompts, {"pipeline_parallel_size": 2})


def test_the_transformers_backends_later_stage_takes_the_stream_unscaled(tmp_path):
    """Granite multiplies its embeddings by embedding_multiplier inside the base model's
    forward: on the second of 2 stages the received stream replaces what that made of it,
    so it is not scaled twice. One rank's tokens and logprobs."""
    granite = write_tiny_model(
        tmp_path / "granite",
        "granite",
        logits_scaling=4.0,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
    )
    assert_stages_equal_one_rank(str(granite), PROMPTS, {"pipeline_parallel_size": 2})


def test_the_transformers_backend_refuses_stages_it_cannot_cut(tmp_path):
    """A base model that does not keep its decoder layers as a `layers` ModuleList (GPT-2's
    `h`) is refused at load on every stage, naming why."""
    gpt2 = write_tiny_model(tmp_path / "gpt2", "gpt2", num_key_value_heads=None)
    with pytest.raises(ValueError, match=r"does not keep its 2 decoder layers as a `layers`"):
        LLM(str(gpt2), model_impl="transformers", pipeline_parallel_size=2)


def test_the_transformers_backend_refuses_ranks_without_a_plan_it_can_cut(tmp_path):
    """An architecture transformers declares no tensor-parallel plan for (GPT-2), or one whose
    plan cuts experts (OLMoE), is refused at load on every rank, before a weight is read,
    naming the architecture and why."""
    from tiny_models import tiny_hf_config

    from zllm.executor.models.transformers.tp import usable_plan

    moe = tiny_hf_config("olmoe", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"olmoe cannot be split: its plan cuts experts \("):
        usable_plan(moe)
    assert usable_plan(tiny_hf_config("llama"))["layers.*.mlp.down_proj"] == "rowwise"
    gpt2 = write_tiny_model(tmp_path / "gpt2", "gpt2", num_key_value_heads=None)
    with pytest.raises(ValueError, match="transformers declares no tensor-parallel plan for gpt2"):
        LLM(str(gpt2), model_impl="transformers", tensor_parallel_size=2)
