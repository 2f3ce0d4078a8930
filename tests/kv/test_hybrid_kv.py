"""The hybrid KV cache end to end: a tiny Qwen2 mixing one full-attention layer with two
sliding-window layers (transformers' use_sliding_window / max_window_layers), run by the real
engine against transformers, with sliding groups releasing blocks outside the window."""

from __future__ import annotations

import random

import pytest
from parity import assert_greedy_parity, hf_greedy

from zllm import LLM, SamplingParams
from zllm.bench.kv import concurrent_sequences
from zllm.kv.cache_groups import KVCacheGroup, kv_cache_groups
from zllm.model.arch_config import ModelArchConfig
from zllm.protocol import EngineCoreRequest

WINDOW = 8
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    from tiny_models import write_tiny_model

    path = tmp_path_factory.mktemp("tiny-qwen2-sliding")
    # Layer 0 attends everything; layers 1 and 2 see their last WINDOW positions.
    write_tiny_model(
        path,
        arch="qwen2",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    return str(path)


@pytest.fixture(scope="module")
def hf_model(hybrid_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hybrid_dir).eval()
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return model


def make_llm(path: str, **kwargs) -> LLM:
    kwargs = {"block_size": BLOCK, "max_num_batched_tokens": 16, **kwargs}
    return LLM(path, kv_cache_memory_bytes=8 << 20, **kwargs)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def check(hf_model, prompts, outputs, label):
    for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
        theirs = hf_greedy(hf_model, p, len(out.outputs[0].token_ids))
        assert_greedy_parity(hf_model, p, out.outputs[0].token_ids, theirs, label=f"{label}[{i}]")


def test_groups_of_the_model(hybrid_dir):
    llm = make_llm(hybrid_dir)
    assert llm.model_runner.kv_groups == [
        KVCacheGroup((0,), None),
        KVCacheGroup((1,), WINDOW),
        KVCacheGroup((2,), WINDOW),
    ]
    assert llm.engine.block_manager.windows == [None, WINDOW, WINDOW]
    # One layer per block: three tensors would waste two thirds of the pool.
    assert len(llm.model_runner.kv_tensors) == 1


@pytest.mark.parametrize("hybrid", [True, False])
def test_greedy_parity_past_the_window_with_chunked_prefill(hybrid_dir, hf_model, hybrid):
    """Prompts shorter and far longer than the window, prefilled in chunks of 16 tokens;
    --no-hybrid-kv-cache keeps every block but must compute the same thing."""
    llm = make_llm(hybrid_dir, hybrid_kv_cache=hybrid)
    assert len(llm.model_runner.kv_groups) == (3 if hybrid else 1)
    prompts = prompts_of([3, 8, 9, 20, 37, 70])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    check(hf_model, prompts, outputs, f"hybrid={hybrid}")


def test_prefix_hit_in_every_group(hybrid_dir, hf_model):
    llm = make_llm(hybrid_dir)
    shared = prompts_of([40], seed=1)[0]
    first = llm.generate({"prompt_token_ids": shared + [5]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    prompt = shared + [7, 9, 11]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    # The shared 40 tokens are 10 full blocks: all reused (the sliding groups' window ones).
    assert out.num_cached_tokens == 40
    check(hf_model, [prompt], [out], "prefix-hit")


def test_preemption_with_a_small_pool(hybrid_dir, hf_model):
    """A pool too small for the batch: requests are preempted, their blocks in every group
    freed, and recomputed later with the same greedy output."""
    llm = make_llm(hybrid_dir, num_gpu_blocks_override=40)
    prompts = prompts_of([30, 45, 25, 50], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    check(hf_model, prompts, outputs, "preempted")
    assert llm.engine.block_manager.num_referenced_blocks() == 0


def test_long_sequence_holds_only_its_window_in_sliding_groups(hybrid_dir):
    """Decoding far past the window: each sliding group holds about window/block_size + 1
    blocks, the full group the whole context."""
    llm = make_llm(hybrid_dir)
    engine, bm = llm.engine, llm.engine.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    engine.add_request(EngineCoreRequest("long", prompts_of([20])[0], params))
    held: list[tuple[int, int, int]] = []
    while engine.has_unfinished_requests():
        engine.update(llm.model_runner.execute_model(engine.schedule()))
        req = engine.scheduler.requests.get("long")
        if req is not None and bm.block_ids("long"):
            held.append(
                (
                    req.num_computed_tokens,
                    bm.num_held_blocks("long", 0),
                    bm.num_held_blocks("long", 1),
                )
            )
    computed, full, sliding = held[-1]
    assert computed > 150
    assert full == -(-computed // BLOCK) or full == -(-(computed + 1) // BLOCK)
    assert max(s for c, _, s in held if c > 40) <= WINDOW // BLOCK + 1
    assert bm.num_referenced_blocks() == 0


def test_hybrid_pool_holds_more_long_sequences():
    """`zllm bench kv-capacity`'s count, on a Gemma-3-like layout (5 sliding : 1 full)."""
    arch = ModelArchConfig(
        architecture="gemma3",
        family="gemma3",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_layers=12,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(12)],
        sliding_window=512,
    )
    hybrid, plain = kv_cache_groups(arch), kv_cache_groups(arch, hybrid=False)
    assert [len(g.layers) for g in hybrid] == [2] * 6 and len(plain) == 1
    # The same bytes: blocks of 2 layers (hybrid) vs 12 layers (one group).
    context = 4096
    on = concurrent_sequences(6 * 3000, 16, [g.sliding_window for g in hybrid], context, 2048)
    off = concurrent_sequences(3000, 16, [None], context, 2048)
    assert off == 3000 // (context // 16)
    # Per sequence: 256 full blocks + 5 x (32 or 33) sliding blocks of 2 layers, vs 256 of
    # 12 layers; the last sequence may not fit because its prefill briefly holds a chunk
    # more than its window in each sliding group.
    assert 6 * 3000 // (256 + 5 * 33) - 1 <= on <= 6 * 3000 // (256 + 5 * 32)
    assert on > 3 * off
