"""csrc/paged_prefill.cu (the varlen paged prefill) under the CPU emulator, and the packed
batch of the FlashAttention path, against float64 references; on a GPU:
tests/test_cuda_prefill.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paged_reference import (
    TOLERANCE,
    packed_prefills,
    poison_released_blocks,
    prefill_reference,
    random_tables,
)

from zllm.executor.attention import cuda_prefill as cp

# (dtype, heads, kv_heads, head_dim, block_size, (query count, context length) per prefilling
# sequence, sliding window): whole prompts, chunks after cached context (chunked prefill, a
# prefix hit), ragged lengths across tile edges, GQA/MQA, windows shorter than a chunk.
EMU_PREFILL_CASES = {
    "f32-mha-ragged": (torch.float32, 4, 4, 64, 16, [(5, 5), (17, 17), (33, 33)], 0),
    "bf16-gqa9/3-chunks": (torch.bfloat16, 9, 3, 64, 8, [(20, 45), (1, 30), (16, 16)], 0),
    "f16-gqa8/2-d128": (torch.float16, 8, 2, 128, 32, [(40, 70), (3, 3)], 0),
    "f32-d256-mqa": (torch.float32, 4, 1, 256, 16, [(18, 40), (7, 7)], 0),
    "bf16-d80-window": (torch.bfloat16, 4, 2, 80, 8, [(30, 30), (12, 50)], 9),
    "f32-window-long-context": (torch.float32, 6, 2, 64, 16, [(20, 90), (33, 33)], 24),
}


@pytest.mark.parametrize("case", EMU_PREFILL_CASES)
def test_emulated_paged_prefill_matches_reference(emu, case):
    """Every prefilling sequence in one launch (keys read from the paged cache) against
    float64 attention; decode tokens between them in the flat batch stay untouched."""
    dtype, heads, kv_heads, head_dim, block_size, pairs, window = EMU_PREFILL_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    ctx_lens = [n for _, n in pairs]
    num_blocks, tables = random_tables(ctx_lens, block_size, gen)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    if window:  # blocks wholly before every query's window are released: poisoned, unread
        released = [max(0, n - q - window + 1) for q, n in pairs]
        kv_cache = poison_released_blocks(kv_cache, tables, released, block_size)
    seqs, first = packed_prefills(pairs)
    qk = torch.randn(first, heads + kv_heads, head_dim, generator=gen).to(dtype)
    q = qk[:, :heads]  # strided, as the model's rope output
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    starts, q_lens, lens = (np.array(c) for c in zip(*seqs, strict=True))
    batch = cp.PrefillBatch.build(
        starts, q_lens, lens, list(tables.numpy()), block_size, "cpu", window
    )
    assert batch.kernel.num_tiles == sum(-(-q // cp.TILE_ROWS) for q, _ in pairs)
    emu.run_launches(cp.plan_paged_prefill(q, kv_cache, batch, head_dim**-0.5, out))
    expected = prefill_reference(q, kv_cache, tables, seqs, block_size, window)
    rows = torch.cat([torch.arange(f, f + n) for f, n, _ in seqs])
    decode_rows = torch.tensor([f - 1 for f, _, _ in seqs])
    assert out[decode_rows].isnan().all(), "a decode token's row was written"
    got, want = out[rows].double(), expected[rows]
    err = (got - want).abs().max() / want.abs().max()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("window", [0, 9, 24])
def test_flash_inputs_pack_each_sequences_visible_keys(window):
    """The packed batch of the FlashAttention path, checked by doing what that call does
    (per sequence: its keys gathered by slot, causal aligned to the last key, the window as
    a left band) in float64 on CPU, against the reference on the whole context. The call's
    own arguments (window_size_left = W - 1, right 0) are checked on a GPU only
    (tests/test_cuda_prefill.py)."""
    pairs, block_size, heads, kv_heads, head_dim = (
        [(30, 30), (12, 50), (5, 5), (20, 90)],
        8,
        4,
        2,
        16,
    )
    gen = torch.Generator().manual_seed(window)
    ctx_lens = [n for _, n in pairs]
    num_blocks, tables = random_tables(ctx_lens, block_size, gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).double()
    released = [max(0, n - q - window + 1) if window else 0 for q, n in pairs]
    cache = poison_released_blocks(cache, tables, released, block_size)
    seqs, first = packed_prefills(pairs)
    q = torch.randn(first, heads, head_dim, generator=gen).double()
    starts, q_lens, lens = (np.array(c) for c in zip(*seqs, strict=True))
    batch = cp.PrefillBatch.build(
        starts, q_lens, lens, list(tables.numpy()), block_size, "cpu", window
    )
    flash = batch.flash
    slots = cache.view(2, -1, kv_heads, head_dim)
    assert not slots[:, flash.key_slots].isnan().any(), "a released block's slot was packed"
    got = torch.zeros_like(q)
    cu_q, cu_k = flash.cu_queries.tolist(), flash.cu_keys.tolist()
    for i in range(len(pairs)):
        rows = flash.query_rows[cu_q[i] : cu_q[i + 1]]
        key_slots = flash.key_slots[cu_k[i] : cu_k[i + 1]]
        k = slots[0, key_slots].repeat_interleave(heads // kv_heads, 1)
        v = slots[1, key_slots].repeat_interleave(heads // kv_heads, 1)
        n_q, n_k = len(rows), len(key_slots)
        diff = (torch.arange(n_q)[:, None] + n_k - n_q) - torch.arange(n_k)[None, :]
        visible = (diff >= 0) & ((diff < window) if window else True)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k) / head_dim**0.5
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        got[rows] = torch.einsum("hqk,khd->qhd", probs, v)
    visible_keys = [min(n, q + window - 1) if window else n for q, n in pairs]
    assert flash.max_queries == max(q_lens) and flash.max_keys == max(visible_keys)
    assert [cu_k[i + 1] - cu_k[i] for i in range(len(pairs))] == visible_keys
    expected = prefill_reference(q, cache, tables, seqs, block_size, window)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
