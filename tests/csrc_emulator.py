"""The host emulator of csrc/'s CUDA kernels (csrc/emu), for the CPU-only tests: built once
per test run with the C++ compiler (the `emu` fixture, tests/conftest.py), it runs
`KernelLaunch` records as cuLaunchKernel would (tests/test_csrc_compile.py,
tests/test_csrc_prefill.py)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

from zllm.executor.kernels import cuda as ck

CSRC = ck.CSRC_DIR


class Emulator:
    """Runs KernelLaunch records through csrc/emu (arguments as cuLaunchKernel takes them)."""

    def __init__(self, path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.zllm_emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6
        self.lib.zllm_emu_launch.argtypes += [ctypes.c_void_p]
        self.names: list[str] = []

    def run_launches(self, launches: list[ck.KernelLaunch], device=None) -> None:
        for launch in launches:
            values = [np.array([a], dtype=np.asarray(a).dtype) for a in launch.args]
            ptrs = (ctypes.c_void_p * len(values))(*[v.ctypes.data for v in values])
            rc = self.lib.zllm_emu_launch(launch.name.encode(), *launch.grid, *launch.block, ptrs)
            assert rc == 0, f"the emulator was not built with {launch.name}"
            self.names.append(launch.name)


def build_emulator(tmp_path_factory) -> Emulator:
    """The emulator library, compiled into a temporary directory (the `emu` fixture of
    tests/conftest.py); skips without a C++17 compiler."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or clang++) for the kernel emulator")
    out = tmp_path_factory.mktemp("emu") / "emu_kernels.so"
    cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-w", "-o", str(out),
           str(CSRC / "emu" / "emu_kernels.cpp")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "_Float16" in proc.stderr:
        pytest.skip(f"{cxx} lacks _Float16")
    assert proc.returncode == 0, proc.stderr
    return Emulator(out)
