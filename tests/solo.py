"""Tests that run with no other test beside them (`pytest.mark.solo`): those whose assertions
compare timings taken at different moments (a tenant's latency alone, then under a flood),
which the other xdist worker's load would skew.

Every test holds a lock while it runs: shared for most, exclusive for a solo test. A second
lock, the turnstile, is taken on the way in, so a solo test waiting for the running tests to
end keeps new ones from starting (without it, the other worker's next test could take its
shared lock first, again and again). The locks are files in a directory the controller makes
and names to its workers in the environment; a run without workers takes them uncontended.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

_ENV = "ZLLM_TEST_LOCKS"
_made: str | None = None  # the directory this process made (the controller's)


def create() -> None:
    """In the controller, before it starts its workers (they inherit the environment)."""
    global _made
    if _ENV not in os.environ:
        _made = os.environ[_ENV] = tempfile.mkdtemp(prefix="zllm-test-locks-")


def remove() -> None:
    global _made
    if _made is not None:
        shutil.rmtree(_made, ignore_errors=True)
        os.environ.pop(_ENV, None)
        _made = None


@contextmanager
def running(solo: bool) -> Iterator[None]:
    """Hold the test's lock while it runs (its setup and teardown included)."""
    directory = os.environ.get(_ENV)
    if not directory:
        yield
        return
    with (
        open(os.path.join(directory, "turnstile"), "a") as turnstile,
        open(os.path.join(directory, "tests"), "a") as tests,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(tests, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        if not solo:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # both locks go with the files' close
