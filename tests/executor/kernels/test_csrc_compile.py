"""The CUDA kernels of csrc/, checked on machines without a GPU.

1. nvcc: every .cu file compiles to PTX for sm_90 with every variant instantiated (catches
   syntax and type errors in CI); skipped without nvcc.
2. NVRTC: the exact source and options cuda_kernels.py hands NVRTC at run time compile, and
   the template name expressions it asks for resolve; skipped without libnvrtc.
3. Emulation: the kernels, built for the host with csrc/emu/cuda_host_emu.h (CUDA threads
   as fibers, real barriers and warp shuffles), run the launches cuda_kernels.py plans
   (grids, strides, split-K workspace) against float64 references, and CudaPagedAttention
   runs on them against the CPU PagedAttention; skipped without a C++17 compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from paged_reference import TOLERANCE, decode_reference, poison_released_blocks, random_tables

from zllm.executor.attention.cuda import CudaAttentionMetadata, CudaPagedAttention
from zllm.executor.attention.paged import AttentionMetadata, PagedAttention
from zllm.executor.kernels import cuda as ck

CSRC = ck.CSRC_DIR
CU_FILES = sorted(p.name for p in CSRC.glob("*.cu"))


# ---- 1. nvcc ----------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source", CU_FILES)
def test_nvcc_compiles_to_ptx(source, tmp_path):
    ptx = tmp_path / (source + ".ptx")
    cmd = [
        "nvcc", "--ptx", "-arch=sm_90", "-std=c++17", f"-I{CSRC}",
        "-DZLLM_INSTANTIATE_ALL", "-o", str(ptx), str(CSRC / source),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    entries = ptx.read_text().count(".entry ")
    if source == "kv_cache.cu":
        assert entries == 3  # f32, f16, bf16
    elif source == "paged_attention.cu":
        # 3 dtypes x (6 head dims x 4 groups + the reduce kernel)
        assert entries == 3 * (len(ck.SUPPORTED_HEAD_DIMS) * 4 + 1)
    elif source == "layer_ops.cu":
        assert entries == 3 * 4  # 3 dtypes x (rms_norm, rope, rope_cache, silu_mul)
    elif source == "paged_prefill.cu":
        assert entries == 3 * len(ck.SUPPORTED_HEAD_DIMS)
    elif source == "moe_experts.cu":
        assert entries == 3  # zllm_moe_gemv in f32, f16, bf16
    elif source == "block_gemv.cu":
        assert entries == 3 * 4 * 2  # 3 dtypes x 4 block types x (gemv, dequant)
    elif source == "state_layers.cu":
        assert entries == 3  # conv, gated delta and Mamba-2 decode steps, fp32


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_nvrtc_source_needs_no_include_path(tmp_path):
    """What NVRTC gets (the header pasted in) compiles alone, with no -I."""
    for source in CU_FILES:
        path = tmp_path / source
        path.write_text(ck.kernel_source(source))
        cmd = ["nvcc", "--ptx", "-arch=sm_90", "-std=c++17", "-o", str(path) + ".ptx", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr


# ---- 2. NVRTC ---------------------------------------------------------------------------------
def _find_libnvrtc() -> str | None:
    candidates = [os.environ.get("ZLLM_NVRTC_LIB"), ctypes.util.find_library("nvrtc")]
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in filter(None, roots):
        candidates += sorted(glob.glob(os.path.join(root, "lib*", "libnvrtc.so*")))
    for site in sys.path:  # the nvidia-cuda-nvrtc wheels
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
    for path in filter(None, candidates):
        if "builtins" in path or ".alt." in path:
            continue
        # NVRTC dlopens its builtins library by name at compile time: load the one beside
        # it first, so it is found without LD_LIBRARY_PATH.
        for builtins in sorted(
            glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))
        ):
            if ".alt." not in builtins:
                try:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass
        try:
            ctypes.CDLL(path)
        except OSError:
            continue
        return path
    return None


def nvrtc_compile(lib, source: str, options: tuple[str, ...], names: list[str]) -> dict[str, str]:
    """Compile `source` like CuPy's RawModule does; returns name expression -> lowered name."""
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or pytest.fail(f"{what} failed with NVRTC error {rc}")  # noqa: E731
    check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None),
        "create",
    )
    try:
        for name in names:
            check(lib.nvrtcAddNameExpression(prog, name.encode()), "add name")
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, log.value.decode(errors="replace")
        lowered = {}
        for name in names:
            out = ctypes.c_char_p()
            check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)), "lowered name")
            lowered[name] = out.value.decode()
        return lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.fixture(scope="module")
