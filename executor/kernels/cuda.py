"""zllm's CUDA kernels (csrc/), compiled at run time with CuPy/NVRTC and launched on torch tensors.

There is no build step: the first call of a kernel compiles its source with NVRTC (a few
seconds; CuPy caches the binary under ~/.cupy/kernel_cache, so later processes load it at
once) and launches it on torch's current stream, passing the tensors' device pointers, so no
data is copied or converted. Importing this module needs neither CuPy nor a GPU; CuPy is
imported by the first launch (`pip install zllm[cuda]`).

    write_kv_cache(key, value, kv_cache, slot_mapping)                    csrc/kv_cache.cu
    paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale)    csrc/paged_attention.cu
    paged_prefill_attention (executor/attention/cuda_prefill.py)                    csrc/paged_prefill.cu

Each public function first plans its launches as `KernelLaunch` records (pure Python: kernel
name, grid, typed arguments), then runs them. The CPU tests run the same records through a
host emulator of the kernels (csrc/emu), so the planning is tested without a GPU too.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zllm.executor.kernels.csrc_dir import CSRC_DIR

COMMON_HEADER = "zllm_common.cuh"
NVRTC_OPTIONS = ("-std=c++17",)

# Must match the constants of csrc/paged_attention.cu.
MAX_PARTITION_SIZE = 512  # context tokens per split-K partition, at most
MIN_PARTITION_SIZE = 32
# Thread blocks a decode launch aims for: about four per SM of an H100 (132 SMs). Below it,
# partitions shrink (down to MIN_PARTITION_SIZE) so a small batch still spreads out.
TARGET_BLOCKS = 512
NUM_THREADS = 128
MAX_GROUP = 8  # query heads one thread block serves (GQA); more are split over blocks
SUPPORTED_HEAD_DIMS = (64, 80, 96, 112, 128, 256)

_DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_DTYPE_TAG = {torch.float32: "DtypeF32", torch.float16: "DtypeF16", torch.bfloat16: "DtypeBF16"}
_INDEX_DTYPES = (torch.int32, torch.int64)


class CudaKernelError(RuntimeError):
    """A kernel cannot run: CuPy missing, or inputs the kernels do not support."""


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """One kernel launch, with its arguments typed as the kernel declares them."""

    source: str  # file under csrc/
    name: str  # extern "C" name, or a template name expression for NVRTC
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[Any, ...]  # numpy scalars: uint64 pointers, int32/int64, float32
    # Tensors made while planning (contiguous copies, scratch) that the pointers in args
    # point into: held here so they live until the launch is enqueued.
    keepalive: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How paged_decode_attention splits the work over thread blocks."""

    group: int  # GROUP template argument: query heads per block, rounded up to 1, 2, 4 or 8
    heads_per_block: int  # query heads each block really serves
    splits: int  # blocks per KV head (> 1 only when a KV head has over 8 query heads)
    partition_size: int  # context tokens per split-K partition (a power of two, 32..512)
    max_partitions: int  # split-K partitions of partition_size tokens covering max_seq_len


