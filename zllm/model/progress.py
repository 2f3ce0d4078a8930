"""Progress of the long waits: fetching a model, loading its weights, building the kernels.

No torch and no tqdm here (the model cache and the loader both use it; tqdm cannot log to
`logging`). Two ways to report, chosen by where stderr goes:

- a terminal: one bar, redrawn in place, ended with a newline

      Loading model.gguf [#########...............]  38%  37.2/98.0 MB  41.0 MB/s  0.9 s

- anything else (a server's log, a pipe): a line through `logging` each time another 10% is
  done or 5 s have passed, whichever comes first, so logs show progress without control
  characters

      Loading model.gguf: 37.2/98.0 MB (38%), 41.0 MB/s, 0.9 s elapsed

A job that ends within `delay_s` shows nothing at all. A job without a total (a compile, a
pip download) shows a spinner and the elapsed time; since its caller blocks in one call, a
background thread keeps it moving. So does `watch`, which reads how far a job has got that
cannot report it (a file growing while another function copies it).

    with Progress("Loading model.gguf", total=nbytes, unit="B") as progress:
        for tensor in tensors:
            ...
            progress.advance(tensor.nbytes)
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

_logger = logging.getLogger(__name__)

DELAY_S = 1.0  # jobs shorter than this print nothing
LOG_EVERY_S = 5.0  # without a terminal: a line at least this often...
LOG_STEPS = 10  # ...and each time another 1/LOG_STEPS of the total is done
REDRAW_S = 0.1  # a terminal bar is redrawn at most this often (and a spinner turns this fast)
BAR_WIDTH = 24
SPINNER = "|/-\\"


class Progress:
    """A context-managed progress report: `advance` as work is done, or let `watch` say."""

    def __init__(
        self,
        description: str,
        total: int | None = None,
        *,
        unit: str = "",
        watch: Callable[[], int] | None = None,
        stream: TextIO | None = None,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        delay_s: float = DELAY_S,
        log_every_s: float = LOG_EVERY_S,
        tick_s: float | None = REDRAW_S,
    ) -> None:
        """`unit` "B" shows bytes (kB, MB, GB); any other is printed after the counts.
        `tick_s` None: no background thread (the owner calls `refresh`), for tests."""
        self.description = description
        self.total = total if total is None or total > 0 else None
        self.unit = unit
        self.n = 0
        self._watch = watch
        self._stream = sys.stderr if stream is None else stream
        self._tty = _isatty(self._stream)
        self._logger = _logger if logger is None else logger
        self._clock = clock
        self._delay_s = delay_s
        self._log_every_s = log_every_s
        self._tick_s = tick_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0
        self._shown = False  # anything drawn or logged yet
        self._last_output = 0.0  # clock of the last redraw or log line
        self._logged_step = 0  # tenths (LOG_STEPS) of the total already logged
        self._drawn_width = 0
        self._frame = 0

    # -- the owner's side ------------------------------------------------------------------

    def __enter__(self) -> Progress:
        self._start = self._last_output = self._clock()
        if self._tick_s and (self.total is None or self._watch is not None):
            self._thread = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._poll_watch()
        with self._lock:
            self._finish(failed=exc_type is not None)

    def advance(self, n: int) -> None:
        """`n` more units done."""
        self.n += n
        self.refresh()

    def refresh(self) -> None:
        """Redraw or log if it is time to (the background thread calls this too)."""
        with self._lock:
            now = self._clock()
            if now - self._start < self._delay_s:
                return
            if self._tty:
                if not self._shown or now - self._last_output >= REDRAW_S:
                    self._draw(now)
            elif self._log_due(now):
                self._log(now, self._progress_text(now))

    # -- deciding when -----------------------------------------------------------------------

    def _tick(self) -> None:
        while not self._stop.wait(self._tick_s):
            self._poll_watch()
            self.refresh()

    def _poll_watch(self) -> None:
        if self._watch is None:
            return
        try:
            self.n = self._watch()
        except OSError:  # e.g. the watched file is not created yet
            pass

    def _step(self) -> int:
        """How many tenths (LOG_STEPS) of the total are done."""
        return 0 if self.total is None else int(min(self.n / self.total, 1.0) * LOG_STEPS)

    def _log_due(self, now: float) -> bool:
        return self._step() > self._logged_step or now - self._last_output >= self._log_every_s

    def _finish(self, failed: bool) -> None:
        now = self._clock()
        if not self._shown and now - self._start < self._delay_s:
            return  # a fast job: nothing to say
        if self._tty:
            self._draw(now, final="failed" if failed else "done")
            self._stream.write("\n")
            self._stream.flush()
        elif not failed:  # a failure is reported by whoever catches it
            amount = "" if self.total is None else f"{self._amount()}, "
            self._log(now, f"{amount}done in {now - self._start:.1f} s")

    # -- drawing and logging -------------------------------------------------------------------

    def _log(self, now: float, text: str) -> None:
        self._logger.info("%s: %s", self.description, text)
        self._shown, self._last_output, self._logged_step = True, now, self._step()

    def _progress_text(self, now: float) -> str:
        elapsed = f"{now - self._start:.1f} s elapsed"
        if self.total is None:
            return elapsed if self.n == 0 else f"{self._amount()}, {elapsed}"
        return f"{self._amount()} ({self._percent()}%), {self._rate(now)}, {elapsed}"

    def _draw(self, now: float, final: str | None = None) -> None:
        elapsed = f"{now - self._start:.1f} s"
        if self.total is None:
            self._frame += 1
            mark = final or SPINNER[self._frame % len(SPINNER)]
            amount = "" if self.n == 0 else f"  {self._amount()}"
            line = f"{self.description} {mark}{amount}  {elapsed}"
        else:
            filled = int(BAR_WIDTH * min(self.n / self.total, 1.0))
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            line = (
                f"{self.description} [{bar}] {self._percent():>3}%  {self._amount()}  "
                f"{self._rate(now)}  {elapsed}" + (f"  {final}" if final == "failed" else "")
            )
        line = line[: max(_terminal_width() - 1, 20)]
        # Pad over the previous, longer line rather than use an erase sequence.
        self._stream.write("\r" + line.ljust(self._drawn_width))
        self._stream.flush()
        self._drawn_width = len(line)
        self._shown, self._last_output = True, now

    def _percent(self) -> int:
        return 0 if self.total is None else int(100 * min(self.n / self.total, 1.0))

    def _amount(self) -> str:
        if self.unit == "B":
            return format_bytes(self.n, self.total)
        unit = f" {self.unit}" if self.unit else ""
        return f"{self.n}{unit}" if self.total is None else f"{self.n}/{self.total}{unit}"

    def _rate(self, now: float) -> str:
        per_s = self.n / max(now - self._start, 1e-9)
        if self.unit == "B":
            return f"{format_bytes(int(per_s))}/s"
        return f"{per_s:.1f} {self.unit or 'it'}/s"


_BYTE_UNITS = ((10**9, "GB"), (10**6, "MB"), (10**3, "kB"))


def format_bytes(n: int, total: int | None = None) -> str:
    """`n` bytes, or `n/total` bytes, in the unit that suits the larger: "37.2/98.0 MB"."""
    scale, name = next(((s, u) for s, u in _BYTE_UNITS if max(n, total or 0) >= s), (1, "B"))
    decimals = 0 if scale == 1 else 1
    text = f"{n / scale:.{decimals}f}"
    if total is not None:
        text += f"/{total / scale:.{decimals}f}"
    return f"{text} {name}"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _terminal_width() -> int:
    return shutil.get_terminal_size((100, 24)).columns
