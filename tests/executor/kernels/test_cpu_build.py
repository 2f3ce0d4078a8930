"""The CPU kernels' build: compiled at install (setup.py -> executor/kernels/cpu_build.py), named
after what they were built from, and refused with a clear message where they cannot be."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cpu_build
from zllm.executor.kernels.csrc_dir import CSRC_DIR

ROOT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = ROOT / "executor" / "kernels" / "cpu_build.py"


def test_the_library_name_follows_sources_flags_torch_and_place(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC_DIR / "cpu", csrc / "cpu")
    name = cpu_build.library_name(csrc, "2.13.0")
    assert name.startswith(cpu_build.LIBRARY_PREFIX)
    assert cpu_build.library_name(csrc, "2.13.0") == name
    assert cpu_build.library_name(csrc, "2.11.0") != name  # another torch: another ABI
    assert cpu_build.library_name(csrc, "2.13.0", where=True) != name
    header = csrc / "cpu" / "simd.h"
    header.write_text(header.read_text() + "\n// an edit\n")
    assert cpu_build.library_name(csrc, "2.13.0") != name  # a header counts, not only sources
    edited = cpu_build.library_name(csrc, "2.13.0")
    monkeypatch.setattr(cpu_build, "CFLAGS", (*cpu_build.CFLAGS, "-DZLLM_X"))
    assert cpu_build.library_name(csrc, "2.13.0") != edited


def test_every_translation_unit_is_compiled_and_none_is_native():
    """Each csrc/cpu/*.cpp is listed (a unit left out links as a missing symbol at import), and
    the flags target AVX2, never this machine (a library built here must run on another CPU,
    which picks its AVX-512 variants at run time)."""
    units = {f"cpu/{p.name}" for p in (CSRC_DIR / "cpu").glob("*.cpp")}
    assert units == set(cpu_build.SOURCES)
    assert "-mavx2" in cpu_build.CFLAGS
    assert not any(flag.startswith(("-march", "-mtune")) for flag in cpu_build.CFLAGS)


def test_the_install_built_the_library_the_engine_loads():
    """README's install (torch first, then zllm) compiles the kernels; the engine then loads
    that library and compiles nothing. CI installs so; a checkout whose sources or torch
    changed since its install builds at first use instead."""
    name = cpu_build.library_name(CSRC_DIR, torch.__version__)
    prebuilt = cpu_build.PREBUILT_DIR / f"{name}.so"
    if not prebuilt.exists():
        assert not os.environ.get("CI"), (
            f"CI's install did not compile the CPU kernels ({prebuilt} is missing)"
        )
        pytest.skip("installed before these sources or this torch (pip install -e . rebuilds)")
    assert Path(cpu_kernels.load().__file__) == prebuilt


def _run_build_script(tmp_path: Path, env: dict[str, str], block_torch: bool = False):
    code = (
        "import runpy, sys\n"
        + ("sys.modules['torch'] = None\n" if block_torch else "")
        + f"sys.argv = ['cpu_build.py', {str(CSRC_DIR)!r}, {str(tmp_path / 'out')!r}]\n"
        + f"runpy.run_path({str(BUILD_SCRIPT)!r}, run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_without_torch_the_install_leaves_the_build_to_first_use(tmp_path):
    done = _run_build_script(tmp_path, dict(os.environ), block_torch=True)
    assert done.returncode == 3, done.stderr
    assert "torch is not installed yet" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_missing_compiler_is_an_install_error_naming_it(tmp_path):
    env = {**os.environ, "CXX": "no-such-c++"}
    done = _run_build_script(tmp_path, env)
    assert done.returncode == 1
    assert "'no-such-c++' is not on PATH" in done.stderr
    # Through setup.py: the install fails, saying why and how to install without them.
    done = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_cpu_kernels"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "'no-such-c++' is not on PATH" in done.stderr
    assert "ZLLM_BUILD_CPU_KERNELS=0" in done.stderr
    skipped = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_cpu_kernels"],
        cwd=ROOT,
        env={**env, "ZLLM_BUILD_CPU_KERNELS": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert skipped.returncode == 0, skipped.stderr
    assert "will build at first use" in skipped.stdout


def test_the_build_runs_outside_pip_s_isolation():
    """pip hides the installed packages from a build (a sitecustomize on PYTHONPATH, user site
    off); the build step undoes that, so it compiles against the torch zllm will run with, and
    keeps PATH (where the build requirements put ninja). Anything else is left as it is."""
    pip_env = {
        "PATH": "/tmp/pip-build-env-x/overlay/bin:/usr/bin",
        "PYTHONPATH": "/tmp/pip-build-env-x/site",
        "PYTHONNOUSERSITE": "1",
        "CXX": "g++",
    }
    assert cpu_build.outside_pip_isolation(pip_env) == {
        "PATH": "/tmp/pip-build-env-x/overlay/bin:/usr/bin",
        "CXX": "g++",
    }
    own = {"PATH": "/usr/bin", "PYTHONPATH": "/home/me/lib", "PYTHONNOUSERSITE": "1"}
    assert cpu_build.outside_pip_isolation(own) == own


def test_a_library_moved_with_new_file_times_is_still_the_finished_build(tmp_path):
    """A wheel's installer writes the install-built library anew (new times): its stamp is the
    content's digest, so it still loads; a library whose bytes changed does not."""
    built = Path(cpu_kernels.load().__file__)
    copy = tmp_path / built.name
    copy.write_bytes(built.read_bytes())
    cpu_build.write_stamp(copy)
    os.utime(copy, (1_000_000_000, 1_000_000_000))
    assert cpu_build.import_built(built.stem, copy) is not None
    changed = tmp_path / "zllm_cpu_kernels_changed.so"
    changed.write_bytes(built.read_bytes())
    cpu_build.write_stamp(changed)
    data = bytearray(changed.read_bytes())
    data[-1] ^= 0xFF
    changed.write_bytes(bytes(data))
    assert cpu_build.import_built("zllm_cpu_kernels_changed", changed) is None
