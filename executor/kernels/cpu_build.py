"""Building csrc/cpu into the library executor/kernels/cpu.py loads: at install, or at first use.

One recipe, two callers:

- **install**: setup.py's `build_cpu_kernels` step (`pip install -e .`, a wheel build) runs
  this file as a script with the Python that will run zllm, so the library links the very
  torch it will load. It lands in executor/kernels/prebuilt/ (zllm/executor/kernels/prebuilt/
  in a wheel) under a name that says what it was built from.
- **first use**: cpu.py's load(), when no prebuilt library has that name (a header edited
  since, another torch, an install without torch yet), builds into torch's extensions cache.

The library is named after the kernel files' content, the compiler flags and torch's version,
so a name found is exactly this build. Translation units (csrc/cpu/*.cpp) compile in parallel,
each with the few ATen headers it needs (csrc/cpu/aten_lite.h); ops.cpp alone parses pybind11.

Nothing but the standard library is imported here at module level: setup.py loads this file
where torch may not be installed yet.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

# The translation units, the longest first: ninja starts them in this order, so the two cores
# of a small machine are not left with the longest one alone at the end.
SOURCES = (
    "cpu/gguf_linear.cpp",
    "cpu/gguf_int8.cpp",
    "cpu/decode_stack.cpp",
    "cpu/ops.cpp",
    "cpu/paged_attention.cpp",
    "cpu/moe_experts.cpp",
    "cpu/row_ops.cpp",
    "cpu/dense_rows.cpp",
    "cpu/state_layers.cpp",
    "cpu/gguf_gemm.cpp",
)
# AVX2 for the whole library, so it runs on every CPU cpu.py's cpu_supports_kernels admits;
# functions with an AVX-512 VNNI variant compile it per function and choose at run time
# (csrc/cpu/cpu_isa.h): one build serves both ISAs, and a library built on one machine runs
# on another. Never -march=native.
# -ffp-contract=off: dequantization must compute d*q + m with two roundings, as gguf.quants
# does, so the kernel's weights equal the fp32 reference weights bit for bit.
# -fvisibility=hidden: the units call each other's kernels (and the weak copies of shared
# templates) directly, not through the PLT as interposable symbols; without it the float
# kernel's panel path ran 3-8% slower split than as one unit (BENCHMARKS.md). Only the
# module's init function is exported (pybind11 marks it so).
CFLAGS = (
    "-O3",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-ffp-contract=off",
    "-fopenmp",
    "-fvisibility=hidden",
)
LDFLAGS = ("-fopenmp",)

PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
LIBRARY_PREFIX = "zllm_cpu_kernels_"


class BuildError(RuntimeError):
    """The kernels cannot be built here; the message names what is missing."""


def kernel_files(csrc_dir: Path) -> list[Path]:
    """Every file the library is compiled from (sources and the headers they include)."""
    cpu = csrc_dir / "cpu"
    return sorted([*cpu.glob("*.h"), *cpu.glob("*.cpp")])


def library_name(csrc_dir: Path, torch_version: str, *, where: bool = False) -> str:
    """The library's module name: a digest of the kernel files' content, the flags and torch's
    version. `where` adds the sources' location: torch's loader rebuilds a cached library
    whose include paths changed, so two checkouts sharing the cache each need their own name
    (or each start would rebuild the other's)."""
    digest = hashlib.sha256()
    if where:
        digest.update(str(csrc_dir.resolve()).encode() + b"\0")
    digest.update(" ".join((*SOURCES, *CFLAGS, "|", *LDFLAGS, "|", torch_version)).encode())
    for path in kernel_files(csrc_dir):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return LIBRARY_PREFIX + digest.hexdigest()[:12]


def check_toolchain() -> None:
    """Raise BuildError naming what a build lacks: a C++ compiler or ninja."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BuildError(
            f"the CPU kernels need a C++ compiler ({compiler!r} is not on PATH; set $CXX or "
            "install one: apt-get install g++)"
        )
    if shutil.which("ninja") is None:
        raise BuildError("the CPU kernels need ninja (pip install ninja)")


def stamp(library: Path) -> Path:
    """Written once a build's library is complete: a link killed midway leaves a file that can
    crash the process loading it, and no stamp."""
    return library.with_suffix(".built")


def write_stamp(library: Path) -> None:
    """Mark a complete library as such: its content's digest, so a file cut short (or written
    over) no longer matches, and a copy does (a wheel's installer gives files new times)."""
    stamp(library).write_text(_identity(library))


def _identity(library: Path) -> str:
    return hashlib.sha256(library.read_bytes()).hexdigest()  # ~2 ms for the 1.4 MB library


def import_built(name: str, library: Path) -> ModuleType | None:
    """The library a finished build left under this name, imported directly (torch's loader
    would first run ninja to check it is up to date: a third of a second of every start, and
    the name already says what it was built from). None when there is none, its stamp does
    not match, or it does not import."""
    try:
        if stamp(library).read_text() != _identity(library):
            return None
    except OSError:  # no library, or no stamp
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


def build(
    name: str,
    build_dir: Path,
    csrc_dir: Path,
    *,
    on_compiled: Callable[[str, int, int], None] | None = None,
) -> ModuleType:
    """Compile and link the library `name` in build_dir (ninja, a job per core), stamp it and
    import it. on_compiled(source, done, total) is called as each translation unit finishes."""
    check_toolchain()
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # (Every one there is: an older checkout's csrc, which benchmarks/kernel_ab.py builds beside
    # this one, had ops.cpp alone.)
    sources = [str(csrc_dir / s) for s in SOURCES if (csrc_dir / s).exists()]
    done = threading.Event()
    watcher = None
    if on_compiled is not None:
        watcher = threading.Thread(
            target=_watch_objects, args=(build_dir, on_compiled, done), daemon=True
        )
        watcher.start()
    try:
        module = cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            verbose=False,
        )
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    write_stamp(build_dir / f"{name}.so")
    return module


