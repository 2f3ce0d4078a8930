"""A process's own memory, as a leak shows in it: anonymous resident pages plus swap.

RSS is the wrong gauge for a leak. It counts file-backed pages (shared libraries, the mapped
weights), which the kernel drops and reads back at will, and it loses whatever was swapped
out: a process leaking a few KB per request on a host with swap keeps a flat RSS while its
swap grows. Memory the process allocated itself (heap, arenas, anonymous mmaps) is RssAnon
while resident and VmSwap once swapped out (shared-memory swap aside); their sum only grows
by allocation. Both come from /proc/<pid>/status, in KiB.

`growth_per_request` turns samples of that sum into bytes per request: the least-squares
slope over the samples after a warm-up, which one noisy sample moves less than it moves a
last-minus-first difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    anon_kib: int  # RssAnon: anonymous pages resident now
    swap_kib: int  # VmSwap: anonymous pages swapped out

    @property
    def total_kib(self) -> int:
        return self.anon_kib + self.swap_kib


def process_memory(pid: int | str = "self") -> ProcessMemory:
    """RssAnon and VmSwap of `pid` (default this process). A process without memory of its
    own (a kernel thread) reads as zero; a pid that is gone raises FileNotFoundError or
    ProcessLookupError, as /proc does."""
    fields = {"RssAnon:": 0, "VmSwap:": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            words = line.split()  # "RssAnon:\t    1234 kB"
            if words and words[0] in fields:
                fields[words[0]] = int(words[1])
    return ProcessMemory(anon_kib=fields["RssAnon:"], swap_kib=fields["VmSwap:"])


@dataclass(frozen=True, slots=True)
class MemorySample:
    """One process's memory after `requests` requests had finished."""

    requests: int
    memory: ProcessMemory


def growth_per_request(samples: Sequence[MemorySample], warmup_requests: int = 0) -> float:
    """Bytes per request: the least-squares slope of anon + swap over the samples taken at or
    after `warmup_requests` (allocator pools, caches and lazily built code paths fill during
    the first requests and would read as a leak). Needs two such samples."""
    kept = [s for s in samples if s.requests >= warmup_requests]
    if len({s.requests for s in kept}) < 2:
        raise ValueError(
            f"need samples at two request counts from {warmup_requests} on, got "
            f"{[s.requests for s in kept]}: lower the warm-up or sample more often"
        )
    xs = [float(s.requests) for s in kept]
    ys = [s.memory.total_kib * 1024.0 for s in kept]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    variance = sum((x - mean_x) ** 2 for x in xs)
    return covariance / variance
