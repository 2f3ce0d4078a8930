"""KV offload and prefix pinning: TTFT of a long shared prefix after other traffic has flushed
it out of the KV pool, against the same server without tiers, in the same run.

For each configuration a `zllm serve` (default model) with a small KV pool: one request
computes the prefix (P tokens) plus a question; then, each round, other requests of as many
tokens as the pool holds flush it, and a request of the prefix plus a new question is timed
(time to its first streamed token; the usage says how many prompt tokens came cached).

    none   no tiers: the prefix is recomputed
    cpu    --kv-offload-bytes: it loads from the executor's memory
    disk   --kv-offload-dir: it loads from local disk (files, CRC-checked)
    pin    no tiers, the first request pins its prefix (cache_control): it never left

    python benchmarks/kv_offload.py                 # ~5 min on 2 cores
    python benchmarks/kv_offload.py --rounds 1 --configs none cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CONFIGS = {
    "none": [],
    "cpu": ["--kv-offload-bytes", "1G"],
    "disk": ["--kv-offload-dir", "{tmp}/tier", "--kv-offload-disk-bytes", "2G"],
    "pin": ["--max-pinned-bytes", "128M"],
}


def start(args: argparse.Namespace, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "zllm.cli", "serve", args.model, "--host", "127.0.0.1",
           "--port", str(args.port), "--kv-cache-memory-bytes", args.pool, *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"zllm serve exited: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"zllm serve did not start: see {log}")


def stream(url: str, model: str, tokens: list[int], max_tokens: int, extra: dict | None = None):
    """(TTFT seconds, cached prompt tokens) of one streamed completion of `model`."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}  # fmt: skip
    start = time.perf_counter()
    ttft, cached = None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return ttft, cached


def run_config(args: argparse.Namespace, name: str, tmp: str) -> list[tuple[float, int]]:
    extra = [a.format(tmp=tmp) for a in CONFIGS[name]]
    proc = start(args, extra, Path(tmp) / f"server-{name}.log")
    url = f"http://127.0.0.1:{args.port}"
    rng = random.Random(args.seed)
    prefix = [rng.randrange(256, 49152) for _ in range(args.prefix_len)]
    pin = {"cache_control": {"type": "ephemeral", "ttl": "1h"}} if name == "pin" else None
    try:
        stream(url, args.model, prefix + [rng.randrange(256, 49152) for _ in range(16)], 1, pin)
        results = []
        for _ in range(args.rounds):
            for _ in range(args.flush):
                stream(
                    url, args.model, [rng.randrange(256, 49152) for _ in range(args.prefix_len)], 1
                )
            question = [rng.randrange(256, 49152) for _ in range(16)]
            results.append(stream(url, args.model, prefix + question, 8))
            print(f"{name}: TTFT {results[-1][0]:.3f} s, {results[-1][1]} cached", flush=True)
        return results
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--pool", default="256M", help="--kv-cache-memory-bytes of every server")
    p.add_argument("--flush", type=int, default=4, help="other prompts between measurements")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            results = run_config(args, name, tmp)
            medians[name] = (
                statistics.median(t for t, _ in results),
                statistics.median(c for _, c in results),
            )
    base = medians.get("none", (None, None))[0]
    print(f"\n{args.prefix_len}-token prefix after {args.flush} x {args.prefix_len}-token "
          f"prompts of other traffic, pool {args.pool}, median of {args.rounds}:\n")  # fmt: skip
    print("| config | TTFT | cached prompt tokens | vs none |\n|---|---|---|---|")
    for name, (ttft, cached) in medians.items():
        ratio = f"{base / ttft:.1f}x faster" if base and name != "none" else ""
        print(f"| {name} | {1000 * ttft:.0f} ms | {cached:.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
