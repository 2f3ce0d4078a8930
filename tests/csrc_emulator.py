"""The host emulator of csrc/'s CUDA kernels (csrc/emu), for the CPU-only tests: built with
the C++ compiler once per version of csrc/ (the `emu` fixture, tests/conftest.py), it runs
`KernelLaunch` records as cuLaunchKernel would (tests/executor/kernels/test_csrc_*.py)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess

import numpy as np
import pytest
from cached_builds import built_once

from zllm.executor.kernels import cuda as ck
from zllm.model.files import cache_dir

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
    """The emulator library (the `emu` fixture of tests/conftest.py); skips without a C++17
    compiler. Compiling it takes ~14 CPU-seconds, so the library is kept in $ZLLM_CACHE
    under a digest of what makes it (csrc's sources, the compiler and its flags), as torch
    keeps csrc/cpu's build: a run builds it once, its other workers wait for that build (a
    lock), and later runs of the same sources build nothing."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or clang++) for the kernel emulator")
    source = CSRC / "emu" / "emu_kernels.cpp"
    flags = ["-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-w"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([cxx, version, *flags]).encode())
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(CSRC)).encode() + b"\0" + path.read_bytes())
    out = cache_dir() / "test-emulator" / f"emu_kernels-{digest.hexdigest()[:16]}.so"

    def compile_to(built) -> None:
        cmd = [cxx, *flags, "-o", str(built), str(source)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 and "_Float16" in proc.stderr:
            pytest.skip(f"{cxx} lacks _Float16")
        assert proc.returncode == 0, proc.stderr

    return Emulator(built_once(out, tmp_path_factory.mktemp("emu") / out.name, compile_to))