def libnvrtc():
    path = _find_libnvrtc()
    if path is None:
        pytest.skip(
            "libnvrtc not found (CUDA toolkit lib64, nvidia-cuda-nvrtc wheel, ZLLM_NVRTC_LIB)"
        )
    return ctypes.CDLL(path)


def test_nvrtc_compiles_runtime_sources(libnvrtc):
    options = (*ck.NVRTC_OPTIONS, "-arch=compute_90")
    nvrtc_compile(libnvrtc, ck.kernel_source("kv_cache.cu"), options, [])
    nvrtc_compile(libnvrtc, ck.kernel_source("state_layers.cu"), options, [])
    names = [
        f"zllm_paged_decode<{tag}, {hd}, {group}>"
        for tag in ("DtypeF32", "DtypeF16", "DtypeBF16")
        for hd in (64, 128)
        for group in (1, 2, 4, 8)
    ] + [f"zllm_paged_decode_reduce<{tag}>" for tag in ("DtypeF32", "DtypeF16", "DtypeBF16")]
    lowered = nvrtc_compile(libnvrtc, ck.kernel_source("paged_attention.cu"), options, names)
    assert all(v.startswith("_Z") for v in lowered.values())
    names = [
        f"zllm_paged_prefill<{tag}, {hd}>"
        for tag in ("DtypeF32", "DtypeF16", "DtypeBF16")
        for hd in ck.SUPPORTED_HEAD_DIMS
    ]
    lowered = nvrtc_compile(libnvrtc, ck.kernel_source("paged_prefill.cu"), options, names)
    assert all(v.startswith("_Z") for v in lowered.values())
    names = [f"zllm_moe_gemv<{tag}>" for tag in ("DtypeF32", "DtypeF16", "DtypeBF16")]
    lowered = nvrtc_compile(libnvrtc, ck.kernel_source("moe_experts.cu"), options, names)
    assert all(v.startswith("_Z") for v in lowered.values())
    names = [
        f"zllm_block_{kind}<{tag}, {ggml_type}>"
        for kind in ("gemv", "dequant")
        for tag in ("DtypeF32", "DtypeF16", "DtypeBF16")
        for ggml_type in (2, 3, 8, 100)
    ]
    lowered = nvrtc_compile(libnvrtc, ck.kernel_source("block_gemv.cu"), options, names)
    assert all(v.startswith("_Z") for v in lowered.values())


# ---- planning (pure Python) -------------------------------------------------------------------
@pytest.mark.parametrize(
    "heads, kv_heads, group, per_block, splits",
    [(4, 4, 1, 1, 1), (9, 3, 4, 3, 1), (32, 8, 4, 4, 1), (14, 2, 8, 7, 1), (64, 8, 8, 8, 1),
     (9, 1, 8, 5, 2), (16, 1, 8, 8, 2), (40, 2, 8, 7, 3)],
)  # fmt: skip
def test_plan_decode_groups_query_heads_per_kv_head(heads, kv_heads, group, per_block, splits):
    plan = ck.plan_decode(heads, kv_heads, max_seq_len=1025, num_seqs=256)
    assert (plan.group, plan.heads_per_block, plan.splits) == (group, per_block, splits)
    assert (plan.partition_size, plan.max_partitions) == (512, 3)  # the batch fills the GPU
    assert plan.splits * plan.heads_per_block >= heads // kv_heads
    assert (plan.splits - 1) * plan.heads_per_block < heads // kv_heads  # no empty block


