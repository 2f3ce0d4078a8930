"""The CUDA path on a real GPU: csrc kernels, CudaPagedAttention and CUDA-graph replay.

Skipped (with the reason) without a CUDA device or without CuPy. The same kernels run
under emulation on CPU machines in test_csrc_compile.py; this file checks them for real.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from paged_reference import TOLERANCE, decode_reference, random_tables

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install zllm[cuda]", allow_module_level=True)

from zllm.executor import cuda_kernels as ck  # noqa: E402
from zllm.executor.attention import AttentionMetadata, PagedAttention  # noqa: E402
from zllm.executor.attention_cuda import (  # noqa: E402
    CUDA_ATTENTION,
    CudaAttentionMetadata,
    CudaPagedAttention,
)
from zllm.executor.cuda_graph import CudaGraphRunner  # noqa: E402

DEVICE = torch.device("cuda")


def ragged_lens(gen, count, max_len=4096):
    """Edge lengths (1, partition boundaries, max) plus random ones."""
    edges = [1, 2, 511, 512, 513, 1024, 1025, max_len]
    rand = torch.randint(1, max_len + 1, (max(0, count - len(edges)),), generator=gen).tolist()
    return (edges + rand)[:count]


SHAPES = [(9, 3, 64), (32, 8, 128), (8, 8, 128), (16, 1, 64), (12, 4, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_paged_decode_matches_reference(dtype, block_size, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 1000 + block_size * 10 + head_dim)
    lens = ragged_lens(gen, 12)
    table_dtype = torch.int64 if block_size == 16 else torch.int32
    num_blocks, tables = random_tables(lens, block_size, gen, table_dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(DEVICE, dtype)
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = qk[:, :heads]  # a strided view, as the model passes it
    tables = tables.to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE, dtype=torch.int32)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)

    ck.paged_decode_attention(q, kv_cache, tables, seq_lens, head_dim**-0.5, out)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "some output row was never written"
    expected = decode_reference(q, kv_cache, tables, lens, block_size)
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_max_seq_len_and_empty_rows(dtype):
    """A tight max_seq_len gives the same result as the table-width bound; seq_len 0 -> 0."""
    gen = torch.Generator().manual_seed(7)
    lens = [0, 3, 700, 1500, 1]
    num_blocks, tables = random_tables(lens, 16, gen)
    kv_cache = torch.randn(2, num_blocks, 16, 2, 128, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(lens), 8, 128, generator=gen).to(DEVICE, dtype)
    tables = torch.cat([tables, torch.zeros(len(lens), 40, dtype=tables.dtype)], 1).to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    wide = ck.paged_decode_attention(q, kv_cache, tables, seq_lens)
    tight = ck.paged_decode_attention(q, kv_cache, tables, seq_lens, max_seq_len=max(lens))
    torch.testing.assert_close(wide, tight, atol=0, rtol=0)
    assert torch.equal(wide[0], torch.zeros_like(wide[0]))
    expected = decode_reference(q, kv_cache, tables, lens, 16)
    err = ((wide.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("aligned", [True, False])
def test_write_kv_cache_lands_in_slots_and_skips_padding(dtype, aligned):
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, kv_heads, head_dim, heads, t = 64, 16, 8, 128, 32, 300
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(DEVICE, dtype)
    before = kv_cache.clone()
    offset = 0 if aligned else 1  # odd element offset: the scalar path
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim + offset, generator=gen).to(
        DEVICE, dtype
    )
    k = qkv[:, offset + heads * head_dim : offset + (heads + kv_heads) * head_dim]
    v = qkv[:, offset + (heads + kv_heads) * head_dim :]
    k, v = k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[::7] = -1
    ck.write_kv_cache(k, v, kv_cache, slots.to(DEVICE))
    expected = before.clone()
    keep = slots >= 0
    flat = expected.view(2, -1, kv_heads, head_dim)
    flat[0, slots[keep].to(DEVICE)] = k[keep.to(DEVICE)]
    flat[1, slots[keep].to(DEVICE)] = v[keep.to(DEVICE)]
    assert torch.equal(kv_cache, expected)


BATCHES = {
    "decode": [(1, 1), (1, 7), (1, 33), (1, 16), (1, 2), (1, 1500)],
    "prefill": [(5, 5), (1, 1), (17, 17), (3, 3), (600, 600)],
    "chunked": [(4, 20), (16, 16), (7, 9), (256, 1100)],
    "mixed": [(1, 12), (6, 6), (1, 40), (9, 25), (1, 3), (2, 2), (5, 37), (1, 800)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", BATCHES)
def test_cuda_attention_matches_reference_attention(dtype, batch):
    heads, kv_heads, head_dim, block_size = 12, 4, 64, 16
    pairs = BATCHES[batch]
    q_lens, lens = [q for q, _ in pairs], [n for _, n in pairs]
    gen = torch.Generator().manual_seed(5)
    num_blocks, tables = random_tables(lens, block_size, gen)
    table_lists = [row[: -(-n // block_size)].tolist() for row, n in zip(tables, lens, strict=True)]
    slot_mapping = [
        tbl[p // block_size] * block_size + p % block_size
        for tbl, q, n in zip(table_lists, q_lens, lens, strict=True)
        for p in range(n - q, n)
    ]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    cache = cache.to(DEVICE, dtype)
    t = sum(q_lens)
    query, key, value = (
        torch.randn(t, h, head_dim, generator=gen).to(DEVICE, dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    ref_cache = cache.clone()
    ref_meta = AttentionMetadata.build(q_lens, lens, table_lists, slot_mapping, block_size, DEVICE)
    ref_attn = PagedAttention(heads, kv_heads, head_dim)
    expected = ref_attn(query.double(), key.double(), value.double(), ref_cache.double(), ref_meta)
    meta = CudaAttentionMetadata.build(q_lens, lens, table_lists, slot_mapping, block_size, DEVICE)
    out = CudaPagedAttention(heads, kv_heads, head_dim)(query, key, value, cache, meta)
    flat_ref = ref_cache.view(2, -1, kv_heads, head_dim)
    flat_ref[0, slot_mapping], flat_ref[1, slot_mapping] = key, value
    assert torch.equal(cache, ref_cache)
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    # SDPA's kernels round like ours: a bf16 output is within a few bf16 ulps.
    assert err < {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype], f"relative error {err:.2e}"


# ---- CUDA graphs on a tiny random Llama -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gpu_llama_dir(tmp_path_factory):
    from conftest import write_tiny_model

    return str(
        write_tiny_model(
            tmp_path_factory.mktemp("tiny-llama-gpu"),
            hidden_size=256,  # head_dim 64: a size the decode kernel is built for
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        )
    )


def load_model(path: str, dtype: torch.dtype):
    from zllm.executor.loader import load_weights
    from zllm.executor.models import LlamaForCausalLM
    from zllm.model_files import read_arch_config

    arch = read_arch_config(path)
    model = LlamaForCausalLM(arch, dtype=dtype, attention=CUDA_ATTENTION)
    model.load_weights(load_weights(path, arch))
    model.to(DEVICE).eval()
    assert all(isinstance(layer.self_attn.attn, CudaPagedAttention) for layer in model.layers)
    return model, arch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_cuda_graph_replay_equals_eager(tiny_gpu_llama_dir, dtype):
    model, arch = load_model(tiny_gpu_llama_dir, dtype)
    block_size, max_blocks, num_seqs = 16, 64, 13
    gen = torch.Generator().manual_seed(11)
    lens = torch.randint(1, 900, (num_seqs,), generator=gen).tolist()
    num_blocks, tables = random_tables([n + 1 for n in lens], block_size, gen, spare=8)
    caches = [
        torch.zeros(2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim, dtype=dtype,
                    device=DEVICE)
        for _ in range(arch.num_layers)
    ]  # fmt: skip
    tables = [
        row[: -(-(n + 1) // block_size)].tolist() for row, n in zip(tables, lens, strict=True)
    ]

    def slot(i: int, p: int) -> int:
        return tables[i][p // block_size] * block_size + p % block_size

    # Prefill every sequence eagerly, one batch.
    ids = torch.randint(0, arch.vocab_size, (sum(lens),), generator=gen).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    slots = [slot(i, p) for i, n in enumerate(lens) for p in range(n)]
    meta = CudaAttentionMetadata.build(lens, lens, tables, slots, block_size, DEVICE)
    model(ids, positions, caches, meta)

    runner = CudaGraphRunner(
        model, caches, max_num_seqs=16, max_blocks_per_seq=max_blocks, block_size=block_size,
        num_heads=arch.num_heads, head_dim=arch.head_dim, capture_sizes=(1, 2, 4, 8, 16),
    )  # fmt: skip
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16]
    assert runner.run(ids, positions, meta) is None  # a prefill batch runs eagerly

    for n in (1, 3, 8, 13):
        new_ids = torch.randint(0, arch.vocab_size, (n,), generator=gen).to(DEVICE)
        pos = torch.tensor(lens[:n], device=DEVICE)
        dec_slots = [slot(i, lens[i]) for i in range(n)]
        dec_lens = [x + 1 for x in lens[:n]]
        meta = CudaAttentionMetadata.build(
            [1] * n, dec_lens, tables[:n], dec_slots, block_size, DEVICE
        )
        assert meta.is_decode_only
        eager = model(new_ids, pos, caches, meta).clone()
        cache_after_eager = [c.clone() for c in caches]
        replayed = runner.run(new_ids, pos, meta)
        assert replayed is not None and replayed.shape == eager.shape
        # The replay wrote the same K/V to the same slots, and nothing else (padding: -1).
        for c, c_eager in zip(caches, cache_after_eager, strict=True):
            torch.testing.assert_close(c, c_eager, atol=1e-2, rtol=1e-2)
        rel = ((replayed.float() - eager.float()).norm() / eager.float().norm()).item()
        assert rel < (1e-5 if dtype == torch.float32 else 1e-2), f"batch {n}: {rel:.2e}"

    # Bigger than the largest graph, or graphs disabled: eager.
    big = CudaAttentionMetadata.build(
        [1] * 17, [2] * 17, [tables[0]] * 17, [slot(0, 1)] * 17, block_size, DEVICE
    )
    ids17 = torch.zeros(17, dtype=torch.int64, device=DEVICE)
    assert runner.run(ids17, ids17, big) is None
    runner.enabled = False
    assert runner.run(new_ids, pos, meta) is None
