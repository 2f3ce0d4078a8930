"""A served prefill/decode pair behind `zllm proxy`, for the tests of disaggregation with
other features: the servers (kv_producer, kv_consumer) and the proxy started and stopped
together, the transfer config, and the check that the pair answers as one server does."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
from served_answers import greedy
from servers import Server, free_port, metric, start_server, stop_server, wait_until

# Several full 16-token blocks each: what a consumer can load from the transfer.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Paged attention stores keys and values in blocks; " * 5,
    "def add(a, b):\n    return a + b\n" * 4,
]


def free_port_range(n: int) -> int:
    """A port p with p .. p + n - 1 all free (a tensor-parallel consumer's kv_port)."""
    for _ in range(50):
        first = free_port()
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {n} consecutive free ports")


def kv_config(role: str, port: int, **extra) -> str:
    """--kv-transfer-config's JSON for `role` at `port` (`extra`: its extra config)."""
    return json.dumps(
        {
            "kv_connector": "ZllmConnector",
            "kv_role": role,
            "kv_ip": "127.0.0.1",
            "kv_port": port,
            "kv_connector_extra_config": extra,
        }
    )


class Proxy:
    def __init__(self, prefill: str, decode: str, log: Path, *extra: str) -> None:
        """`zllm proxy` over the two servers (`extra`: more of its options), up."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "zllm.cli", "proxy", "--prefill", prefill]
        cmd += ["--decode", decode, "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.proc.poll() is None, f"zllm proxy exited:\n{open(log).read()}"
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            assert wait_until(up, 30), open(log).read()
        except AssertionError:
            self.proc.kill()
            raise

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def remote_hits(server: Server) -> float:
    """Prompt tokens a consumer has loaded from the transfer."""
    text = server.get("/metrics").text
    return metric(text, "zllm:kv_offload_hits_total", 'tier="remote"')


@contextlib.contextmanager
def served_pair(
    model: str, tmp_path: Path, port: int, *flags: str, **producer_extra
) -> Iterator[tuple[Server, Server, Proxy]]:
    """A decode server (kv_consumer, waiting up to 30 s for blocks) and a prefill server
    (kv_producer, `producer_extra` in its kv_connector_extra_config) on `model`, both started
    with `flags`, and `zllm proxy` over them: (prefill, decode, proxy). Whatever started is
    stopped at the end."""
    decode = start_server(
        model, tmp_path / "decode.log", *flags,
        "--kv-transfer-config", kv_config("kv_consumer", port, wait_timeout_s=30),
    )  # fmt: skip
    prefill = proxy = None
    try:
        prefill = start_server(
            model, tmp_path / "prefill.log", *flags,
            "--kv-transfer-config", kv_config("kv_producer", port, **producer_extra),
        )  # fmt: skip
        proxy = Proxy(prefill.url, decode.url, tmp_path / "proxy.log")
        yield prefill, decode, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        if prefill is not None:
            stop_server(prefill)
        stop_server(decode)


def assert_pair_answers_as_one_server(
    prefill: Server, decode: Server, proxy: Proxy, prompts: list[str]
) -> str:
    """Through the proxy the greedy answers equal the producer's own (asked unmarked: the
    same cut of the model), and the consumer loaded every full prompt block from the
    transfer (not one ending with the last token: BlockManager.find_cached_prefix) with no
    wait timing out. Returns the consumer's last /metrics text."""
    client = openai.OpenAI(base_url=prefill.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    reference, loadable = [], 0
    for prompt in prompts:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        reference.append(answer.choices[0].text)
        loadable += (answer.usage.prompt_tokens - 1) // 16 * 16
    assert loadable > 0
    assert greedy(proxy.url, prompts, max_tokens=16) == reference
    assert wait_until(lambda: remote_hits(decode) == loadable, 30), decode.log_tail()
    text = decode.get("/metrics").text
    assert metric(text, "zllm:kv_transfer_wait_timeouts_total") == 0
    return text