def _watch_objects(
    build_dir: Path, on_compiled: Callable[[str, int, int], None], done: threading.Event
) -> None:
    """Report each object file that appears (or is rewritten) after the build started."""
    start = time.time()
    objects = {Path(s).stem + ".o": Path(s).name for s in SOURCES}
    seen: set[str] = set()
    while True:
        finished = done.wait(0.5)
        for obj, source in objects.items():
            if obj in seen:
                continue
            try:
                fresh = (build_dir / obj).stat().st_mtime >= start - 1
            except OSError:
                continue
            if fresh:
                seen.add(obj)
                on_compiled(source, len(seen), len(objects))
        if finished:
            return


def outside_pip_isolation(env: dict[str, str]) -> dict[str, str]:
    """The environment without pip's build isolation: pip hides the installed packages through
    a sitecustomize on PYTHONPATH (and PYTHONNOUSERSITE); its build tools stay on PATH (ninja
    comes from the build requirements)."""
    if "pip-build-env" not in env.get("PYTHONPATH", ""):
        return env
    return {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}


def _tty_and_stderr() -> Callable[[str], None]:
    """Lines to stderr, and to the terminal when stderr is captured: pip shows a build's
    output only with -v, and a compile of a minute with nothing on screen looks hung."""
    terminal = None
    if not sys.stderr.isatty():
        try:
            terminal = open("/dev/tty", "w")  # noqa: SIM115 (kept for the build's length)
        except OSError:
            terminal = None

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        if terminal is not None:
            terminal.write(line + "\n")
            terminal.flush()

    return say


def main(argv: list[str]) -> int:
    """`python cpu_build.py CSRC_DIR OUT_DIR`: the install-time build. Exit 0 built, 3 when torch
    is not importable (the kernels then build at first use), 1 on a failed build."""
    csrc_dir, out_dir = Path(argv[0]), Path(argv[1])
    say = _tty_and_stderr()
    try:
        import torch
    except ImportError:
        say(
            "zllm: torch is not installed yet, so the CPU kernels will be compiled at first "
            "use; install torch before zllm to compile them now"
        )
        return 3
    name = library_name(csrc_dir, torch.__version__)
    begin = time.monotonic()
    say(
        f"zllm: compiling the CPU kernels (csrc/cpu, {len(SOURCES)} files, once) for torch "
        f"{torch.__version__}"
    )

    def compiled(source: str, count: int, total: int) -> None:
        say(f"zllm: [{count}/{total}] {source} ({time.monotonic() - begin:.0f} s)")

    # Objects and ninja's files stay out of the package (a wheel would carry them).
    with tempfile.TemporaryDirectory(prefix="zllm-cpu-build-") as scratch:
        try:
            build(name, Path(scratch), csrc_dir, on_compiled=compiled)
        except Exception as exc:  # BuildError, or the compiler's own error through torch
            say(f"zllm: compiling the CPU kernels failed: {exc}")
            return 1
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob(f"{LIBRARY_PREFIX}*"):  # an earlier install's (another torch)
            old.unlink()
        shutil.copy2(Path(scratch) / f"{name}.so", out_dir / f"{name}.so")
    library = out_dir / f"{name}.so"
    write_stamp(library)
    say(f"zllm: CPU kernels built in {time.monotonic() - begin:.0f} s: {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
