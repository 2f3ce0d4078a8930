"""What the disk tier's per-file check costs: CRC-32 (file format 2) against HMAC-SHA256 under
the tier's key (format 3, zllm/kv/tier_key.py), over one block's bytes, in the same run.

A block is every layer's K and V for `--block-size` tokens; the default shape is SmolLM2's
(30 layers, 3 KV heads of 64, fp32: 737,280 bytes per 16-token block). Stores pay the check
on the tier's writer thread, loads once per block read back from disk.

    python benchmarks/tier_check_cost.py [--layers 30 --kv-heads 3 --head-dim 64 --bytes 4]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import time
import zlib


def per_call_s(fn, calls: int, runs: int = 7) -> float:
    """Median over `runs` of the mean seconds per call of `calls` back-to-back calls."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--bytes", type=int, default=4, help="bytes per element (4: fp32)")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    nbytes = args.layers * 2 * args.block_size * args.kv_heads * args.head_dim * args.bytes
    block, key = os.urandom(nbytes), os.urandom(32)
    checks = {
        "crc32": lambda: zlib.crc32(block),
        "hmac-sha256": lambda: hmac.new(key, block, hashlib.sha256).digest(),
    }
    print(f"one block: {nbytes:,} bytes")
    for name, fn in checks.items():
        s = per_call_s(fn, args.calls)
        print(f"{name:12s} {s * 1e3:7.3f} ms per block  {nbytes / s / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
