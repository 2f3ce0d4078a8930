"""Attention sinks (gpt-oss: a logit per head in the softmax's denominator, with no value) in
every attention path against float64: the torch reference (executor/attention/sinks.py:
prefill, chunks after cached context, decode rows, sliding windows), the CPU decode kernel
(csrc/cpu/paged_attention.h), and csrc/'s CUDA decode and prefill kernels under the host
emulator (on a GPU: tests/test_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paged_reference import (
    TOLERANCE,
    decode_reference,
    packed_prefills,
    poison_released_blocks,
    prefill_reference,
    random_tables,
)
from torch.nn.attention.bias import causal_lower_right

from zllm.executor.attention import cuda_prefill as cp
from zllm.executor.attention import sinks as sink_module
from zllm.executor.attention.cuda import CudaAttentionMetadata, CudaPagedAttention
from zllm.executor.attention.paged import AttentionMetadata, PagedAttention
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cuda as ck

# (query count, context length) per sequence: q == 1 decodes, q == L is a whole prompt, a
# short run after cached context attends as decode rows, a longer one is a prefill chunk.
BATCHES = {
    "decode": [(1, 1), (1, 7), (1, 33), (1, 16), (1, 60)],
    "prefill": [(5, 5), (17, 17), (40, 40)],
    "chunked": [(4, 20), (16, 16), (30, 50)],
    "mixed": [(1, 12), (6, 6), (1, 40), (9, 25), (2, 2), (20, 45), (1, 1)],
}


def random_sinks(heads: int, gen: torch.Generator) -> torch.Tensor:
    """Sink logits around the scores' scale, one far above them (that head's output shrinks
    toward zero) and one far below (it barely counts)."""
    sinks = torch.randn(heads, generator=gen) * 2
    sinks[0], sinks[-1] = 9.0, -9.0
    return sinks


def flat_step(batch, block_size, heads, kv_heads, head_dim, dtype, gen, window=0):
    """A step's flat batch over a cache that already holds every context position (the
    step's own K/V included, so writing them again changes nothing): q [T, H, D], the new
    K/V, the block tables, slots, and (first token, query count, context length) per
    sequence for the references. With a window, blocks wholly before every query's window
    are released: -1 in the tables the step reads, 1e6 in the cache (a read would swamp)."""
    q_lens, lens = [q for q, _ in batch], [n for _, n in batch]
    num_blocks, tables = random_tables(lens, block_size, gen, torch.int64)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    flat = cache.view(2, -1, kv_heads, head_dim)
    seqs, slots, first = [], [], 0
    for s, (q_len, n) in enumerate(batch):
        seqs.append((first, q_len, n))
        pos = torch.arange(n - q_len, n)
        slots += (tables[s][pos // block_size] * block_size + pos % block_size).tolist()
        first += q_len
    query = torch.randn(first, heads, head_dim, generator=gen).to(dtype)
    new_k, new_v = flat[0, slots].clone(), flat[1, slots].clone()
    step_tables = [t[: -(-n // block_size)].tolist() for t, n in zip(tables, lens, strict=True)]
    if window:
        for table, q_len, n in zip(step_tables, q_lens, lens, strict=True):
            for i in range(max(0, n - q_len - window + 1) // block_size):
                cache[:, table[i]] = 1e6
                table[i] = -1
    return query, new_k, new_v, cache, tables, step_tables, slots, seqs


def reference(query, cache, tables, seqs, block_size, window, sinks) -> torch.Tensor:
    """float64 attention of every sequence's queries (decode rows too) with the sinks."""
    return prefill_reference(query, cache, tables, seqs, block_size, window, sinks)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("window", [0, 5, 8])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_torch_path_with_sinks_matches_float64(batch, window, block_size):
    """The torch path (SDPA's place taken by sink_attention) in float64, GQA 6/2: exact to
    rounding, and far from the same attention without sinks (the test can fail)."""
    gen = torch.Generator().manual_seed(block_size + window)
    pairs = BATCHES[batch]
    step = flat_step(pairs, block_size, 6, 2, 16, torch.float64, gen, window)
    query, new_k, new_v, cache, tables, step_tables, slots, seqs = step
    sinks = random_sinks(6, gen)
    expected = reference(query, cache, tables, seqs, block_size, window, sinks)
    meta = AttentionMetadata.build(
        [q for q, _ in pairs], [n for _, n in pairs], step_tables, slots, block_size, "cpu",
        sliding_window=window or None,
    )  # fmt: skip
    attn = PagedAttention(6, 2, 16)
    out = attn(query, new_k, new_v, cache, meta, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    plain = reference(query, cache, tables, seqs, block_size, window, None)
    assert (plain - expected).abs().max() > 0.1


@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("window", [0, 7])
def test_cpu_decode_kernel_with_sinks_matches_float64(batch, head_dim, window):
    """The CPU kernel backend (decode rows in csrc/cpu/paged_attention.h: the SIMD widths 64
    and 128 and the plain loop), fp32, GQA 8/2, blocks of 4."""
    if not cpu_kernels.enabled() or not cpu_kernels.cpu_supports_kernels():
        pytest.skip("CPU kernels disabled or unsupported here")
    gen = torch.Generator().manual_seed(head_dim + window)
    pairs = BATCHES[batch]
    step = flat_step(pairs, 4, 8, 2, head_dim, torch.float32, gen, window)
    query, new_k, new_v, cache, tables, step_tables, slots, seqs = step
    sinks = random_sinks(8, gen)
    meta = AttentionMetadata.build(
        [q for q, _ in pairs], [n for _, n in pairs], step_tables, slots, 4, "cpu",
        sliding_window=window or None,
    )  # fmt: skip
    attn = PagedAttention(8, 2, head_dim, decode_kernel=cpu_kernels.paged_decode_attention)
    out = attn(query, new_k, new_v, cache, meta, sinks=sinks)
    expected = reference(query, cache, tables, seqs, 4, window, sinks)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_cpu_decode_kernel_refuses_sinks_of_the_wrong_shape():
    if not cpu_kernels.enabled() or not cpu_kernels.cpu_supports_kernels():
        pytest.skip("CPU kernels disabled or unsupported here")
    kv_cache = torch.zeros(2, 4, 16, 1, 8)
    q, lens, tables = torch.randn(1, 2, 8), torch.tensor([5]), torch.tensor([[0]])
    with pytest.raises(RuntimeError, match="sinks must be contiguous fp32"):
        cpu_kernels.paged_decode_attention(q, kv_cache, tables, lens, 1.0, 0, torch.zeros(3))


def test_bfloat16_torch_path_with_sinks_is_close():
    gen = torch.Generator().manual_seed(5)
    pairs = BATCHES["mixed"]
    step = flat_step(pairs, 4, 4, 2, 32, torch.bfloat16, gen)
    query, new_k, new_v, cache, tables, step_tables, slots, seqs = step
    sinks = random_sinks(4, gen)
    meta = AttentionMetadata.build(
        [q for q, _ in pairs], [n for _, n in pairs], step_tables, slots, 4, "cpu"
    )
    out = PagedAttention(4, 2, 32)(query, new_k, new_v, cache, meta, sinks=sinks)
    assert out.dtype == torch.bfloat16
    expected = reference(query, cache, tables, seqs, 4, 0, sinks)
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)


