"""The agent programs people run, at pinned versions, for tests/frontend/test_agent_clients.py:
OpenAI's Codex CLI and Anthropic's Claude Code from npm, aider from PyPI (in a virtual
environment of its own: it pins its own openai and litellm), installed once per machine into a
cache outside the repository ($ZLLM_TEST_NPM, default ~/.cache/zllm-test-npm), under a lock
(the suite's xdist workers). Their telemetry and update checks are off in every environment
`env_for` gives them; they reach nothing beyond the loopback server."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# name -> (npm package, pinned version, executable)
CLIS = {
    "codex": ("@openai/codex", "0.171.0", "codex"),
    "claude": ("@anthropic-ai/claude-code", "2.1.197", "claude"),
}


# name -> (PyPI package, pinned version, executable), each in its own virtual environment
PIP_CLIS = {"aider": ("aider-chat", "0.86.2", "aider")}


class CliUnavailable(RuntimeError):
    """npm is missing, or the install failed (the message says which)."""


def cache_dir() -> Path:
    return Path(os.environ.get("ZLLM_TEST_NPM") or "~/.cache/zllm-test-npm").expanduser()


def cli(name: str) -> Path:
    """The executable of `name` (CLIS or PIP_CLIS), installed first if it is not at its
    pinned version."""
    if name in PIP_CLIS:
        return _pip_cli(name)
    package, version, exe = CLIS[name]
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed_version(root, package) != version:
            npm = shutil.which("npm")
            if npm is None:
                raise CliUnavailable("npm is not installed (apt-get install nodejs npm)")
            done = subprocess.run(
                [npm, "install", "--prefix", str(root), "--no-audit", "--no-fund",
                 "--loglevel=error", f"{package}@{version}"],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            if done.returncode != 0:
                raise CliUnavailable(f"npm install {package}@{version} failed:\n{done.stderr}")
    return root / "node_modules" / ".bin" / exe


def _pip_cli(name: str) -> Path:
    package, version, exe = PIP_CLIS[name]
    root = cache_dir()
    venv = root / f"{name}-{version}"
    executable = venv / "bin" / exe
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not executable.exists():
            shutil.rmtree(venv, ignore_errors=True)
            steps = [
                [sys.executable, "-m", "venv", str(venv)],
                [str(venv / "bin" / "pip"), "install", "-q", f"{package}=={version}"],
            ]
            for step in steps:
                done = subprocess.run(step, capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    shutil.rmtree(venv, ignore_errors=True)
                    raise CliUnavailable(f"{' '.join(step[:4])} failed:\n{done.stderr[-3000:]}")
    return executable


def _installed_version(root: Path, package: str) -> str | None:
    try:
        manifest = root / "node_modules" / package / "package.json"
        return json.loads(manifest.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def env_for(home: Path, **extra: str) -> dict[str, str]:
    """An environment for a CLI run: its own HOME (no user's settings or sessions), no
    telemetry, error reports or update checks, no proxy."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(
        HOME=str(home),
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        NO_UPDATE_NOTIFIER="1",
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # aider's litellm: no price list from GitHub
    )
    env.update(extra)
    return env