@pytest.mark.parametrize(
    "heads, kv_heads, max_seq_len, num_seqs, size",
    [(9, 3, 513, 1, 32), (9, 3, 8192, 1, 32), (32, 8, 8192, 1, 128), (9, 3, 8192, 16, 512),
     (9, 3, 100, 256, 512), (64, 8, 1025, 2, 32), (4, 4, 40, 1, 32)],
)  # fmt: skip
def test_plan_decode_shortens_partitions_for_small_batches(
    heads, kv_heads, max_seq_len, num_seqs, size
):
    """The longest partition (a power of two, 32..512) that still gives TARGET_BLOCKS
    thread blocks, so one sequence's context spreads over the SMs."""
    plan = ck.plan_decode(heads, kv_heads, max_seq_len, num_seqs)
    assert plan.partition_size == size
    assert plan.max_partitions == -(-max_seq_len // size)
    blocks = num_seqs * kv_heads * plan.splits * plan.max_partitions
    assert blocks >= ck.TARGET_BLOCKS or size == ck.MIN_PARTITION_SIZE
    if size < ck.MAX_PARTITION_SIZE:  # twice as long would have been too few blocks
        assert num_seqs * kv_heads * plan.splits * -(-max_seq_len // (2 * size)) < ck.TARGET_BLOCKS


def test_importing_needs_no_cupy():
    code = "import sys; import zllm.executor.kernels.cuda, zllm.executor.graphs.decode; "
    code += "import zllm.executor.attention.cuda; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- 3. emulation ------------------------------------------------------------------------------
# The emulator and its fixture: tests/csrc_emulator.py (the varlen prefill's emulated tests
# are in tests/test_csrc_prefill.py).


# (dtype, heads, kv_heads, head_dim, block_size, context lengths, block table dtype, sliding
# window or 0)
EMU_DECODE_CASES = {
    "f32-mha": (torch.float32, 4, 4, 64, 16, [1, 7, 33, 16], torch.int32, 0),
    "bf16-gqa9/3-splitk": (torch.bfloat16, 9, 3, 64, 8, [5, 600, 1100], torch.int64, 0),
    "f16-gqa32/8": (torch.float16, 32, 8, 128, 32, [1, 513, 2], torch.int32, 0),
    "f32-d256-mqa16": (torch.float32, 16, 1, 256, 16, [100, 1030], torch.int64, 0),
    "bf16-d80-mqa12": (torch.bfloat16, 12, 1, 80, 16, [700, 0], torch.int32, 0),
    "f32-gqa4/2-window": (torch.float32, 4, 2, 64, 16, [3, 100, 700, 37], torch.int32, 37),
    "bf16-window-splitk": (torch.bfloat16, 8, 2, 128, 8, [900, 20, 513], torch.int64, 600),
}


@pytest.mark.parametrize("target_blocks", [1, ck.TARGET_BLOCKS], ids=["long", "short"])
@pytest.mark.parametrize("case", EMU_DECODE_CASES)
def test_emulated_paged_decode_matches_reference(emu, case, target_blocks, monkeypatch):
    """Each case with 512-token partitions (target 1 block) and with the short partitions a
    small batch gets on a GPU (32-64 tokens: many partial results to combine)."""
    monkeypatch.setattr(ck, "TARGET_BLOCKS", target_blocks)
    dtype, heads, kv_heads, head_dim, block_size, lens, table_dtype, window = EMU_DECODE_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    num_blocks, tables = random_tables(lens, block_size, gen, table_dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    if window:  # blocks wholly before the window are released: poisoned, never read
        released = [max(0, n - window) for n in lens]
        kv_cache = poison_released_blocks(kv_cache, tables, released, block_size)
    # q as the model makes it: a view of a wider [T, heads + kv_heads, D] rope output.
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(dtype)
    q = qk[:, :heads]
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    workspace = ck.DecodeWorkspace()
    launches = ck.plan_paged_decode(
        q, kv_cache, tables, torch.tensor(lens), head_dim**-0.5, out, max(lens), workspace, window
    )
    assert launches[0].keepalive[0] is q  # strided q is read in place, not copied
    emu.run_launches(launches)
    assert not out.isnan().any(), "some output row was never written"
    expected = decode_reference(q, kv_cache, tables, lens, block_size, window)
    err = (out.double() - expected).abs().max() / expected.abs().max()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    span = min(max(lens), window or max(lens))  # the partitions cover the window only
    plan = ck.plan_decode(heads, kv_heads, span, len(lens))
    assert plan.partition_size == (512 if target_blocks == 1 else 32)
    assert len(launches) == (2 if span > plan.partition_size else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("aligned", [True, False])
def test_emulated_cache_write_lands_in_slots_and_skips_padding(emu, dtype, aligned):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim, heads = 6, 8, 2, 64, 4
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    before = kv_cache.clone()
    # K and V as the model slices them out of one fused qkv row (strided views).
    width = (heads + 2 * kv_heads) * head_dim + (0 if aligned else 1)
    qkv = torch.randn(5, width, generator=gen).to(dtype)
    offset = 0 if aligned else 1
    k = qkv[:, offset + heads * head_dim : offset + (heads + kv_heads) * head_dim]
    v = qkv[:, offset + (heads + kv_heads) * head_dim : offset + (heads + 2 * kv_heads) * head_dim]
    k, v = k.view(5, kv_heads, head_dim), v.view(5, kv_heads, head_dim)
    slots = torch.tensor([9, -1, 0, 47, -1])
    launches = ck.plan_write_kv_cache(k, v, kv_cache, slots)
    assert launches[0].args[-1] == int(aligned)  # the 16-byte path only when aligned
    emu.run_launches(launches)
    expected = before.clone()
    flat = expected.view(2, -1, kv_heads, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            flat[0, slot], flat[1, slot] = k[t], v[t]
    assert torch.equal(kv_cache, expected)


BATCHES = {
    "decode": [(1, 1), (1, 7), (1, 33), (1, 16), (1, 2)],
    "mixed": [(1, 12), (6, 6), (1, 40), (9, 25), (1, 3), (2, 2), (5, 37), (1, 600)],
    "mixed-window": [(1, 12), (30, 30), (1, 40), (9, 25), (5, 37), (1, 600)],
}


@pytest.mark.parametrize("mode", ["auto", "sdpa"])
@pytest.mark.parametrize("batch", BATCHES)
def test_emulated_cuda_attention_matches_cpu_attention(emu, monkeypatch, batch, mode):
    """CudaPagedAttention (its decode and varlen prefill kernels emulated) against the CPU's
    PagedAttention, with a sliding window of 20 in the last batch; ZLLM_CUDA_PREFILL=sdpa
    (the A/B runs' per-sequence SDPA) too."""
    monkeypatch.setattr(ck, "run_launches", emu.run_launches)
    monkeypatch.setenv("ZLLM_CUDA_PREFILL", mode)
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    pairs = BATCHES[batch]
    q_lens, lens = [q for q, _ in pairs], [n for _, n in pairs]
    gen = torch.Generator().manual_seed(3)
    num_blocks, tables = random_tables(lens, block_size, gen)
    table_lists = [row[: -(-n // block_size)].tolist() for row, n in zip(tables, lens, strict=True)]
    slot_mapping = [
        tbl[p // block_size] * block_size + p % block_size
        for tbl, q, n in zip(table_lists, q_lens, lens, strict=True)
        for p in range(n - q, n)
    ]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    t = sum(q_lens)
    query = torch.randn(t, heads, head_dim, generator=gen)
    key = torch.randn(t, kv_heads, head_dim, generator=gen)
    value = torch.randn(t, kv_heads, head_dim, generator=gen)

    window = 20 if batch == "mixed-window" else None
    args = (q_lens, lens, table_lists, slot_mapping, block_size, "cpu")
    ref_cache = cache.clone()
    ref_meta = AttentionMetadata.build(*args, sliding_window=window)
    expected = PagedAttention(heads, kv_heads, head_dim)(query, key, value, ref_cache, ref_meta)

    meta = CudaAttentionMetadata.build(*args, sliding_window=window)
    assert meta.is_decode_only == (batch == "decode")
    emu.names.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SDPA's "no fused kernel on CPU" notes
        out = CudaPagedAttention(heads, kv_heads, head_dim)(query, key, value, cache, meta)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    ran = {name.split("<")[0] for name in emu.names}
    assert {"zllm_write_kv_cache_f32", "zllm_paged_decode"} <= ran
    # one launch for every prefill, unless the A/B mode asks for SDPA per sequence
    assert ("zllm_paged_prefill" in ran) == (batch != "decode" and mode == "auto")


# Per layer of the two-layer tiny model, (KV cache group, sliding window): one metadata for
# all layers; one with a window; a window on layer 0 only (two metadata sets per step).
GRAPH_LAYOUTS = {"full": None, "all-sliding": [(0, 40)] * 2, "mixed": [(0, 24), (0, None)]}


@torch.inference_mode()
@pytest.mark.parametrize("layout", GRAPH_LAYOUTS)
def test_emulated_graph_runner_pads_static_buffers(emu, monkeypatch, tmp_path, layout):
    """CudaGraphRunner.run's buffer handling, with 'replay' re-running the captured forward;
    with sliding windows, each distinct (group, window) gets its own captured buffers."""
    from conftest import write_tiny_model

    from zllm.executor.attention.cuda import CUDA_ATTENTION
    from zllm.executor.attention.layer_groups import LayerAttention
    from zllm.executor.graphs import decode as cuda_graph
    from zllm.executor.models.llama import LlamaForCausalLM
    from zllm.executor.weights.loader import load_weights
    from zllm.model.arch import read_arch_config

    monkeypatch.setattr(ck, "run_launches", emu.run_launches)
    path = str(write_tiny_model(tmp_path / "m", hidden_size=256, intermediate_size=256,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=1024))  # fmt: skip
    arch = read_arch_config(path)
    model = LlamaForCausalLM(arch, attention=CUDA_ATTENTION)
    model.load_weights(load_weights(path, arch))
    assert all(isinstance(layer.self_attn.attn, CudaPagedAttention) for layer in model.layers)
    assert arch.num_layers == 2
    layers = GRAPH_LAYOUTS[layout] and [LayerAttention(g, w) for g, w in GRAPH_LAYOUTS[layout]]

    def build(*args):
        """The eager step's metadata, as step_inputs.build_attention_metadata shapes it."""
        if layers is None:
            return CudaAttentionMetadata.build(*args, "cpu")
        built = {k: CudaAttentionMetadata.build(*args, "cpu", k.sliding_window) for k in layers}
        return built[layers[0]] if len(built) == 1 else [built[k] for k in layers]

    block_size, max_blocks = 16, 40
    gen = torch.Generator().manual_seed(4)
    lens = [3, 520, 17, 64, 1]
    num_blocks, tables = random_tables([n + 1 for n in lens], block_size, gen)
    tables = [
        row[: -(-(n + 1) // block_size)].tolist() for row, n in zip(tables, lens, strict=True)
    ]
    caches = [torch.zeros(2, num_blocks, block_size, 2, 64) for _ in range(arch.num_layers)]

    def slot(i: int, p: int) -> int:
        return tables[i][p // block_size] * block_size + p % block_size

    ids = torch.randint(0, arch.vocab_size, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = [slot(i, p) for i, n in enumerate(lens) for p in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(ids, positions, caches, build(lens, lens, tables, slots, 16))

    class FakeGraph:
        def replay(self) -> None:
            raise AssertionError("replaced below")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    runner = cuda_graph.CudaGraphRunner(
        model, caches, max_num_seqs=6, max_blocks_per_seq=max_blocks, block_size=block_size,
        num_heads=4, head_dim=64, capture_sizes=(1, 2, 4, 8, 16), layer_attention=layers,
    )  # fmt: skip
    assert len(runner.buffers) == (2 if layout == "mixed" else 1)
    assert runner.capture_sizes == [1, 2, 4, 8] and not runner.enabled  # a CPU device
    runner.enabled = True
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    for size, graph in runner.graphs.items():
        graph.replay = lambda size=size: runner.outputs[size].copy_(runner._forward(size))

    for n in (1, 3, 5):
        new_ids = torch.randint(0, arch.vocab_size, (n,), generator=gen)
        pos = torch.tensor(lens[:n])
        meta = build(
            [1] * n, [x + 1 for x in lens[:n]], tables[:n], [slot(i, lens[i]) for i in range(n)],
            block_size,
        )  # fmt: skip
        written = torch.tensor([slot(i, lens[i]) for i in range(n)])
        eager = model(new_ids, pos, caches, meta).clone()
        cache_after_eager = [c.clone() for c in caches]
        replayed = runner.run(new_ids, pos, meta)
        assert replayed is not None
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
        for c, c_eager in zip(caches, cache_after_eager, strict=True):
            # The real rows rewrote their slots (a GEMM at the padded size may round
            # differently); padding rows (slot -1) wrote nowhere.
            flat, flat_eager = c.view(2, -1, 2, 64), c_eager.view(2, -1, 2, 64)
            torch.testing.assert_close(
                flat[:, written], flat_eager[:, written], atol=1e-4, rtol=1e-4
            )
            flat[:, written] = flat_eager[:, written]
            assert torch.equal(c, c_eager)
        padded = runner.graph_size_for(n)
        for b in runner.buffers:
            assert b.slot_mapping[n:padded].eq(-1).all() and b.seq_lens[n:padded].eq(1).all()
    assert runner.run(ids, positions, build(lens, lens, tables, slots, 16)) is None


# ---- the fused layer ops (csrc/layer_ops.cu, executor/kernels/cuda_layer_ops.py) ----------------------
LAYER_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One unit in the last place of each type, relative: what a different rounding path can move.
ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["alone", "residual"])
def test_emulated_rms_norm_matches_torch(emu, dtype, with_residual):
    """The fused residual add + RMSNorm against models/llama.py's torch path: the sum
    bit-identical, the normed rows within one rounding (only the sum of squares is added up
    in another order); x's rows strided, as a slice of a wider tensor."""
    from zllm.executor.kernels import cuda_layer_ops as lo
    from zllm.executor.layers.norms import RMSNorm

    gen = torch.Generator().manual_seed(21)
    rows, hidden = 5, 200  # 200: a row is not a multiple of the block's 128 threads
    x = torch.randn(rows, hidden + 24, generator=gen).to(dtype)[:, 7 : 7 + hidden]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    expected, expected_sum = norm(x, residual)
    out = torch.full((rows, hidden), float("nan"), dtype=dtype)
    sum_out = torch.full_like(out, float("nan")) if with_residual else None
    emu.run_launches(lo.plan_rms_norm(x, residual, norm.weight, 1e-5, out, sum_out))
    if with_residual:
        assert torch.equal(sum_out, expected_sum)
    torch.testing.assert_close(out, expected, rtol=ULP[dtype], atol=ULP[dtype])
    if dtype != torch.float32:  # fp32 keeps the scale's last bit; 16 bits round it away
        assert (out == expected).float().mean() > 0.95


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("rotary", [64, 48], ids=["full", "partial"])
def test_emulated_rope_equals_torch_bitwise(emu, dtype, rotary):
    """RoPE in place on q and k as they lie in the fused qkv output (strided heads), against
    apply_rope: the same bits, torch's roundings included; with a partial rotary factor the
    dimensions past the rotated ones stay as they were."""
    from zllm.executor.kernels import cuda_layer_ops as lo
    from zllm.executor.layers.rope import apply_rope

    gen = torch.Generator().manual_seed(22)
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    table = torch.randn(100, rotary, generator=gen).to(dtype)  # cos | sin per position
    positions = torch.tensor([0, 5, 99, 3, 3, 42])
    cos, sin = table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    expected = apply_rope(qk.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    emu.run_launches(lo.plan_rope(qk, cos, sin))
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("rotary", [64, 48], ids=["full", "partial"])
def test_emulated_rope_cache_equals_rope_then_the_cache_write(emu, dtype, rotary):
    """One kernel for RoPE and the KV cache write: q and k rotated in place as zllm_rope
    does (torch's bits), then the rotated k and v at each token's slot, exactly what the
    separate cache write stores; a padding row (slot -1) writes nothing."""
    from zllm.executor.kernels import cuda as ck
    from zllm.executor.kernels import cuda_layer_ops as lo
    from zllm.executor.layers.rope import apply_rope

    gen = torch.Generator().manual_seed(24)
    tokens, heads, kv_heads, head_dim, block_size = 5, 4, 2, 64, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    table = torch.randn(50, rotary, generator=gen).to(dtype)
    cos, sin = table.index_select(0, torch.tensor([3, 0, 7, 49, 12])).unsqueeze(1).chunk(2, -1)
    cache = torch.randn(2, 6, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([5, 0, -1, 23, 9])
    expected_qk = apply_rope(qk.clone(), cos, sin)
    expected_cache = cache.clone()
    keep = slots >= 0
    flat = expected_cache.view(2, -1, kv_heads, head_dim)
    flat[0, slots[keep]] = expected_qk[keep, heads:]
    flat[1, slots[keep]] = v[keep]
    emu.names.clear()
    emu.run_launches(lo.plan_rope_cache(qk, v, cos, sin, cache, slots))
    assert {name.split("<")[0] for name in emu.names} == {"zllm_rope_cache"}
    assert torch.equal(qk, expected_qk)
    assert torch.equal(cache, expected_cache)
    with pytest.raises(ck.CudaKernelError, match="rope_cache takes"):
        lo.plan_rope_cache(qk, v.transpose(1, 2), cos, sin, cache, slots)


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("chunk", [64, 256])  # 3 column blocks per row, or 1
def test_emulated_silu_mul_matches_torch(emu, dtype, chunk, monkeypatch):
    from zllm.executor.kernels import cuda_layer_ops as lo

    monkeypatch.setattr(lo, "SILU_THREADS", chunk)

    gen = torch.Generator().manual_seed(23)
    gate_up = torch.randn(7, 2 * 150, generator=gen).mul(4).to(dtype)
    out = torch.full((7, 150), float("nan"), dtype=dtype)
    emu.run_launches(lo.plan_silu_mul(gate_up, out))
    gate, up = gate_up.split(150, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
@torch.inference_mode()
def test_emulated_layer_ops_in_the_model(emu, monkeypatch, dtype, arch):
    """The model with every fused op it takes (as on a GPU, here emulated) against the same
    model on torch's ops: its layouts reach the kernels as they expect. Qwen 3's per-head
    q/k norms are strided 3-D views, which stay on torch's path; Phi-3 rotates part of each
    head."""
    from tiny_models import arch_config_of, tiny_hf_config

    from zllm.executor.kernels import cuda_layer_ops as lo
    from zllm.executor.models.llama import LlamaForCausalLM

    extra = {"partial_rotary_factor": 0.75} if arch == "phi3" else {}
    cfg = arch_config_of(tiny_hf_config(arch, **extra))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, dtype=dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    lens = [5, 1, 9]
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),))
    positions = torch.cat([torch.arange(n) for n in lens])
    caches = [torch.zeros(2, 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)] * cfg.num_layers
    tables = [[1], [2], [3]]
    slots = [tables[i][0] * 16 + p for i, n in enumerate(lens) for p in range(n)]
    meta = AttentionMetadata.build(lens, lens, tables, slots, 16, "cpu")
    expected = model(ids, positions, caches, meta)
    monkeypatch.setattr(lo, "usable", lambda x: True)
    monkeypatch.setattr(lo, "run_launches", emu.run_launches)
    emu.names.clear()
    fused = model(ids, positions, caches, meta)
    ran = {name.split("<")[0] for name in emu.names}
    # RoPE and the cache write are one kernel; the attention layer then skips its write.
    assert ran == {"zllm_rms_norm", "zllm_rope_cache", "zllm_silu_mul"}
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused, expected, rtol=tol, atol=tol)
