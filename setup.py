"""zllm's build: pyproject.toml says everything but one step, compiling the CPU kernels.

`build_cpu_kernels` runs with every build (`pip install -e .`, `pip install .`, a wheel): it
compiles csrc/cpu against the torch installed where zllm goes, so `zllm serve` starts without
a compile. pip builds in an isolated environment without that torch, so the step runs
executor/kernels/cpu_build.py with the same Python outside pip's isolation: the library then
links the torch it will load. Without torch there yet (torch installed in the same pip
command, or not at all), nothing is compiled and the kernels build at first use instead.
A machine that cannot compile them (no C++ compiler, no ninja) fails the install, naming
what is missing; ZLLM_BUILD_CPU_KERNELS=0 skips the step (the kernels then build at first use).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.errors import SetupError

ROOT = Path(__file__).resolve().parent
BUILD_SCRIPT = ROOT / "executor" / "kernels" / "cpu_build.py"
TORCH_ABSENT = 3  # cpu_build.py's exit status when torch is not importable


def _cpu_build() -> ModuleType:
    """executor/kernels/cpu_build.py, loaded by path (zllm is not importable while it builds;
    the module needs nothing but the standard library)."""
    spec = importlib.util.spec_from_file_location("zllm_cpu_build", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildCpuKernels(Command):
    """Compile csrc/cpu into executor/kernels/prebuilt/ (see the module's docstring)."""

    description = "compile the CPU kernels (csrc/cpu) against the installed torch"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False  # setuptools sets it for `pip install -e`
        self.outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        if os.environ.get("ZLLM_BUILD_CPU_KERNELS", "1") == "0":
            print("zllm: ZLLM_BUILD_CPU_KERNELS=0: the CPU kernels will build at first use")
            return
        if platform.machine().lower() not in ("x86_64", "amd64"):
            print(f"zllm: no CPU kernels for {platform.machine()} (they are x86-64 AVX2 code)")
            return
        if self.editable_mode:
            out = ROOT / "executor" / "kernels" / "prebuilt"
        else:
            out = Path(self.build_lib) / "zllm" / "executor" / "kernels" / "prebuilt"
        status = subprocess.call(
            [sys.executable, str(BUILD_SCRIPT), str(ROOT / "csrc"), str(out)],
            env=_cpu_build().outside_pip_isolation(dict(os.environ)),
        )
        if status == TORCH_ABSENT:
            return
        if status != 0:
            raise SetupError(
                "compiling zllm's CPU kernels failed (the reason is above: a C++ compiler "
                "(g++), ninja, or the compiler's own error); ZLLM_BUILD_CPU_KERNELS=0 installs "
                "without them, to build at first use"
            )
        if not self.editable_mode:
            self.outputs = [str(p) for p in out.iterdir()]

    def get_outputs(self) -> list[str]:
        return self.outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class BuildWithKernels(build):
    sub_commands = [*build.sub_commands, ("build_cpu_kernels", None)]


setup(cmdclass={"build": BuildWithKernels, "build_cpu_kernels": BuildCpuKernels})
