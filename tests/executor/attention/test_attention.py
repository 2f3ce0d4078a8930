"""Paged attention against a dense per-sequence reference, on ragged mixed batches."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from zllm.executor.attention.backend import (
    CPU_KERNEL_ATTENTION,
    TORCH_ATTENTION,
    choose_attention_backend,
)
from zllm.executor.attention.cuda import CUDA_ATTENTION, CudaAttentionMetadata
from zllm.executor.attention.paged import AttentionMetadata, PagedAttention, write_kv_cache
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cpu_build

# (query_len, context_len) per sequence: q == 1 decodes, q == L is a fresh prompt, else a chunk.
BATCHES = {
    "decode": [(1, 1), (1, 7), (1, 33), (1, 16), (1, 2)],
    "prefill": [(5, 5), (1, 1), (17, 17), (3, 3)],
    "chunked": [(4, 20), (16, 16), (7, 9)],
    # (9, 25) and (5, 37): short runs after cached context (verify steps) attend as decode rows;
    # (20, 45) is longer, a prefill chunk.
    "mixed": [(1, 12), (6, 6), (1, 40), (9, 25), (1, 3), (2, 2), (5, 37), (1, 1), (20, 45)],
}


def allocate(context_lens: list[int], block_size: int, gen: torch.Generator):
    """Give each sequence enough blocks from a shuffled pool (so tables are non-contiguous)."""
    counts = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(counts) + 3  # a few blocks nobody owns, to check they stay untouched
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for c in counts:
        tables.append(pool[start : start + c])
        start += c
    return num_blocks, tables


def slot_of(table: list[int], position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


def dense_reference(q, k, v, query_len: int, window: int | None = None) -> torch.Tensor:
    """q [q, H, d], k/v [L, KVH, d] for the whole context -> [q, H, d], in float64; with a
    window, each query sees only its last `window` positions."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    ctx_len = k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(ctx_len - query_len, ctx_len)[:, None]
    key_pos = torch.arange(ctx_len)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(
    batch,
    block_size,
    num_heads,
    num_kv_heads,
    dtype,
    seed=0,
    head_dim=16,
    kernel=False,
    window=None,
):
    """With a window, blocks wholly before the first position a sequence's queries see are
    released as the block manager does: -1 in the table, and in the cache a huge value that
    would swamp the result if any attended position read it."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = [q for q, _ in batch]
    context_lens = [n for _, n in batch]
    num_blocks, tables = allocate(context_lens, block_size, gen)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    kv_cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    full_k = [rand(n, num_kv_heads, head_dim) for n in context_lens]
    full_v = [rand(n, num_kv_heads, head_dim) for n in context_lens]
    # The context before this step is already in the cache.
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    slot_mapping = []
    for table, q_len, n, k, v in zip(tables, query_lens, context_lens, full_k, full_v, strict=True):
        for p in range(n):
            if p < n - q_len:
                flat[0, slot_of(table, p, block_size)] = k[p]
                flat[1, slot_of(table, p, block_size)] = v[p]
            else:
                slot_mapping.append(slot_of(table, p, block_size))
    if window is not None:
        for table, q_len, n in zip(tables, query_lens, context_lens, strict=True):
            for i in range(max(0, n - q_len - window + 1) // block_size):
                kv_cache[:, table[i]] = 1e6
                table[i] = -1
    query = rand(sum(query_lens), num_heads, head_dim)
    new_k = torch.cat([k[n - q :] for k, (q, n) in zip(full_k, batch, strict=True)])
    new_v = torch.cat([v[n - q :] for v, (q, n) in zip(full_v, batch, strict=True)])

    meta = AttentionMetadata.build(
        query_lens, context_lens, tables, slot_mapping, block_size, "cpu", sliding_window=window
    )
    expected_cache = kv_cache.clone()
    expected_cache.view(2, -1, num_kv_heads, head_dim)[0, slot_mapping] = new_k
    expected_cache.view(2, -1, num_kv_heads, head_dim)[1, slot_mapping] = new_v

    decode_kernel = cpu_kernels.paged_decode_attention if kernel else None
    attn = PagedAttention(num_heads, num_kv_heads, head_dim, decode_kernel=decode_kernel)
    out = attn(query, new_k, new_v, kv_cache, meta)

    assert torch.equal(kv_cache, expected_cache)
    starts = [0, *itertools.accumulate(query_lens)]
    expected = torch.cat(
        [
            dense_reference(
                query[starts[i] : starts[i + 1]], full_k[i], full_v[i], query_lens[i], window
            )
            for i in range(len(batch))
        ]
    )
    return out, expected


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1), (9, 3)])
def test_matches_dense_reference(batch_name, block_size, heads):
    out, expected = run_case(BATCHES[batch_name], block_size, *heads, torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 8, 16])
@pytest.mark.parametrize("kernel", [False, True])
def test_sliding_window_matches_dense_reference(batch_name, block_size, window, kernel):
    """Decode, whole prompts and chunks longer than the window, with the blocks before each
    window released. The torch path runs in float64 (exact to rounding); the CPU kernel
    backend (fp32) windows its decode rows itself, through the trimmed block tables, for
    the plain-loop head size (16) and the SIMD ones (64, 128)."""
    if not kernel:
        out, expected = run_case(
            BATCHES[batch_name], block_size, 4, 2, torch.float64, window=window
        )
        torch.testing.assert_close(out.double(), expected, rtol=1e-9, atol=1e-9)
        return
    if not cpu_kernels.enabled():
        pytest.skip("CPU kernels disabled")
    for head_dim in (16, 64, 128):
        out, expected = run_case(
            BATCHES[batch_name],
            block_size,
            4,
            2,
            torch.float32,
            head_dim=head_dim,
            window=window,
            kernel=True,
        )
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_name", ["decode", "mixed"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 1), (9, 3)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_cpu_decode_kernel_matches_dense_reference(batch_name, block_size, heads, head_dim):
    out, expected = run_case(
        BATCHES[batch_name], block_size, *heads, torch.float32, head_dim=head_dim, kernel=True
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_cpu_decode_kernel_rejects_tables_outside_the_cache():
    kv_cache = torch.zeros(2, 4, 16, 1, 8)
    q = torch.randn(1, 2, 8)
    lens = torch.tensor([20])
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_kernels.paged_decode_attention(q, kv_cache, torch.tensor([[0, 4]]), lens, 1.0)
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        cpu_kernels.paged_decode_attention(q, kv_cache, torch.tensor([[0]]), lens, 1.0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_float64_is_exact_to_rounding(block_size):
    out, expected = run_case(BATCHES["mixed"], block_size, 8, 2, torch.float64, seed=3)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


def test_bfloat16_close_to_reference():
    out, expected = run_case(BATCHES["mixed"], 4, 4, 2, torch.bfloat16, seed=5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("seed", range(5))
def test_random_ragged_batches(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    batch = []
    for _ in range(int(torch.randint(1, 12, (1,), generator=gen))):
        n = int(torch.randint(1, 70, (1,), generator=gen))
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        q = (
            1
            if kind == 0
            else n
            if kind == 1
            else int(torch.randint(1, n + 1, (1,), generator=gen))
        )
        batch.append((q, n))
    block_size = [1, 4, 16][seed % 3]
    out, expected = run_case(batch, block_size, 6, 2, torch.float32, seed=seed)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_metadata_split():
    batch = BATCHES["mixed"]
    query_lens = [q for q, _ in batch]
    context_lens = [n for _, n in batch]
    _, tables = allocate(context_lens, 4, torch.Generator().manual_seed(0))
    meta = AttentionMetadata.build(
        query_lens, context_lens, tables, list(range(sum(query_lens))), 4, "cpu"
    )
    assert meta.slot_mapping.tolist() == list(range(46))
    assert meta.decode is not None and not meta.decode.is_whole_batch
    # One row per decode token, and one per token of each short run after cached context.
    rows = [0, 7, *range(8, 17), 17, *range(20, 25), 25]
    assert meta.decode.token_indices.tolist() == rows
    assert meta.decode.max_blocks == 10  # ceil(40 / 4)
    assert meta.decode.attn_mask.shape == (len(rows), 1, 1, 40)
    seen = [12, 40, *range(17, 26), 3, *range(33, 38), 1]  # each row up to its own position
    assert meta.decode.attn_mask.sum(-1).flatten().tolist() == seen
    assert meta.decode.seq_lens.tolist() == seen
    assert [(c.token_start, c.token_end, c.context_len) for c in meta.prefills] == [
        (1, 7, 6),
        (18, 20, 2),
        (26, 46, 45),
    ]
    fresh, chunk = meta.prefills[0], meta.prefills[2]
    assert fresh.context_slots is None and fresh.attn_mask is None
    assert chunk.context_slots.tolist() == [slot_of(tables[8], p, 4) for p in range(45)]
    assert chunk.attn_mask.shape == (20, 45)
    assert chunk.attn_mask.sum(-1).tolist() == list(range(26, 46))
    whole = AttentionMetadata.build([1, 1], [3, 5], [[2], [0, 1]], [10, 5], 4, "cpu")
    assert whole.decode.is_whole_batch and not whole.prefills
    assert whole.decode.block_ids.tolist() == [2, 0, 0, 1]  # tables padded to 2 blocks


def test_write_kv_cache_touches_only_its_slots():
    kv_cache = torch.zeros(2, 5, 4, 2, 3)
    key = torch.arange(3 * 6, dtype=torch.float32).view(3, 2, 3) + 1
    value = -key
    write_kv_cache(key, value, kv_cache, torch.tensor([17, 2, 8]))
    assert torch.equal(kv_cache[0, 4, 1], key[0]) and torch.equal(kv_cache[1, 4, 1], value[0])
    assert torch.equal(kv_cache[0, 0, 2], key[1]) and torch.equal(kv_cache[1, 0, 2], value[1])
    assert torch.equal(kv_cache[0, 2, 0], key[2]) and torch.equal(kv_cache[1, 2, 0], value[2])
    assert int((kv_cache != 0).sum()) == 2 * 3 * 6


@pytest.mark.parametrize(
    "args",
    [
        ([0], [3], [[0]], [], 4),  # empty query
        ([4], [3], [[0]], [0, 1, 2, 3], 4),  # more new tokens than context
        ([1], [9], [[0, 1]], [8], 4),  # table too short
        ([2], [2], [[0]], [0], 4),  # slot count mismatch
        ([1, 1], [2], [[0], [1]], [0, 4], 4),  # ragged lists
    ],
)
@pytest.mark.parametrize("build", [AttentionMetadata.build, CudaAttentionMetadata.build])
def test_build_rejects_inconsistent_input(args, build):
    with pytest.raises(ValueError):
        build(*args, device="cpu")


def test_a_bad_cuda_prefill_mode_is_refused_when_the_backend_is_chosen(monkeypatch):
    monkeypatch.setenv("ZLLM_CUDA_PREFILL", "fast")
    with pytest.raises(ValueError, match="ZLLM_CUDA_PREFILL='fast': expected one of"):
        choose_attention_backend(torch.device("cuda"), torch.bfloat16, 64)
    monkeypatch.setenv("ZLLM_CUDA_PREFILL", "kernel")
    assert choose_attention_backend(torch.device("cuda"), torch.bfloat16, 64).name == "cuda"


def test_backends_share_the_step_layout():
    """Both metadata kinds agree on what they share: slots, lengths, the prefilling
    sequences (CPU: one SDPA chunk each; CUDA: one row each of the varlen kernel's batch) and
    the blocks they read. (Short runs after cached context are decode rows on CPU only; the
    CUDA path keeps them as prefills, so this batch has none.)"""
    batch = [(1, 12), (6, 6), (1, 40), (20, 45), (1, 3), (2, 2), (1, 1)]
    query_lens, context_lens = [q for q, _ in batch], [n for _, n in batch]
    _, tables = allocate(context_lens, 4, torch.Generator().manual_seed(1))
    slots = [
        slot_of(t, p, 4) for t, (q, n) in zip(tables, batch, strict=True) for p in range(n - q, n)
    ]
    cpu = AttentionMetadata.build(query_lens, context_lens, tables, slots, 4, "cpu")
    gpu = CudaAttentionMetadata.build(query_lens, context_lens, tables, slots, 4, "cpu")
    assert torch.equal(cpu.slot_mapping, gpu.slot_mapping)
    assert gpu.seq_lens.tolist() == cpu.decode.seq_lens.tolist() == [12, 40, 3, 1]
    assert gpu.decode_token_indices.tolist() == cpu.decode.token_indices.tolist()

    spans = [(c.token_start, c.token_end, c.context_len) for c in cpu.prefills]
    rows = gpu.prefill.kernel.seqs.view(-1, 3).tolist()
    assert spans == [(first, first + q, n) for first, q, n in rows] and len(spans) == 3
    for chunk, table in zip(cpu.prefills, gpu.prefill.kernel.block_tables, strict=True):
        if chunk.context_slots is not None:  # a chunk after cached context reads these slots
            blocks = table[: -(-chunk.context_len // 4)].long()
            slots = (blocks[:, None] * 4 + torch.arange(4)).reshape(-1)[: chunk.context_len]
            assert torch.equal(chunk.context_slots, slots)


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "kernels", "expected"),
    [
        ("cpu", torch.float32, 64, "1", "cpu-kernels"),
        ("cpu", torch.float32, 64, "0", "torch"),  # ZLLM_CPU_KERNELS=0: no kernel by itself
        ("cpu", torch.float32, 12, "1", "torch"),  # no SIMD path for this head_dim
        ("cpu", torch.bfloat16, 64, "1", "torch"),
        ("meta", torch.float32, 64, "1", "torch"),
        ("cuda", torch.bfloat16, 64, "1", "cuda"),
        ("cuda", torch.bfloat16, 16, "1", "torch"),  # no CUDA kernel variant for head_dim 16
    ],
)
def test_choose_attention_backend(monkeypatch, device, dtype, head_dim, kernels, expected):
    monkeypatch.setenv("ZLLM_CPU_KERNELS", kernels)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # as if built
    backend = choose_attention_backend(torch.device(device), dtype, head_dim)
    assert backend.name == expected


def test_cpu_kernel_build_failure_falls_back_to_torch(monkeypatch, caplog):
    def fail():
        raise cpu_kernels.CpuKernelError("no compiler here")

    monkeypatch.setenv("ZLLM_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu_kernels, "load", fail)
    assert choose_attention_backend(torch.device("cpu"), torch.float32, 64) is TORCH_ATTENTION
    assert "decode attention stays in torch: no compiler here" in caplog.text


def test_a_killed_build_s_lock_does_not_block_later_loads(tmp_path, caplog):
    """torch waits for a build directory's `lock` file to go; a build killed midway leaves it.
    Once a loader holds the directory's flock, such a file is a dead build's: removed."""
    (tmp_path / "lock").touch()
    with cpu_kernels.exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "removing the lock file a killed CPU-kernel build left" in caplog.text


def test_a_finished_build_is_imported_without_ninja_and_an_unfinished_one_never(tmp_path):
    """A start finds the build its name describes (sources, flags, place) and imports it
    directly, but only one whose stamp (written when the build finished) matches it: a link
    killed midway leaves a library that would crash the process loading it."""
    if not cpu_kernels.cpu_supports_kernels():
        pytest.skip("the CPU kernels need AVX2/FMA/F16C")
    built = Path(cpu_kernels.load().__file__)
    name = built.stem  # (the module's init function is named after it)
    copy = tmp_path / built.name
    copy.write_bytes(built.read_bytes())
    assert cpu_build.import_built(name, copy) is None  # no stamp
    cpu_build.write_stamp(copy)
    module = cpu_build.import_built(name, copy)
    assert module is not None
    assert {"gguf_linear", "paged_decode_attention"} <= set(dir(module))
    # Cut short after its stamp was written (its size no longer matches): never loaded.
    cut = tmp_path / "zllm_cpu_kernels_cut.so"
    cut.write_bytes(built.read_bytes())
    cpu_build.write_stamp(cut)
    cut.write_bytes(built.read_bytes()[:4096])
    assert cpu_build.import_built("zllm_cpu_kernels_cut", cut) is None
    assert (
        cpu_build.import_built("zllm_cpu_kernels_none", tmp_path / "zllm_cpu_kernels_none.so")
        is None
    )


def test_a_build_directory_that_cannot_be_made_is_a_kernel_error(monkeypatch, tmp_path):
    """An extensions directory that cannot be made fails as CpuKernelError, which the
    engine's start turns into running without the kernels, not as a crash."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocker / "extensions"))
    monkeypatch.setattr(cpu_build, "PREBUILT_DIR", tmp_path / "no-install-build")
    with pytest.raises(cpu_kernels.CpuKernelError, match="building the CPU kernels failed"):
        cpu_kernels.load.__wrapped__()


def test_a_live_build_is_waited_for_and_its_lock_left(tmp_path, caplog):
    """Another process holding the flock (building: its `lock` file there) is waited for, and
    its lock file is not touched; the load goes on once that process lets go."""
    import subprocess
    import sys
    import threading

    builder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, pathlib, sys\n"
            f"d = pathlib.Path({str(tmp_path)!r})\n"
            "f = open(d / 'zllm-build.flock', 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
            "(d / 'lock').touch(); print('building', flush=True)\n"
            "sys.stdin.read()\n"  # builds until the test closes its stdin
            "assert (d / 'lock').exists(); (d / 'lock').unlink()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert builder.stdout.readline() == "building\n"
    entered = threading.Event()

    def load() -> None:
        with cpu_kernels.exclusive_build(tmp_path):
            entered.set()

    waiter = threading.Thread(target=load)
    waiter.start()
    assert not entered.wait(0.5)  # held off while the builder runs
    builder.stdin.close()
    assert builder.wait(30) == 0  # its lock file was still there when it finished
    waiter.join(30)
    assert entered.is_set()
    assert "removing the lock file" not in caplog.text


@pytest.mark.parametrize("backend", [TORCH_ATTENTION, CPU_KERNEL_ATTENTION, CUDA_ATTENTION])
def test_model_layers_come_from_the_backend(backend):
    from zllm.executor.models.llama import LlamaForCausalLM
    from zllm.model.arch_config import ModelArchConfig

    arch = ModelArchConfig(
        architecture="llama", family="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(arch, attention=backend)
    expected = backend.make_layer(4, 2, 8)
    for layer in model.layers:
        attn = layer.self_attn.attn
        assert type(attn) is type(expected)
        assert getattr(attn, "decode_kernel", None) is getattr(expected, "decode_kernel", None)
        assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 8)
    assert LlamaForCausalLM(arch).layers[0].self_attn.attn.decode_kernel is None  # torch default


def test_stacked_tables_and_positions_equal_row_by_row():
    """The vectorised helpers a step's metadata is built with (hundreds of rows a step)
    against the row-by-row construction they replaced: ragged tables with released (-1)
    entries, an empty step, and positions of decodes beside chunks."""
    from zllm.executor.attention.metadata import padded_tables, stack_tables
    from zllm.executor.step_inputs import token_positions

    tables = [[5, 9, 2], [-1, -1, 7, 8, 1], [3], [4, 6]]
    stacked = stack_tables(tables)
    assert stacked.dtype == np.int64 and stacked.shape == (4, 5)
    for row, table in zip(stacked, tables, strict=True):
        assert row.tolist() == table + [0] * (5 - len(table))
    ctx = np.array([33, 70, 1, 17])  # blocks of 16: 3, 5, 1, 2
    padded = padded_tables(tables, ctx, 16)
    assert padded.dtype == np.int32
    assert padded.tolist() == [[5, 9, 2, 0, 0], [-1, -1, 7, 8, 1], [3, 0, 0, 0, 0], [4, 6, 0, 0, 0]]
    assert padded_tables([[5, 9, 2]], np.array([5]), 16).tolist() == [[5]]
    assert stack_tables([]).shape == (0, 1) and padded_tables([], np.array([]), 16).shape == (0, 1)
    q, seq = [1, 4, 1, 3], [33, 70, 1, 17]
    expected = np.concatenate([np.arange(s - n, s) for n, s in zip(q, seq, strict=True)])
    assert token_positions(q, seq).tolist() == expected.tolist()
    assert token_positions([], []).tolist() == []
