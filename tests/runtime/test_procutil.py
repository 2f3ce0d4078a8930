"""A worker the supervisor starts before its config exists waits for the word to read it."""

from __future__ import annotations

import os
import subprocess
import sys

from zllm.runtime.procutil import HELD_ENV

WORKER = "from zllm.runtime.procutil import wait_for_config; wait_for_config(); print('reads')"


def start_worker(held: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != HELD_ENV}
    if held:
        env[HELD_ENV] = "1"
    return subprocess.Popen(
        [sys.executable, "-c", WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )


def test_a_held_worker_reads_its_config_only_after_the_word():
    worker = start_worker(held=True)
    try:
        worker.wait(1.0)
        raise AssertionError("the held worker went on without the word")
    except subprocess.TimeoutExpired:
        pass
    out, _ = worker.communicate(b"go\n", timeout=30)
    assert (worker.returncode, out) == (0, b"reads\n")


def test_a_held_worker_exits_when_the_supervisor_gives_up():
    worker = start_worker(held=True)
    out, _ = worker.communicate(b"", timeout=30)  # stdin closed with no word
    assert worker.returncode == 1 and out == b""


def test_a_worker_not_held_reads_at_once():
    worker = start_worker(held=False)
    out, _ = worker.communicate(timeout=30)
    assert (worker.returncode, out) == (0, b"reads\n")
