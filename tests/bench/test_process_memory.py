"""zllm/bench/process_memory.py: anonymous memory plus swap read from /proc, and its growth."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zllm.bench.process_memory import (
    MemorySample,
    ProcessMemory,
    growth_per_request,
    process_memory,
)

MIB = 1024  # in KiB


# Run in a fresh interpreter: after a long test session the allocator may keep a freed block
# mapped (glibc raises its mmap threshold as blocks are freed; a library may tune it), which
# says nothing about the reader.
ALLOCATE_AND_FREE = """
from zllm.bench.process_memory import process_memory
size = 64 << 20
before = process_memory()
block = bytearray(size)  # zero-filled by CPython: every page written, so resident
block[::4096] = b"\\x01" * (size // 4096)
during = process_memory()
del block  # a large block is its own mmap: freeing it unmaps it
after = process_memory()
print(before.total_kib, during.total_kib, after.total_kib)
"""


def test_a_touched_allocation_raises_anonymous_memory_by_its_size_and_freeing_lowers_it():
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATE_AND_FREE], capture_output=True, text=True, check=True
    )
    before, during, after = map(int, out.stdout.split())
    assert 60 * MIB < during - before < 70 * MIB, (before, during)
    assert during - after > 60 * MIB, (during, after)


def test_another_process_is_read_by_pid_and_a_gone_one_raises():
    code = "import sys; b = bytearray(32 << 20); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout.readline() == b"ready\n"
        assert process_memory(child.pid).total_kib >= 32 * MIB
    finally:
        child.communicate(b"", timeout=30)
    with pytest.raises((FileNotFoundError, ProcessLookupError)):
        process_memory(child.pid)


def samples(points: list[tuple[int, int]]) -> list[MemorySample]:
    return [MemorySample(n, ProcessMemory(anon_kib=kib, swap_kib=0)) for n, kib in points]


def test_swap_counts_as_memory():
    assert ProcessMemory(anon_kib=100, swap_kib=28).total_kib == 128
    moved = [
        MemorySample(0, ProcessMemory(anon_kib=1000, swap_kib=0)),
        MemorySample(1000, ProcessMemory(anon_kib=400, swap_kib=600)),  # swapped out, not freed
    ]
    assert growth_per_request(moved) == 0.0


def test_growth_is_the_least_squares_slope_after_the_warm_up():
    # A 50 MiB warm-up, then a few KiB of noise.
    points = [(0, 0), (1000, 50 * MIB), (2000, 50 * MIB + 1), (3000, 50 * MIB + 5)]
    points += [(4000, 50 * MIB + 3), (5000, 50 * MIB + 4)]
    slope = growth_per_request(samples(points), warmup_requests=2000)
    # x = 2..5 thousand, y = 1, 5, 3, 4 KiB: covariance 3.5 over variance 5, 0.7 KiB per
    # thousand requests (last minus first would say 1 KiB).
    assert slope == pytest.approx(0.7 * 1024 / 1000)
    # Without the warm-up the 50 MiB jump dominates.
    assert growth_per_request(samples(points)) > 5000


def test_growth_needs_two_samples_after_the_warm_up():
    with pytest.raises(ValueError, match="two request counts"):
        growth_per_request(samples([(0, 1), (1000, 2)]), warmup_requests=1000)
