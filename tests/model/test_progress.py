"""zllm/model/progress.py: a bar on a terminal, periodic log lines elsewhere, silence for fast jobs.

Time is an injected clock, so every rule is checked exactly and nothing sleeps.
"""

from __future__ import annotations

import io
import logging
import threading

import pytest

from zllm.model.progress import Progress, format_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # bars are cut to the terminal's width


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="zllm.model.progress")
    return caplog


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zllm.model.progress"]


def test_log_lines_each_tenth_of_the_total_after_the_delay(clock: Clock, log) -> None:
    pipe = io.StringIO()
    with Progress("Loading x", total=1000, unit="tensors", stream=pipe, clock=clock) as p:
        for _ in range(8):  # 12.5% every 0.25 s: 5 s never pass between lines
            clock.now += 0.25
            p.advance(125)
    got = lines(log)
    # Nothing within the first second; then a line at each new tenth: 50, 62, 75, 87, 100%.
    assert got[0] == "Loading x: 500/1000 tensors (50%), 500.0 tensors/s, 1.0 s elapsed"
    assert [g.split("(")[1].split("%")[0] for g in got[:-1]] == ["50", "62", "75", "87", "100"]
    assert got[-1] == "Loading x: 1000/1000 tensors, done in 2.0 s"
    assert pipe.getvalue() == ""  # no control characters, nothing but the log


def test_log_line_every_5_s_when_progress_is_slow(clock: Clock, log) -> None:
    with Progress("Fetching", total=200 * 10**6, unit="B", stream=io.StringIO(), clock=clock) as p:
        for _ in range(12):  # 1 MB a second: 0.5% a second, far from the next tenth
            clock.now += 1.0
            p.advance(10**6)
    got = lines(log)
    # Lines at 5 s and 10 s after the last one; the first comes at 5 s from the start.
    assert got[:2] == [
        "Fetching: 5.0/200.0 MB (2%), 1.0 MB/s, 5.0 s elapsed",
        "Fetching: 10.0/200.0 MB (5%), 1.0 MB/s, 10.0 s elapsed",
    ]
    assert got[2] == "Fetching: 12.0/200.0 MB, done in 12.0 s" and len(got) == 3


def test_fast_jobs_print_nothing(clock: Clock, log) -> None:
    term = Terminal()
    for stream in (term, io.StringIO()):
        with Progress("Quick", total=10, stream=stream, clock=clock) as p:
            for _ in range(10):
                clock.now += 0.09  # 0.9 s in all: under the 1 s delay
                p.advance(1)
    assert term.getvalue() == "" and lines(log) == []


def test_a_job_past_the_delay_reports_at_its_end_even_without_updates(clock: Clock, log) -> None:
    term = Terminal()
    with Progress("One step", total=4, stream=term, clock=clock) as p:
        clock.now += 1.5
        p.n = 4  # done in one go, no refresh
    assert term.getvalue().endswith("100%  4/4  2.7 it/s  1.5 s\n")


def test_terminal_bar_redraws_in_place_and_ends_with_a_newline(clock: Clock, log) -> None:
    term = Terminal()
    with Progress("Loading m.gguf", total=98 * 10**6, unit="B", stream=term, clock=clock) as p:
        clock.now += 1.0
        p.advance(49 * 10**6)
        clock.now += 0.05  # too soon to redraw
        p.advance(10**6)
        clock.now += 0.95
        p.advance(48 * 10**6)
    out = term.getvalue()
    draws = out.split("\r")[1:]
    assert len(draws) == 2 + 1  # two redraws, one final
    assert (
        draws[0] == "Loading m.gguf [############............]  50%  49.0/98.0 MB  49.0 MB/s  1.0 s"
    )
    assert draws[-1].rstrip() == (
        "Loading m.gguf [########################] 100%  98.0/98.0 MB  49.0 MB/s  2.0 s"
    )
    assert out.endswith("\n") and out.count("\n") == 1
    assert lines(log) == []  # a terminal gets the bar, not log lines


def test_spinner_without_total_shows_elapsed_time(clock: Clock, log) -> None:
    term = Terminal()
    with Progress("Building", stream=term, clock=clock, tick_s=None) as p:
        for _ in range(3):
            clock.now += 0.6
            p.refresh()  # what the background thread does while the build blocks
    draws = term.getvalue().split("\r")[1:]
    assert draws == ["Building /  1.2 s", "Building -  1.8 s", "Building done  1.8 s\n"]

    pipe = io.StringIO()
    with Progress("Building", stream=pipe, clock=clock, tick_s=None) as p:
        for _ in range(12):
            clock.now += 1.0
            p.refresh()
    assert lines(log) == [
        "Building: 5.0 s elapsed",
        "Building: 10.0 s elapsed",
        "Building: done in 12.0 s",
    ]


def test_failure_ends_the_bar_and_logs_no_done_line(clock: Clock, log) -> None:
    term, pipe = Terminal(), io.StringIO()
    for stream in (term, pipe):
        with (
            pytest.raises(RuntimeError),
            Progress("Job", total=10, stream=stream, clock=clock) as p,
        ):
            clock.now += 2.0
            p.advance(3)
            raise RuntimeError("disk full")
    assert term.getvalue().endswith("30%  3/10  1.5 it/s  2.0 s  failed\n")
    assert lines(log) == ["Job: 3/10 (30%), 1.5 it/s, 2.0 s elapsed"]


def test_watch_reads_progress_from_a_background_thread(log) -> None:
    """The real thread and clock: watch is polled until the job ends, then once more."""
    polled = threading.Event()
    done = {"n": 0}

    def watch() -> int:
        polled.set()
        return done["n"]

    with Progress("Copy", total=8, stream=io.StringIO(), watch=watch, tick_s=0.001) as p:
        assert polled.wait(10)
        done["n"] = 8
    assert p.n == 8


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(37_200_000, 98_000_000) == "37.2/98.0 MB"
    assert format_bytes(900, 2 * 10**9) == "0.0/2.0 GB"
    assert format_bytes(1500) == "1.5 kB"