def test_sink_attention_slices_long_prompts_and_reads_causal_biases(monkeypatch):
    """Query rows in slices (a long prompt's scores stay bounded) give the same result as one
    slice; causal_lower_right (the CUDA path's SDPA chunks) and None read as causal masks."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 20, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = random_sinks(4, gen)
    explicit = torch.arange(20)[None, :] <= torch.arange(9)[:, None] + 11
    whole = sink_module.sink_attention(q, k, v, explicit, 0.3, sinks)
    monkeypatch.setattr(sink_module, "SCORE_FLOATS", 2 * 4 * 20)  # two rows a slice
    sliced = sink_module.sink_attention(q, k, v, explicit, 0.3, sinks)
    biased = sink_module.sink_attention(q, k, v, causal_lower_right(9, 20), 0.3, sinks)
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-15)
    torch.testing.assert_close(biased, whole, rtol=0, atol=1e-15)
    square = sink_module.sink_attention(q, k[:, :, :9], v[:, :, :9], None, 0.3, sinks)
    expected = sink_module.sink_attention(
        q, k[:, :, :9], v[:, :, :9], torch.ones(9, 9, dtype=torch.bool).tril(), 0.3, sinks
    )
    torch.testing.assert_close(square, expected, rtol=0, atol=0)


# ---- csrc/'s CUDA kernels, emulated ---------------------------------------------------------
# (dtype, heads, kv_heads, head_dim, block_size, context lengths, window)
EMU_DECODE_CASES = {
    "f32-gqa8/2": (torch.float32, 8, 2, 64, 16, [1, 7, 33, 300], 0),
    "bf16-gqa9/3-splitk": (torch.bfloat16, 9, 3, 64, 8, [5, 600, 1100], 0),
    "f16-window-splitk": (torch.float16, 8, 2, 128, 8, [900, 20, 513], 600),
}


@pytest.mark.parametrize("target_blocks", [1, ck.TARGET_BLOCKS], ids=["long", "short"])
@pytest.mark.parametrize("case", EMU_DECODE_CASES)
def test_emulated_decode_with_sinks_matches_float64(emu, case, target_blocks, monkeypatch):
    """One partition per sequence (the sink folded into its softmax) and split contexts (the
    sink folded once, in zllm_paged_decode_reduce)."""
    monkeypatch.setattr(ck, "TARGET_BLOCKS", target_blocks)
    dtype, heads, kv_heads, head_dim, block_size, lens, window = EMU_DECODE_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    num_blocks, tables = random_tables(lens, block_size, gen)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    if window:
        released = [max(0, n - window) for n in lens]
        kv_cache = poison_released_blocks(kv_cache, tables, released, block_size)
    q = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(dtype)[:, :heads]
    sinks = random_sinks(heads, gen)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    launches = ck.plan_paged_decode(
        q, kv_cache, tables, torch.tensor(lens), head_dim**-0.5, out, max(lens),
        ck.DecodeWorkspace(), window, sinks,
    )  # fmt: skip
    emu.run_launches(launches)
    expected = decode_reference(q, kv_cache, tables, lens, block_size, window, sinks)
    err = (out.double() - expected).abs().max() / expected.abs().max()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    span = min(max(lens), window or max(lens))
    plan = ck.plan_decode(heads, kv_heads, span, len(lens))
    assert len(launches) == (2 if span > plan.partition_size else 1)


EMU_PREFILL_CASES = {
    "f32-ragged": (torch.float32, 4, 4, 64, 16, [(5, 5), (17, 17), (33, 33)], 0),
    "bf16-gqa9/3-chunks": (torch.bfloat16, 9, 3, 64, 8, [(20, 45), (1, 30), (16, 16)], 0),
    "f32-window-long-context": (torch.float32, 6, 2, 64, 16, [(20, 90), (33, 33)], 24),
}


@pytest.mark.parametrize("case", EMU_PREFILL_CASES)
def test_emulated_prefill_with_sinks_matches_float64(emu, case):
    """csrc/paged_prefill.cu with the sink starting each row's online softmax."""
    dtype, heads, kv_heads, head_dim, block_size, pairs, window = EMU_PREFILL_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    ctx_lens = [n for _, n in pairs]
    num_blocks, tables = random_tables(ctx_lens, block_size, gen)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    if window:
        released = [max(0, n - q - window + 1) for q, n in pairs]
        kv_cache = poison_released_blocks(kv_cache, tables, released, block_size)
    seqs, first = packed_prefills(pairs)
    q = torch.randn(first, heads, head_dim, generator=gen).to(dtype)
    sinks = random_sinks(heads, gen)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    starts, q_lens, lens = (np.array(c) for c in zip(*seqs, strict=True))
    batch = cp.PrefillBatch.build(
        starts, q_lens, lens, list(tables.numpy()), block_size, "cpu", window
    )
    emu.run_launches(cp.plan_paged_prefill(q, kv_cache, batch, head_dim**-0.5, out, sinks))
    expected = prefill_reference(q, kv_cache, tables, seqs, block_size, window, sinks)
    rows = torch.cat([torch.arange(f, f + n) for f, n, _ in seqs])
    got, want = out[rows].double(), expected[rows]
    err = (got - want).abs().max() / want.abs().max()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_cuda_layer_with_sinks_takes_the_kernels(emu, monkeypatch, dtype):
    """CudaPagedAttention with sinks on a mixed step (its kernels emulated) against float64;
    where FlashAttention would take a bf16 prefill (made to look available here), a layer
    with sinks takes csrc/paged_prefill.cu instead."""
    monkeypatch.setattr(ck, "run_launches", emu.run_launches)
    monkeypatch.setattr(cp, "uses_flash", lambda q, mode="auto": True)
    monkeypatch.setattr(cp, "flash_prefill", lambda *a, **k: pytest.fail("flash took sinks"))
    gen = torch.Generator().manual_seed(3)
    pairs = [(1, 12), (6, 6), (1, 40), (20, 45), (1, 1)]
    step = flat_step(pairs, 16, 8, 2, 64, dtype, gen)
    query, new_k, new_v, cache, tables, step_tables, slots, seqs = step
    sinks = random_sinks(8, gen)
    meta = CudaAttentionMetadata.build(
        [q for q, _ in pairs], [n for _, n in pairs], step_tables, slots, 16, "cpu"
    )
    emu.names.clear()
    out = CudaPagedAttention(8, 2, 64)(query, new_k, new_v, cache, meta, sinks=sinks)
    ran = {name.split("<")[0] for name in emu.names}
    assert {"zllm_paged_decode", "zllm_paged_prefill"} <= ran
    expected = reference(query, cache, tables, seqs, 16, 0, sinks)
    err = (out.double() - expected).abs().max() / expected.abs().max()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def test_sinks_of_the_wrong_kind_are_refused_before_a_launch():
    q = torch.zeros(2, 4, 64)
    kv_cache = torch.zeros(2, 3, 16, 2, 64)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.tensor([3, 4])
    for bad in (torch.zeros(3), torch.zeros(4, dtype=torch.bfloat16)):
        with pytest.raises(ck.CudaKernelError, match="sinks must be contiguous fp32"):
            ck.plan_paged_decode(q, kv_cache, tables, lens, 0.1, torch.empty_like(q), sinks=bad)
