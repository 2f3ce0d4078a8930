"""`zllm serve` as an operator runs it: a real supervisor process and its children."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from servers import alive, children_of, free_port


class Server:
    def __init__(self, model_dir: str, *extra: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "zllm.cli",
                "serve",
                model_dir,
                "--port",
                str(self.port),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "\n".join(self.lines)
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("server did not become healthy:\n" + "\n".join(self.lines))
        self.run_dir = next(
            m.group(1) for line in self.lines if (m := re.search(r"config in (\S+)", line))
        )

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.parametrize("in_flight", [False, True])
def test_sigterm_drains_and_leaves_nothing_behind(tiny_llama_dir, in_flight):
    server = Server(tiny_llama_dir, "--drain-timeout", "5", "--tokenizer-workers", "2")
    try:
        kids = children_of(server.proc.pid)
        assert len(kids) == 6  # executor, core, 2 tokenizers, 1 detokenizer, frontend
        assert os.path.isdir(server.run_dir)
        assert oct(os.stat(server.run_dir).st_mode & 0o777) == "0o700"
        assert any(name.endswith("_in") for name in os.listdir(server.run_dir))
        result = {}

        def stream():
            body = {"prompt": "The quick", "max_tokens": 200, "stream": True, "ignore_eos": True}
            text = ""
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    text += line + "\n"
            result["text"] = text

        if in_flight:
            t = threading.Thread(target=stream)
            t.start()
            time.sleep(0.3)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=30)
        elapsed = time.monotonic() - start
        assert code == 0
        assert elapsed < 5 + 5  # drain timeout plus the other children's stop
        if in_flight:
            t.join(10)
            # The in-flight stream either finished or ended with an error event: no hang.
            assert "[DONE]" in result["text"] or "error" in result["text"]
        assert not [k for k in kids if alive(k)]
        assert not os.path.exists(server.run_dir)  # no stale socket files
    finally:
        server.kill()


def test_on_engine_failure_exit(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--on-engine-failure", "exit")
    try:
        kids = children_of(server.proc.pid)
        core = next(k for k in kids if open(f"/proc/{k}/cmdline").read().startswith("zllm: core"))
        os.kill(core, signal.SIGKILL)
        assert server.proc.wait(timeout=30) != 0
        assert not [k for k in kids if alive(k)]
    finally:
        server.kill()


def test_stuck_executor_is_treated_as_dead(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--executor-timeout", "2")
    try:
        kids = children_of(server.proc.pid)
        executor = next(
            k for k in kids if open(f"/proc/{k}/cmdline").read().startswith("zllm: executor")
        )
        os.kill(executor, signal.SIGSTOP)  # hangs mid-service, like a wedged kernel
        body = {"prompt": "The quick", "max_tokens": 50}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"]
        # The engine comes back by itself and serves again.
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/health", timeout=2).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 50
        assert not alive(executor)
    finally:
        server.kill()


def test_killed_frontend_is_restarted_and_serves(tiny_llama_dir):
    server = Server(tiny_llama_dir)
    try:
        kids = children_of(server.proc.pid)
        frontend = next(
            k for k in kids if open(f"/proc/{k}/cmdline").read().startswith("zllm: frontend")
        )
        os.kill(frontend, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "\n".join(server.lines)
            time.sleep(0.2)
        body = {"prompt": "The quick", "max_tokens": 5}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        server.kill()
