"""--kv-cache-dtype bf16 / fp16: the KV pool stores 16-bit values (issue 37).

Attention reads them widened to fp32, exactly; what changes is the rounding of K and V when
they are stored. Every path that reads the cache (the CPU decode kernel, the torch decode
and prefill paths, a fresh prompt's own K/V) sees the rounded values, so prefix hits,
chunked prefill and preemption give the answers a fresh run gives.
"""

from __future__ import annotations

import math

import pytest
import torch

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.executor import cpu_kernels
from zllm.executor.attention import AttentionMetadata, PagedAttention
from zllm.executor.kv_transfer import transfer_layout
from zllm.kv.tiers import block_bytes, layout_fingerprint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The rounding a stored value takes: bf16 keeps 8 significant bits, fp16 11.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def reference(q, kv, tables, lens, block_size, scale):
    """Attention in float64 over the cache's values as stored (widened exactly)."""
    kv = kv.double()
    out = torch.empty(q.shape, dtype=torch.float64)
    S, H, D = q.shape
    kvh = kv.shape[3]
    for s in range(S):
        pos = torch.arange(int(lens[s]))
        slots = tables[s][pos // block_size] * block_size + pos % block_size
        k = kv[0].reshape(-1, kvh, D)[slots]  # [L, kvh, D]
        v = kv[1].reshape(-1, kvh, D)[slots]
        for h in range(H):
            g = h // (H // kvh)
            w = torch.softmax(k[:, g] @ q[s, h].double() * scale, 0)
            out[s, h] = w @ v[:, g]
    return out


@pytest.mark.parametrize("kv", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 40])  # the D = 64 kernel and the any-D loops
def test_decode_kernel_on_a_16_bit_cache_against_float64(kv, head_dim):
    gen = torch.Generator().manual_seed(3)
    block_size, blocks, kvh, heads = 4, 40, 2, 6
    fp32 = torch.randn(2, blocks, block_size, kvh, head_dim, generator=gen)
    cache = fp32.to(DTYPES[kv])
    lens = torch.tensor([1, 7, 33, 60])
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:15] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_kernels.paged_decode_attention(q, cache, tables, lens, scale)
    exact = reference(q, cache, tables, lens, block_size, scale)
    # fp32 arithmetic on the stored values: fp32 rounding only.
    assert (out.double() - exact).abs().max() < 1e-5
    # Against the unrounded fp32 cache: bounded by the storage's rounding of K and V.
    unrounded = reference(q, fp32, tables, lens, block_size, scale)
    bound = 8 * UNIT_ROUNDOFF[kv] * unrounded.abs().max()
    assert 0 < (out.double() - unrounded).abs().max() < bound
    # The torch decode path reads the same values.
    layer = PagedAttention(heads, kvh, head_dim, scale)
    decode = layer._decode(
        q,
        cache,
        AttentionMetadata.build(
            query_lens=[1] * len(lens),
            seq_lens=lens.tolist(),
            block_tables=tables.tolist(),
            slot_mapping=[0] * len(lens),
            block_size=block_size,
            device="cpu",
        ).decode,
        block_size,
    )
    assert (decode.double() - exact).abs().max() < 1e-5


def tiny_llm(path, kv="bf16", **kwargs) -> LLM:
    kwargs = {"block_size": 4, "kv_cache_memory_bytes": 1 << 20, **kwargs}
    return LLM(path, kv_cache_dtype=kv, **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("kv", list(DTYPES))
def test_a_16_bit_pool_holds_twice_the_tokens_and_answers_alike_however_it_computes(
    tiny_llama_dir, kv
):
    llm = tiny_llm(tiny_llama_dir, kv)
    fp32 = tiny_llm(tiny_llama_dir, "auto")
    assert {t.dtype for t in llm.model_runner.kv_tensors} == {DTYPES[kv]}
    assert llm.model_runner.num_blocks == 2 * fp32.model_runner.num_blocks
    assert llm.engine.stats.kv_block_bytes * 2 == fp32.engine.stats.kv_block_bytes
    prompt = {"prompt_token_ids": list(range(5, 45))}
    fresh = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    hit = llm.generate(prompt, GREEDY, use_tqdm=False)[0]  # its prefix from the cache
    assert hit.num_cached_tokens > 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids
    chunked = tiny_llm(tiny_llama_dir, kv, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert chunked.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == (
        fresh.outputs[0].token_ids
    )
    # Preempted and recomputed: 12 blocks of 4 for 4 sequences of ~40 tokens.
    small = tiny_llm(tiny_llama_dir, kv, num_gpu_blocks_override=24, max_num_batched_tokens=64)
    batch = [{"prompt_token_ids": list(range(5 + i, 45 + i))} for i in range(4)]
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in batch]
    together = small.generate(batch, GREEDY, use_tqdm=False)
    assert small.engine.heartbeat().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in together] == alone


def test_blocks_offloaded_and_loaded_back_at_their_stored_width(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, kv_offload_bytes=4 << 20, num_gpu_blocks_override=16)
    prompt = {"prompt_token_ids": list(range(5, 45))}  # 10 blocks
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    for i in range(3):  # other prompts push the first one's blocks out of the pool
        llm.generate({"prompt_token_ids": list(range(100 + 50 * i, 140 + 50 * i))}, GREEDY)
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert llm.engine.heartbeat().kv_tiers.hits[0] > 0  # loaded from the CPU tier
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_stored_dtype_names_the_blocks_tiers_and_transfers_keep(tiny_llama_dir):
    fp32 = EngineArgs(model=tiny_llama_dir).create_engine_config()
    bf16 = EngineArgs(model=tiny_llama_dir, kv_cache_dtype="bfloat16").create_engine_config()
    assert (fp32.kv_dtype, bf16.kv_dtype) == ("float32", "bfloat16")
    assert block_bytes(bf16) * 2 == block_bytes(fp32)
    assert layout_fingerprint(bf16) != layout_fingerprint(fp32)
    assert transfer_layout(bf16) != transfer_layout(fp32)
    # The model's own dtype is no change at all; another on a 16-bit model is refused.
    same = EngineArgs(model=tiny_llama_dir, kv_cache_dtype="auto").create_engine_config()
    assert same.cache.kv_cache_dtype is None
    with pytest.raises(ValueError, match="needs float32 activations"):
        EngineArgs(
            model=tiny_llama_dir, dtype="bfloat16", kv_cache_dtype="fp16"
        ).create_engine_config()


def test_bench_accuracy_measures_a_kv_dtype_against_fp32_kv(tiny_llama_dir, capsys):
    from zllm.cli import main

    argv = ["bench", "accuracy", "--model", tiny_llama_dir, "--kv-cache-dtype", "bf16"]
    assert main([*argv, "--num-prompts", "2", "--input-len", "16", "--output-len", "6"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("bf16 KV vs fp32 on 6 prompts x 6 greedy tokens"), line
    assert "logprob drift" in line
    assert main(["bench", "accuracy", "--model", tiny_llama_dir]) == 2  # nothing to measure
    assert "--quantization method or a --kv-cache-dtype" in capsys.readouterr().err
