"""--kv-cache-dtype bf16 / fp16 / int8: the KV pool stores 16-bit values, or int8 rows
with a scale each (issue 37; formats in zllm/kv/kv_dtypes.py).

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
from zllm.config.kv_layout import block_bytes, layout_fingerprint
from zllm.executor.attention.paged import AttentionMetadata, PagedAttention
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kv.quant import dequantize_rows, narrow, quantize_rows, widen
from zllm.executor.kv.transfer import transfer_layout

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
# The rounding a stored value takes: bf16 keeps 8 significant bits, fp16 11; int8 is off by
# at most half a step of its row's absmax / 127 (relative to the row's largest value).
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "int8": 0.5 / 127}
# Bytes of a (slot, head) row of the tiny model (head_dim 16): fp32's, and each narrow
# dtype's (int8: 16 values and the bf16 scale of their one group).
ROW_BYTES = {"fp32": 64, "bf16": 32, "fp16": 32, "int8": 18}


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
def test_decode_kernel_on_a_narrow_cache_against_float64(kv, head_dim):
    gen = torch.Generator().manual_seed(3)
    block_size, blocks, kvh, heads = 4, 40, 2, 6
    fp32 = torch.randn(2, blocks, block_size, kvh, head_dim, generator=gen)
    fp32[1, :, :, 1] *= 10  # V rows of different ranges (K's would sharpen the softmax)
    cache = narrow(fp32, DTYPES[kv])
    stored = widen(cache, torch.float32, head_dim)
    lens = torch.tensor([1, 7, 33, 60])
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:15] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_kernels.paged_decode_attention(q, cache, tables, lens, scale)
    exact = reference(q, stored, tables, lens, block_size, scale)
    # fp32 arithmetic on the stored values: fp32 rounding only.
    fp32_bound = 1e-5 * exact.abs().max()
    assert (out.double() - exact).abs().max() < fp32_bound
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
    assert (decode.double() - exact).abs().max() < fp32_bound


def tiny_llm(path, kv="bf16", **kwargs) -> LLM:
    kwargs = {"block_size": 4, "kv_cache_memory_bytes": 1 << 20, **kwargs}
    return LLM(path, kv_cache_dtype=kv, **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("kv", list(DTYPES))
def test_a_narrow_pool_holds_more_tokens_and_answers_alike_however_it_computes(tiny_llama_dir, kv):
    llm = tiny_llm(tiny_llama_dir, kv)
    fp32 = tiny_llm(tiny_llama_dir, "auto")
    assert {t.dtype for t in llm.model_runner.kv_tensors} == {DTYPES[kv]}
    block_bytes = llm.engine.stats.kv_pool.block_bytes
    assert block_bytes * ROW_BYTES["fp32"] == fp32.engine.stats.kv_pool.block_bytes * ROW_BYTES[kv]
    assert llm.model_runner.num_blocks == (1 << 20) // block_bytes
    assert sum(t.nbytes for t in llm.model_runner.kv_tensors) <= 1 << 20
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
    assert small.engine.heartbeat().load.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in together] == alone


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_blocks_offloaded_and_loaded_back_at_their_stored_width(tiny_llama_dir, kv):
    llm = tiny_llm(tiny_llama_dir, kv, kv_offload_bytes=4 << 20, num_gpu_blocks_override=16)
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
    int8 = EngineArgs(model=tiny_llama_dir, kv_cache_dtype="int8").create_engine_config()
    assert block_bytes(int8) * ROW_BYTES["fp32"] == block_bytes(fp32) * ROW_BYTES["int8"]
    assert len({layout_fingerprint(c) for c in (fp32, bf16, int8)}) == 3
    assert transfer_layout(int8) not in (transfer_layout(fp32), transfer_layout(bf16))
    # The model's own dtype is no change at all; another on a 16-bit model is refused, and
    # so is what has no kernel: int8 off the CPU, fp8 anywhere.
    same = EngineArgs(model=tiny_llama_dir, kv_cache_dtype="auto").create_engine_config()
    assert same.cache.kv_cache_dtype is None
    with pytest.raises(ValueError, match="needs float32 activations"):
        EngineArgs(
            model=tiny_llama_dir, dtype="bfloat16", kv_cache_dtype="fp16"
        ).create_engine_config()
    with pytest.raises(ValueError, match="runs on CPU only: the CUDA attention kernels"):
        EngineArgs(
            model=tiny_llama_dir, device="cuda", dtype="float32", kv_cache_dtype="int8"
        ).create_engine_config()
    with pytest.raises(ValueError, match="CPUs have no fp8 arithmetic"):
        EngineArgs(model=tiny_llama_dir, kv_cache_dtype="fp8_e4m3").create_engine_config()


def test_int8_rows_keep_each_value_within_half_a_step_of_their_groups_scale():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(50, 3, 64, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    x[7, 1] = 0  # an all-zero row: scales 0, values 0
    x[8, 2, 5] = float(x[8, 2].abs().max()) * -4  # an outlier: -127 in its group only
    rows = quantize_rows(x)
    assert rows.shape == (50, 3, 64 + 2 * 2) and rows.dtype == torch.int8  # 2 groups of 32
    scale = rows[..., 64:].contiguous().view(torch.bfloat16).float()  # [50, 3, 2]
    groups = x.view(50, 3, 2, 32)
    assert torch.equal(scale, (groups.abs().amax(-1) / 127).to(torch.bfloat16).float())
    assert int(rows[8, 2, 5]) == -127 and rows[..., :64].abs().max() == 127
    assert rows[8, 2, 32:64].abs().max() > 100  # the other group keeps its own range
    back = dequantize_rows(rows, 64)
    assert torch.equal(back[7, 1], torch.zeros(64))
    error = (back - x).view(50, 3, 2, 32).abs()
    assert (error <= scale[..., None] * 0.5 * (1 + 1e-6)).all()
    assert torch.equal(widen(narrow(x, torch.int8), torch.float32, 64), back)
    # Row widths: a scale per 32 values, else per 16 or 8; 72 and 80 share a width.
    assert [quantize_rows(torch.ones(d)).shape[-1] for d in (256, 80, 72, 16, 40)] == [
        272,
        90,
        90,
        18,
        50,
    ]
