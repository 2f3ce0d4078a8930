"""`zllm bench kv-capacity`: how many tokens of long sequences the KV pool holds at once,
with and without the hybrid KV cache (zllm/kv/cache_groups.py).

No model runs: the pool is sized as the executor sizes it (the budget over the bytes of a
block), then the block manager itself is driven as the scheduler would drive it: each
sequence is prefilled in chunks and decoded to `--context-len`, sliding groups releasing
blocks as they go, until the next sequence no longer fits. The count is what the block
manager really admits, not a formula.
"""

from __future__ import annotations

import argparse

from zllm.config.arg_utils import parse_size
from zllm.config.engine import DEFAULT_CPU_KV_CACHE_BYTES
from zllm.core.kv.block_manager import BlockManager
from zllm.kv.cache_groups import kv_bytes_per_slot, kv_cache_groups
from zllm.kv.kv_dtypes import KV_CACHE_DTYPES, KV_DTYPE_NAMES
from zllm.model.arch import arch_of
from zllm.model.files import resolve_model


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "kv-capacity", help="concurrent long sequences the KV pool holds, hybrid cache on/off"
    )
    p.add_argument("--model", default=None, help="a short name, a .gguf file or a HF directory")
    p.add_argument("--context-len", type=int, default=8192)
    p.add_argument("--kv-cache-memory-bytes", type=parse_size, default=DEFAULT_CPU_KV_CACHE_BYTES)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="auto: --dtype"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    p.set_defaults(func=main)


def concurrent_sequences(
    num_blocks: int, block_size: int, windows: list[int | None], context_len: int, chunk: int
) -> int:
    """Sequences of `context_len` tokens the block manager holds at once: each one's prompt
    (all but the last token) prefilled in chunks, then its last token decoded, which is
    when a sliding group is down to its window."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False, sliding_windows=windows)
    tokens = [0] * context_len  # contents do not matter without prefix caching
    count = 0
    while True:
        req_id = f"s{count}"
        computed = 0
        while computed < context_len:
            step = min(chunk, context_len - 1 - computed) or 1
            if not bm.allocate_slots(req_id, tokens, computed, step):
                return count
            computed += step
        count += 1


def main(args: argparse.Namespace) -> int:
    arch = arch_of(resolve_model(args.model))
    stored = KV_DTYPE_NAMES.get(args.kv_cache_dtype, args.dtype)
    print(
        f"{arch.architecture}: {arch.num_layers} layers, window {arch.sliding_window}, "
        f"{args.kv_cache_memory_bytes / 2**30:.2f} GiB {stored} KV pool, "
        f"block {args.block_size}, sequences of {args.context_len} tokens"
    )
    for hybrid in (False, True):
        groups = kv_cache_groups(arch, hybrid)
        per_block = kv_bytes_per_slot(arch, groups, stored) * args.block_size
        num_blocks = args.kv_cache_memory_bytes // per_block
        windows = [g.sliding_window for g in groups]
        seqs = concurrent_sequences(
            num_blocks, args.block_size, windows, args.context_len, args.chunk
        )
        print(
            f"  hybrid {'on ' if hybrid else 'off'}: {len(groups)} group(s), {num_blocks} blocks: "
            f"{seqs} sequences = {seqs * args.context_len} concurrent tokens"
        )
    return 0
