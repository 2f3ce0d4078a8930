"""What an installed (non-editable) zllm carries: every room of the process folders as a
package, and the kernel sources, which are compiled at run time: pyproject maps csrc/ to the
zllm.csrc package and ships them as package data."""

import fnmatch
from pathlib import Path

import pytest

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cpu_build
from zllm.executor.kernels import cuda as cuda_kernels

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_source_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["zllm.csrc"] == "csrc"
    assert "zllm.csrc" in config["packages"]
    globs = config["package-data"]["zllm.csrc"]
    needed = [f"cpu/{p.name}" for p in cpu_build.kernel_files(ROOT / "csrc")]
    needed += [cuda_kernels.COMMON_HEADER]
    needed += [p.name for p in (ROOT / "csrc").glob("*.cu")]
    needed += [f"emu/{p.name}" for p in (ROOT / "csrc" / "emu").iterdir()]
    for name in needed:
        assert (ROOT / "csrc" / name).is_file(), name
        assert any(fnmatch.fnmatch(name, g) for g in globs), f"{name} would not be installed"


def test_kernel_modules_find_csrc_beside_the_package_both_ways():
    # Repository: executor/kernels/cpu.py -> <repo>/csrc. Installed: zllm/executor/... ->
    # zllm/csrc, where package-dir puts it. Same expression, parents[2] / "csrc".
    # One definition (executor/kernels/csrc_dir.py) that both kernel modules use.
    assert cpu_kernels.CSRC_DIR is cuda_kernels.CSRC_DIR
    here = Path(cpu_kernels.__file__).resolve()
    assert cpu_kernels.CSRC_DIR == here.parents[2] / "csrc"
    assert (cpu_kernels.CSRC_DIR / "cpu" / "ops.cpp").is_file()


def test_every_room_is_a_listed_package():
    """A folder with an __init__.py under a mapped folder is a package pyproject must list, or
    a wheel would install without it (the editable install used in development finds it
    anyway, so nothing else would notice)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    missing = []
    for package, folder in config["package-dir"].items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder).parts
            name = ".".join((package, *rel))
            if name not in listed:
                missing.append(name)
    assert not missing, f"packages missing from pyproject.toml: {missing}"
