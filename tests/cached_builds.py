"""Something a test run builds once and keeps in $ZLLM_CACHE (the kernel emulator, transformers'
copy of a GGUF model): the first worker builds it under a lock, the run's other workers wait
for that build, and later runs find it."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def built_once(out: Path, scratch: Path, build: Callable[[Path], None]) -> Path:
    """`out` (a file or a directory), made by `build(path)` at `scratch` and moved in whole
    if it is not there yet; one build at a time per folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            build(scratch)
            partial = out.with_suffix(".tmp")
            if scratch.is_dir():
                shutil.copytree(scratch, partial, dirs_exist_ok=True)
            else:
                shutil.copyfile(scratch, partial)
            os.replace(partial, out)  # whole, or not there
    return out
