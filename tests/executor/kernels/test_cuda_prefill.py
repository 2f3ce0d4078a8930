"""The varlen paged prefill (executor/attention/cuda_prefill.py: FlashAttention and
csrc/paged_prefill.cu) and the decode kernel's sliding window on a real GPU, against float64
references; part of the GPU run with tests/test_cuda.py (`pytest tests/test_cuda*.py`). The
same kernels run under the CPU emulator in tests/test_csrc_prefill.py.
"""

from __future__ import annotations

import importlib.util

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

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install zllm[cuda]", allow_module_level=True)

from zllm.executor.attention import cuda_prefill as cp  # noqa: E402
from zllm.executor.kernels import cuda as ck  # noqa: E402

DEVICE = torch.device("cuda")


@pytest.mark.parametrize("window", [37, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_with_a_sliding_window(dtype, window):
    """Each query sees its last `window` positions; blocks wholly before them point to a
    NaN block (released), which no read may touch."""
    gen = torch.Generator().manual_seed(window)
    lens = [1, 36, 37, 38, 599, 600, 601, 2000, 4096]
    num_blocks, tables = random_tables(lens, 16, gen)
    kv_cache = torch.randn(2, num_blocks, 16, 2, 128, generator=gen).to(DEVICE, dtype)
    released = [max(0, n - window) for n in lens]
    kv_cache = poison_released_blocks(kv_cache, tables, released, 16)
    q = torch.randn(len(lens), 8, 128, generator=gen).to(DEVICE, dtype)
    seq_lens = torch.tensor(lens, device=DEVICE)
    out = ck.paged_decode_attention(q, kv_cache, tables.to(DEVICE), seq_lens, window=window)
    expected = decode_reference(q, kv_cache, tables.to(DEVICE), lens, 16, window)
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


# (query count, context length): whole prompts of ragged lengths (tile edges at 16), and
# chunks after cached context (chunked prefill, prefix-cache hits), short and long.
PREFILL_PAIRS = [(2, 2), (16, 16), (17, 17), (128, 128), (700, 700), (64, 1000), (5, 517),
                 (300, 2100), (16, 48), (33, 4096)]  # fmt: skip
PREFILL_SHAPES = [(9, 3, 64), (32, 8, 128), (8, 2, 256), (16, 1, 64), (12, 12, 80)]


# (implementation, dtype): csrc/paged_prefill.cu in every dtype, FlashAttention in its two.
PREFILL_IMPLS = [("kernel", torch.float32), ("kernel", torch.bfloat16), ("kernel", torch.float16),
                 ("flash", torch.bfloat16), ("flash", torch.float16)]  # fmt: skip
# FlashAttention rounds the probabilities to the element type before P @ V.
FLASH_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("window", [0, 100], ids=["full", "window100"])
@pytest.mark.parametrize("impl, dtype", PREFILL_IMPLS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", PREFILL_SHAPES)
def test_paged_prefill_matches_reference(
    heads, kv_heads, head_dim, block_size, impl, dtype, window
):
    """Every prefilling sequence in one varlen call, keys from the paged cache, against
    float64 attention; the decode rows between them in the flat batch are not written."""
    gen = torch.Generator().manual_seed(heads * 100 + head_dim + block_size + window)
    ctx_lens = [n for _, n in PREFILL_PAIRS]
    num_blocks, tables = random_tables(ctx_lens, block_size, gen)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(DEVICE, dtype)
    if window:  # blocks wholly before every query's window: a NaN block, never to be read
        released = [max(0, n - q - window + 1) for q, n in PREFILL_PAIRS]
        kv_cache = poison_released_blocks(kv_cache, tables, released, block_size)
    seqs, first = packed_prefills(PREFILL_PAIRS)  # a decode token before each prefill
    qk = torch.randn(first, heads + kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = qk[:, :heads]
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    starts, q_lens, lens = (torch.tensor(c).numpy() for c in zip(*seqs, strict=True))
    batch = cp.PrefillBatch.build(
        starts, q_lens, lens, list(tables.numpy()), block_size, DEVICE, window
    )
    if impl == "flash":
        assert cp.uses_flash(q), "FlashAttention should run on this GPU"
    cp.paged_prefill_attention(q, kv_cache, batch, head_dim**-0.5, out, impl=impl)
    torch.cuda.synchronize()
    expected = prefill_reference(q, kv_cache, tables.to(DEVICE), seqs, block_size, window)
    rows = torch.cat([torch.arange(f, f + n) for f, n, _ in seqs]).to(DEVICE)
    assert out[[f - 1 for f, _, _ in seqs]].isnan().all(), "a decode row was written"
    got, want = out[rows].double(), expected[rows]
    err = ((got - want).abs().max() / want.abs().max()).item()
    tolerance = FLASH_TOLERANCE[dtype] if impl == "flash" else TOLERANCE[dtype]
    assert err < tolerance, f"relative error {err:.2e}"
