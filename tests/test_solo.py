"""tests/solo.py: a solo test waits for the running tests, then runs alone, and tests that
arrive while it waits start only after it. Threads stand in for the xdist workers (flock
locks belong to each open file, so two opens in one process contend as two processes do)."""

from __future__ import annotations

import threading

import solo


class Holder:
    """A thread that takes `solo.running(solo_test)` and holds it until released."""

    def __init__(self, solo_test: bool) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(solo_test,), daemon=True)
        self.thread.start()

    def _run(self, solo_test: bool) -> None:
        with solo.running(solo_test):
            self.entered.set()
            self.release.wait(30)

    def finish(self) -> None:
        self.release.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


WAIT_S = 0.3  # long enough for a thread that could enter to have entered


def test_a_solo_test_runs_alone_and_later_tests_wait_for_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ZLLM_TEST_LOCKS", str(tmp_path))
    first, second = Holder(False), Holder(False)
    assert first.entered.wait(10) and second.entered.wait(10)  # shared: side by side

    alone = Holder(True)
    assert not alone.entered.wait(WAIT_S)  # two tests are running
    late = Holder(False)
    assert not late.entered.wait(WAIT_S)  # the solo test is waiting: no new test starts
    first.finish()
    assert not alone.entered.wait(WAIT_S)  # one is still running
    second.finish()
    assert alone.entered.wait(10)
    assert not late.entered.wait(WAIT_S)  # the solo test runs alone
    alone.finish()
    assert late.entered.wait(10)
    late.finish()


def test_without_the_lock_directory_tests_run_unlocked(monkeypatch) -> None:
    monkeypatch.delenv("ZLLM_TEST_LOCKS", raising=False)
    outer = Holder(True)
    assert outer.entered.wait(10)
    inner = Holder(True)
    assert inner.entered.wait(10)
    inner.finish()
    outer.finish()
