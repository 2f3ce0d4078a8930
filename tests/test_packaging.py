"""The kernel sources are compiled at run time, so an installed (non-editable) zllm must carry
them: pyproject maps csrc/ to the zllm.csrc package and ships them as package data."""

import fnmatch
from pathlib import Path

import pytest

from zllm.executor import cpu_kernels, cuda_kernels

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_source_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["zllm.csrc"] == "csrc"
    assert "zllm.csrc" in config["packages"]
    globs = config["package-data"]["zllm.csrc"]
    needed = list(cpu_kernels.KERNEL_FILES) + [cuda_kernels.COMMON_HEADER]
    needed += [p.name for p in (ROOT / "csrc").glob("*.cu")]
    needed += [f"emu/{p.name}" for p in (ROOT / "csrc" / "emu").iterdir()]
    for name in needed:
        assert (ROOT / "csrc" / name).is_file(), name
        assert any(fnmatch.fnmatch(name, g) for g in globs), f"{name} would not be installed"


def test_kernel_modules_find_csrc_beside_the_package_both_ways():
    # Repository: executor/cpu_kernels.py -> <repo>/csrc. Installed: zllm/executor/... ->
    # zllm/csrc, where package-dir puts it. Same expression, parents[1] / "csrc".
    # One definition (executor/csrc_dir.py) that both kernel modules use.
    assert cpu_kernels.CSRC_DIR is cuda_kernels.CSRC_DIR
    here = Path(cpu_kernels.__file__).resolve()
    assert cpu_kernels.CSRC_DIR == here.parents[1] / "csrc"
    assert (cpu_kernels.CSRC_DIR / "cpu" / "ops.cpp").is_file()
