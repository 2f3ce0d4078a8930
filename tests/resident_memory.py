"""A process's resident memory, for the tests that check what sleep mode releases and what
loading weights takes: VmRSS from /proc, and an executor's growth at load measured by
benchmarks/load_memory.py in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_LOAD_MEMORY = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "load_memory.py")


def resident_bytes(pid: str = "self") -> int:
    """Process `pid`'s resident set (VmRSS) in bytes; "self" is this process."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def resident_after_load(model_path: str, quantization: str, *args: str) -> dict:
    """An executor's resident memory before loading weights and after (its own process):
    benchmarks/load_memory.py, the goal's own measurement, with a 64 MiB KV pool."""
    out = subprocess.run(
        [sys.executable, _LOAD_MEMORY, model_path, "--quantization", quantization, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