def plan_decode(
    num_heads: int, num_kv_heads: int, max_seq_len: int, num_seqs: int = 1
) -> DecodePlan:
    """The split of a decode launch. Partitions are as long as possible (fewer partial
    results to combine) while the grid still has TARGET_BLOCKS blocks: many sequences get
    512-token partitions, one sequence gets short ones so its context spreads over the SMs."""
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise CudaKernelError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    group_size = num_heads // num_kv_heads
    splits = -(-group_size // MAX_GROUP)
    heads_per_block = -(-group_size // splits)
    group = 1 << (heads_per_block - 1).bit_length()
    max_seq_len = max(1, max_seq_len)
    size = MAX_PARTITION_SIZE
    per_partition = max(1, num_seqs) * num_kv_heads * splits  # blocks per partition index
    while size > MIN_PARTITION_SIZE and per_partition * -(-max_seq_len // size) < TARGET_BLOCKS:
        size //= 2
    return DecodePlan(group, heads_per_block, splits, size, -(-max_seq_len // size))


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _aligned16(t: torch.Tensor, *strides: int) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in strides)


def _check_devices(kv_cache: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != kv_cache.device:
            raise CudaKernelError(f"{name} is on {t.device}, the KV cache on {kv_cache.device}")


def _check_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise CudaKernelError(
            "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim] "
            f"tensor, got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in _DTYPE_SUFFIX:
        raise CudaKernelError(f"unsupported KV cache dtype {kv_cache.dtype}")
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


# ---- planning: tensors in, launch records out --------------------------------------------------
def plan_write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> list[KernelLaunch]:
    num_blocks, block_size, num_kv_heads, head_dim = _check_cache(kv_cache)
    shape = (key.shape[0], num_kv_heads, head_dim)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != shape or t.dtype != kv_cache.dtype or t.stride(-1) != 1:
            raise CudaKernelError(
                f"{name} must be {kv_cache.dtype} {list(shape)} with a contiguous last dim, "
                f"got {t.dtype} {list(t.shape)} strides {t.stride()}"
            )
    _check_devices(kv_cache, key=key, value=value, slot_mapping=slot_mapping)
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise CudaKernelError(f"slot_mapping must be int64 [{key.shape[0]}]")
    slot_mapping = slot_mapping.contiguous()
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return []
    vectorized = (
        _aligned16(key, key.stride(0), key.stride(1))
        and _aligned16(value, value.stride(0), value.stride(1))
        and _aligned16(kv_cache, head_dim)
    )
    args = (
        _ptr(key),
        _ptr(value),
        _ptr(kv_cache),
        _ptr(slot_mapping),
        np.int64(key.stride(0)),
        np.int64(key.stride(1)),
        np.int64(value.stride(0)),
        np.int64(value.stride(1)),
        np.int32(num_kv_heads),
        np.int32(head_dim),
        np.int64(num_blocks * block_size),
        np.int32(vectorized),
    )
    name = f"zllm_write_kv_cache_{_DTYPE_SUFFIX[kv_cache.dtype]}"
    grid = (num_tokens, 1, 1)
    return [KernelLaunch("kv_cache.cu", name, grid, (NUM_THREADS, 1, 1), args, (slot_mapping,))]


class DecodeWorkspace:
    """fp32 scratch for the split-K partial results: [S, heads, partitions] x (D + 2) floats.

    One workspace serves every layer of a step (the layers run one after another on one
    stream), and a CUDA graph's workspace is sized once before capture so replays never
    allocate.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def reserve(self, num_floats: int, device: torch.device) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < num_floats or self.buffer.device != device:
            self.buffer = torch.empty(num_floats, dtype=torch.float32, device=device)
        return self.buffer

    @staticmethod
    def num_floats(num_seqs: int, num_heads: int, max_partitions: int, head_dim: int) -> int:
        return num_seqs * num_heads * max_partitions * (head_dim + 2)

    def partials(self, q: torch.Tensor, parts: int) -> list[torch.Tensor]:
        """A split decode's partial outputs, maxima and sums: views of the one buffer."""
        num_seqs, num_heads, head_dim = q.shape
        n = num_seqs * num_heads * parts
        buf = self.reserve(self.num_floats(num_seqs, num_heads, parts, head_dim), q.device)
        return [
            buf[: n * head_dim],
            buf[n * head_dim : n * (head_dim + 1)],
            buf[n * (head_dim + 1) : n * (head_dim + 2)],
        ]


@dataclass(frozen=True, slots=True)
class _DecodeArgs:
    """A planned paged decode's tensors (made contiguous where the kernel needs it)."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor
    partials: list[torch.Tensor | None]  # out, max, sum: null pointers for one partition
    plan: DecodePlan
    window: int  # sliding window (0: none): each query sees its last `window` positions
    keepalive: tuple[torch.Tensor, ...]
    sinks: torch.Tensor | None = None  # fp32 [heads]: attention sink logits (gpt-oss)

    @property
    def seq_lens_int64(self) -> np.int32:
        return np.int32(self.seq_lens.dtype == torch.int64)


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Attention sink logits as the kernels read them: contiguous fp32 [heads] beside q."""
    if sinks is None:
        return
    heads = q.shape[1]
    if sinks.shape != (heads,) or sinks.dtype != torch.float32 or not sinks.is_contiguous():
        shown = f"{sinks.dtype} {list(sinks.shape)}"
        raise CudaKernelError(f"sinks must be contiguous fp32 [{heads}], got {shown}")
    if sinks.device != q.device:
        raise CudaKernelError(f"sinks are on {sinks.device}, q on {q.device}")


def check_query(
    q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor
) -> tuple[int, int, int, int]:
    """The cache's (num_blocks, block_size, num_kv_heads, head_dim), once q [tokens, heads,
    head_dim] (a head size the kernels have) and out (contiguous, like q) match it."""
    dims = _check_cache(kv_cache)
    head_dim = dims[3]
    if q.dim() != 3 or q.shape[2] != head_dim or q.dtype != kv_cache.dtype:
        raise CudaKernelError(
            f"q must be {kv_cache.dtype} [tokens, heads, {head_dim}], got {q.dtype} {list(q.shape)}"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise CudaKernelError(f"head_dim={head_dim} unsupported (supported: {SUPPORTED_HEAD_DIMS})")
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or not out.is_contiguous():
        raise CudaKernelError("out must be a contiguous tensor shaped and typed like q")
    return dims


def _check_decode_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, int, int, int]:
    """The cache's (num_blocks, block_size, num_kv_heads, head_dim), once every argument of a
    paged decode is checked against it."""
    dims = check_query(q, kv_cache, out)
    num_seqs = q.shape[0]
    _check_devices(kv_cache, q=q, out=out, block_tables=block_tables, seq_lens=seq_lens)
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or block_tables.dtype not in _INDEX_DTYPES
    ):
        raise CudaKernelError(f"block_tables must be int32/int64 [{num_seqs}, max_blocks]")
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype not in _INDEX_DTYPES:
        raise CudaKernelError(f"seq_lens must be int32/int64 [{num_seqs}]")
    if num_seqs > 65535:
        raise CudaKernelError(f"{num_seqs} sequences exceed one launch's grid (65535)")
    return dims


def plan_paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_seq_len: int | None = None,
    workspace: DecodeWorkspace | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> list[KernelLaunch]:
    """Launches for paged_decode_attention; `out` must be a contiguous [S, heads, D] tensor."""
    _, block_size, num_kv_heads, _ = _check_decode_args(q, kv_cache, block_tables, seq_lens, out)
    check_sinks(sinks, q)
    num_seqs, num_heads, _ = q.shape
    if num_seqs == 0:
        return []
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    if q.stride(2) != 1 or not _aligned16(q, q.stride(0), q.stride(1)):
        q = q.contiguous()  # the kernel reads q in 16-byte units; our model's q never copies
    if max_seq_len is None:  # an upper bound that needs no device-to-host sync
        max_seq_len = block_tables.shape[1] * block_size

    if window > 0:  # the partitions cover the window only
        max_seq_len = min(max_seq_len, window)
    plan = plan_decode(num_heads, num_kv_heads, max_seq_len, num_seqs)
    partials: list[torch.Tensor | None] = [None] * 3
    if plan.max_partitions > 1:
        partials = (workspace or DecodeWorkspace()).partials(q, plan.max_partitions)
    held = (q, block_tables, seq_lens, out, partials[0], sinks)
    keepalive = tuple(t for t in held if t is not None)
    args = _DecodeArgs(
        q, kv_cache, block_tables, seq_lens, out, partials, plan, max(0, window), keepalive, sinks
    )
    launches = [_decode_launch(args, scale)]
    if plan.max_partitions > 1:
        launches.append(_reduce_launch(args))
    return launches


def _decode_launch(a: _DecodeArgs, scale: float) -> KernelLaunch:
    """zllm_paged_decode: each (kv head split, sequence, partition) block attends its part."""
    _, num_blocks, block_size, num_kv_heads, head_dim = a.kv_cache.shape
    num_seqs, num_heads, _ = a.q.shape
    plan = a.plan
    return KernelLaunch(
        "paged_attention.cu",
        f"zllm_paged_decode<{_DTYPE_TAG[a.q.dtype]}, {head_dim}, {plan.group}>",
        (num_kv_heads * plan.splits, num_seqs, plan.max_partitions),
        (NUM_THREADS, 1, 1),
        (
            _ptr(a.out),
            *map(_ptr, a.partials),
            _ptr(a.q),
            np.int64(a.q.stride(0)),
            np.int64(a.q.stride(1)),
            _ptr(a.kv_cache),
            np.int64(num_blocks * block_size),
            _ptr(a.block_tables),
            np.int32(a.block_tables.dtype == torch.int64),
            np.int64(a.block_tables.stride(0)),
            _ptr(a.seq_lens),
            a.seq_lens_int64,
            np.int32(num_heads),
            np.int32(num_kv_heads),
            np.int32(block_size),
            np.int32(plan.max_partitions),
            np.int32(plan.heads_per_block),
            np.float32(scale),
            np.int32(plan.partition_size),
            np.int32(a.window),
            _ptr(a.sinks),
        ),
        a.keepalive,
    )


def _reduce_launch(a: _DecodeArgs) -> KernelLaunch:
    """zllm_paged_decode_reduce: combines a split decode's partitions into `out`."""
    num_seqs, num_heads, head_dim = a.q.shape
    return KernelLaunch(
        "paged_attention.cu",
        f"zllm_paged_decode_reduce<{_DTYPE_TAG[a.q.dtype]}>",
        (num_heads, num_seqs, 1),
        (NUM_THREADS, 1, 1),
        (
            _ptr(a.out),
            *map(_ptr, a.partials),
            _ptr(a.seq_lens),
            a.seq_lens_int64,
            np.int32(num_heads),
            np.int32(head_dim),
            np.int32(a.plan.max_partitions),
            np.int32(a.plan.partition_size),
            np.int32(a.window),
            _ptr(a.sinks),
        ),
        a.keepalive,
    )


# ---- running on the GPU ---------------------------------------------------------------------------
_lock = threading.Lock()
_kernels: dict[tuple[str, str], Any] = {}  # (source, name) -> cupy.RawKernel
_streams: dict[int, Any] = {}  # torch stream handle -> cupy.cuda.ExternalStream


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise CudaKernelError(
            "zllm's CUDA kernels need CuPy: pip install zllm[cuda] "
            "(or the cupy-cudaXXx wheel matching your CUDA version)"
        ) from e
    return cupy


def kernel_source(source: str) -> str:
    """The source NVRTC compiles: the .cu file with the common header pasted in."""
    header = (CSRC_DIR / COMMON_HEADER).read_text()
    text = (CSRC_DIR / source).read_text()
    include = f'#include "{COMMON_HEADER}"'
    if include not in text:
        raise CudaKernelError(f"{source} does not include {COMMON_HEADER}")
    return text.replace(include, header, 1)


def get_kernel(source: str, name: str):
    """The compiled kernel (compiled on first use, then cached in memory and on disk)."""
    key = (source, name)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                cupy = _cupy()
                is_template = "<" in name
                module = cupy.RawModule(
                    code=kernel_source(source),
                    options=NVRTC_OPTIONS,
                    name_expressions=[name] if is_template else None,
                )
                kernel = module.get_function(name)
                kernel.compile()
                _kernels[key] = kernel
    return kernel


def _current_stream(device: torch.device):
    handle = torch.cuda.current_stream(device).cuda_stream
    stream = _streams.get(handle)
    if stream is None:
        index = torch.cuda.current_device() if device.index is None else device.index
        stream = _streams[handle] = _cupy().cuda.ExternalStream(handle, index)
    return stream


def run_launches(launches: list[KernelLaunch], device: torch.device) -> None:
    """Launch on torch's current stream of `device` (and so into a CUDA graph being captured)."""
    if not launches:
        return
    if device.type != "cuda":
        raise CudaKernelError(f"CUDA kernels need CUDA tensors, got device {device}")
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            run_launches(launches, device)
        return
    stream = _current_stream(device)
    for launch in launches:
        get_kernel(launch.source, launch.name)(
            launch.grid, launch.block, launch.args, stream=stream
        )


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new K and V ([T, kv_heads, head_dim]) at their cache slots; slot -1 is skipped."""
    run_launches(plan_write_kv_cache(key, value, kv_cache, slot_mapping), kv_cache.device)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    workspace: DecodeWorkspace | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence attends to its context through the block tables.

    q [S, heads, D] -> [S, heads, D]. `max_seq_len` (host int, >= every seq_len) sets the
    number of split-K partitions; without it the block tables' width bounds it (no sync).
    Rows with seq_len 0 come out as zeros. With a sliding `window` > 0 each query sees only
    its last `window` positions (table entries before them are never read). `sinks` fp32
    [heads]: attention sink logits in each head's softmax denominator (gpt-oss).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    launches = plan_paged_decode(
        q, kv_cache, block_tables, seq_lens, scale, out, max_seq_len, workspace, window, sinks
    )
    run_launches(launches, q.device)
    return out
