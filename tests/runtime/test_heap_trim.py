"""The executor hands the heap memory its steps freed back to the system once it is idle
(zllm/runtime/heap_trim.py, issue 56): glibc keeps a freed block's pages once its mmap
threshold has risen past the block's size, and `trim_heap` returns them; the step loop
trims once after each spell of steps, when a second passes without the next one."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from zllm.executor.launched_step import LaunchedStep
from zllm.executor.ranks import processes
from zllm.protocol import ModelRunnerOutput, SchedulerOutput
from zllm.runtime.heap_trim import IdleTrim, trim_heap

# In a fresh process (its heap in a known state): a freed 4 MiB block raises glibc's mmap
# threshold, as a step's first large tensor does; 33 blocks of 1 MiB then come from the heap,
# 32 are freed below the last one (still in use, so the heap's top cannot shrink), and their
# pages stay resident until trim_heap hands them back. Prints the anonymous KiB after the
# frees and after the trim.
HEAP_SCRIPT = """
import ctypes
from zllm.bench.process_memory import process_memory
from zllm.runtime.heap_trim import trim_heap

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
MIB = 1 << 20
libc.free(libc.malloc(4 * MIB))
before = process_memory().anon_kib
blocks = [libc.malloc(MIB) for _ in range(33)]
for block in blocks:
    ctypes.memset(block, 1, MIB)
for block in blocks[:32]:
    libc.free(block)
freed = process_memory().anon_kib
assert trim_heap()
print(before, freed, process_memory().anon_kib)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_trim_heap_hands_back_pages_the_heap_kept():
    result = subprocess.run(
        [sys.executable, "-c", HEAP_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    before, freed, trimmed = map(int, result.stdout.split())
    assert freed - before > 24 << 10, "glibc returned the freed blocks itself"
    assert freed - trimmed > 24 << 10, f"{before=} {freed=} {trimmed=} KiB"


def test_trim_heap_is_harmless_to_call_often():
    for _ in range(3):
        assert trim_heap() is sys.platform.startswith("linux")


@pytest.fixture
def pair():
    ctx = zmq.Context()
    receiver, sender = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    receiver.bind("inproc://idle-trim")
    sender.connect("inproc://idle-trim")
    yield receiver, sender
    ctx.destroy(linger=0)


def test_idle_trim_trims_once_after_work_when_no_message_comes(pair):
    receiver, sender = pair
    trims: list[float] = []
    idle = IdleTrim(idle_s=0.05, trim=lambda: trims.append(time.monotonic()))
    start = time.monotonic()
    idle.wait(receiver)  # no work yet: nothing to hand back, no wait
    assert trims == [] and time.monotonic() - start < 0.04
    idle.worked()
    idle.wait(receiver)
    assert len(trims) == 1 and trims[0] - start >= 0.05
    idle.wait(receiver)  # still idle: trimmed already
    assert len(trims) == 1
    idle.worked()
    sender.send(b"next step")
    idle.wait(receiver)  # a message is waiting: no trim between busy steps
    assert len(trims) == 1
    assert receiver.recv() == b"next step"


class _FakeRunner:
    """What serve_steps asks of a ModelRunner: each step answered with an empty output."""

    config = SimpleNamespace(async_executor=False)
    can_overlap_steps = False

    def launch(self, so: SchedulerOutput, pending: object = None) -> LaunchedStep:
        output = ModelRunnerOutput(step_id=so.step_id, req_ids=[], sampled_token_ids=[])
        return LaunchedStep(so, step_start=time.perf_counter(), output=output)

    def finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        assert launched.output is not None
        return launched.output


def test_executor_step_loop_trims_after_its_steps_once_idle(monkeypatch):
    trims: list[int] = []
    monkeypatch.setattr(
        processes, "IdleTrim", lambda: IdleTrim(idle_s=0.2, trim=lambda: trims.append(1))
    )
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind("inproc://steps-in")
    outbox.bind("inproc://steps-out")
    to_executor, from_executor = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_executor.connect("inproc://steps-in")
    from_executor.connect("inproc://steps-out")

    def serve() -> None:
        try:
            processes.serve_steps(_FakeRunner(), inbox, outbox=outbox)
        except zmq.ContextTerminated:  # the test is over: close its sockets in its thread
            inbox.close(linger=0)
            outbox.close(linger=0)

    threading.Thread(target=serve, daemon=True).start()
    decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
    try:
        time.sleep(0.3)
        assert trims == [], "no step ran yet: nothing to hand back"
        for step_id in range(3):  # steps back to back: no trim between them
            step = SchedulerOutput(step_id, [], [], {}, 0)
            to_executor.send(msgspec.msgpack.encode(step))
            assert from_executor.poll(5000)
            assert decoder.decode(from_executor.recv()).step_id == step_id
        assert trims == []
        deadline = time.monotonic() + 5
        while not trims and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        assert trims == [1], "one trim once idle, and only one"
    finally:
        to_executor.close(linger=0)
        from_executor.close(linger=0)
        ctx.term()  # (the loop's receive raises ContextTerminated; term waits for its close)
