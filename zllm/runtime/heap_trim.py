"""Freed heap memory back to the system once a process goes idle: glibc's `malloc_trim`.

Why (issue 56): glibc serves a block of 128 KiB or more with a mapping of its own, unmapped
when freed, only until the first such block is freed; it then raises that threshold to the
block's size (up to 32 MiB), so later blocks of that size come from the heap, which it
shrinks only at its top, past twice that threshold. The executor frees a step's large tensors every step (a decode
step's logits are rows x vocabulary fp32: 1.5 MiB at 8 rows of SmolLM2's; a prefill's
activations), so after its first steps they all live in the heap, whose resident size
follows the largest steps seen and the fragmentation between them: on SmolLM2 the idle
executor held ~54 MiB more than with the threshold fixed, and the high-water mark went on
rising in steps (+1.4 MiB between 3,000 and 3,500 requests of one run), which is the
issue's growth per request. Fixing the threshold would map and fault in every large tensor
afresh each step (13-25% of SmolLM2's throughput on 2 cores); trimming once the process is
idle keeps the heap's speed while it works (what it holds then is bounded by the largest
steps, --max-num-batched-tokens and --max-num-seqs) and hands back, between spells of work,
every page it no longer uses.

    trim_heap()   every glibc arena's free pages back to the system, now
    IdleTrim      a loop's wait for its next message, trimming once after each spell of work
                  when `idle_s` pass without one (the executor's step loop)
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import zmq

# How long a loop waits for its next message before it trims: past a busy spell's gaps
# between steps (milliseconds), short enough that an idle server soon holds only what it uses.
IDLE_TRIM_S = 1.0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library is not glibc."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Hand every glibc arena's free pages back to the system: the free top of each heap,
    and (glibc 2.8 on) the whole free pages inside it. False where the C library is not
    glibc; its allocator then reuses the memory rather than returning it."""
    malloc_trim = _malloc_trim()
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


class IdleTrim:
    """Wait for a loop's next message; after work, trim the heap once when `idle_s` pass
    without one. The trim costs a few milliseconds and the page faults that refill the heap
    when work resumes, so it runs once per idle spell, never between busy steps."""

    def __init__(self, idle_s: float = IDLE_TRIM_S, trim: Callable[[], object] = trim_heap):
        self.idle_s = idle_s
        self._trim = trim
        self._worked = False  # work since the last trim

    def worked(self) -> None:
        """The loop did work whose freed memory the next idle spell should hand back."""
        self._worked = True

    def wait(self, sock: zmq.Socket) -> None:
        """Return once `sock` has a message to receive (or right away after an idle trim,
        the receive then blocks as before)."""
        if self._worked and not sock.poll(int(self.idle_s * 1000)):
            self._trim()
            self._worked = False
