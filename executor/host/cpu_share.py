"""How many threads the executor runs on a CPU it shares with other programs.

torch's OpenMP pool (every CPU kernel's `at::parallel_for`) ends each parallel region with its
threads spinning until all of them have arrived. A decode step is hundreds of short regions,
a few per layer, so when another program holds one of the pool's cores, every region waits
for the thread the scheduler took away. Measured on a 2-core VM, SmolLM2 decoding one row: 18
ms a token alone with 2 threads; beside one busy process 710-880 ms with 2 threads (38 ms with
OMP_WAIT_POLICY=passive, which costs 29 ms alone), 31-33 ms with 1.

So the executor counts the cores other programs take (the CPU time spent on the cores it may
run on, less its own, from /proc over the last second) and runs on the rest: at most the
threads it started with, at least one. Its own siblings (the core, the frontend, the
detokenizers) took about 0.05 of a core while it decoded at concurrency 8 and 32 (measured),
inside `MARGIN_CORES`. The model runner asks before each step (`ModelRunner.launch`); where
it does not ask: off the CPU, with several ranks (each rank's share is set as they join,
executor/parallel/groups.py, and each would count the others' spinning as taken), under
--deterministic (its bits must not hang on a thread count that changes mid-run), and with
ZLLM_CPU_SHARE=0.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

# Others' use below this much of a core leaves every core to us: noise, and our siblings.
MARGIN_CORES = 0.3
# Each count covers at least this long: shorter windows would follow a competitor's bursts.
WINDOW_S = 1.0


def threads_for(cores: int, max_threads: int, others: float) -> int:
    """The threads to run with `others` cores' worth of other programs' work on our `cores`:
    each core they take (beyond the margin, rounded up) costs one thread."""
    taken = math.ceil(max(0.0, others - MARGIN_CORES))
    return max(1, min(max_threads, cores - taken))


def busy_ticks(cpus: set[int]) -> int:
    """Clock ticks the CPUs `cpus` have spent not idle since boot (/proc/stat: user, nice,
    system, irq, softirq and steal: a hypervisor's theft takes a core as a program does)."""
    busy = 0
    with open("/proc/stat") as stat:
        for line in stat:
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if name == "cpu" or int(name[3:]) not in cpus:
                continue
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            busy += user + nice + system + irq + softirq + steal
    return busy


def own_ticks() -> int:
    """Clock ticks this process (all its threads) has run, user and system."""
    with open("/proc/self/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime: the 14th and 15th fields


class CpuShare:
    """The thread count for the next step, re-measured once a window has passed."""

    def __init__(self, max_threads: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = self.threads = max_threads
        self.cpus = os.sched_getaffinity(0)
        self.others = 0.0  # cores other programs took in the last window
        self._clock = clock
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        # The first window opens at the first step: the load before it (the engine's other
        # processes starting beside this one) says nothing of the CPU it will share.
        self._since: tuple[float, int, int] | None = None

    def threads_now(self) -> int:
        now = self._clock()
        if self._since is None:
            self._since = (now, busy_ticks(self.cpus), own_ticks())
            return self.threads
        start, busy_then, own_then = self._since
        if now - start < WINDOW_S:
            return self.threads
        busy, own = busy_ticks(self.cpus), own_ticks()
        self._since = (now, busy, own)
        others_ticks = (busy - busy_then) - (own - own_then)
        self.others = max(0.0, others_ticks / self._ticks_per_s / (now - start))
        self.threads = threads_for(len(self.cpus), self.max_threads, self.others)
        return self.threads


def cpu_share_for(
    device: str, world_size: int, deterministic: bool, threads: int
) -> CpuShare | None:
    """The executor's CpuShare, or None where the thread count stays as started (see above)."""
    if not device.startswith("cpu") or world_size > 1 or deterministic or threads < 2:
        return None
    if os.environ.get("ZLLM_CPU_SHARE", "1") == "0" or not os.path.exists("/proc/stat"):
        return None
    return CpuShare(threads)
