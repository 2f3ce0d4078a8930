"""Data parallelism: the prefix-cache hit rate of `--data-parallel-size 2` with cache-aware
routing, against load-only routing and against one engine, on the same workload in the same
run.

The workload: G groups of requests, each group sharing a P-token prefix (a system prompt, a
document) followed by a Q-token question of its own, R requests per group, sent in a shuffled
order with C in flight (greedy, O output tokens, token ids straight to /v1/completions).
Each server is measured from its /metrics (the prompt tokens looked up in and found in the
prefix cache, per engine) before and after the requests.

    single  one engine (--data-parallel-size 1): the best any routing can do
    cache   --data-parallel-size 2, --data-parallel-routing cache_aware (the default)
    load    --data-parallel-size 2, --data-parallel-routing load (the prefix ignored)

    python benchmarks/dp_routing.py                      # ~4 min on 2 cores (SmolLM2)
    python benchmarks/dp_routing.py --configs cache load --groups 4
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from kv_offload import start

CONFIGS = {
    "single": [],
    "cache": ["--data-parallel-size", "2"],
    "load": ["--data-parallel-size", "2", "--data-parallel-routing", "load"],
}
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def per_engine(url: str) -> dict[str, dict[str, float]]:
    """{counter: {engine: value}} from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found: dict[str, dict[str, float]] = {name: {} for name in (*COUNTERS, "requests")}
    for m in re.finditer(r"^([\w:]+)\{([^}]*)\} (\S+)$", text, re.M):
        name, labels, value = m.groups()
        engine = re.search(r'engine="(\d+)"', labels)
        if engine is None:
            continue
        if name == "zllm:tenant_requests_total":
            name = "requests"
        if name in found:
            found[name][engine.group(1)] = found[name].get(engine.group(1), 0) + float(value)
    return found


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.groups):
        prefix = [rng.randrange(256, 49152) for _ in range(args.prefix_len)]
        for _ in range(args.per_group):
            prompts.append(prefix + [rng.randrange(256, 49152) for _ in range(args.question_len)])
    rng.shuffle(prompts)
    return prompts


async def send_all(url: str, prompts: list[list[int]], args: argparse.Namespace) -> list[float]:
    """Every prompt, `concurrency` at a time; each one's latency (seconds)."""
    gate = asyncio.Semaphore(args.concurrency)

    async def one(client: httpx.AsyncClient, tokens: list[int]) -> float:
        body = {"model": args.model, "prompt": tokens, "max_tokens": args.output_len, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        async with gate:
            start_time = time.perf_counter()
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return time.perf_counter() - start_time

    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


def run_config(args: argparse.Namespace, name: str, tmp: str) -> dict:
    proc = start(args, CONFIGS[name], Path(tmp) / f"server-{name}.log")
    url = f"http://127.0.0.1:{args.port}"
    try:
        before = per_engine(url)
        wall = time.perf_counter()
        latencies = asyncio.run(send_all(url, workload(args), args))
        wall = time.perf_counter() - wall
        time.sleep(1.2)  # the counters come with each core's next heartbeat
        after = per_engine(url)
    finally:
        proc.terminate()
        proc.wait(60)

    def gained(name: str) -> dict[str, float]:
        return {e: v - before[name].get(e, 0) for e, v in after[name].items()}

    queries, hits = gained(COUNTERS[0]), gained(COUNTERS[1])
    return {
        "hit_rate": sum(hits.values()) / sum(queries.values()),
        "hits_per_engine": hits,
        "requests_per_engine": gained("requests"),
        "wall_s": wall,
        "latency_p50_s": statistics.median(latencies),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pool", default="1G", help="--kv-cache-memory-bytes of each engine")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--port", type=int, default=8032)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            results[name] = run_config(args, name, tmp)
            print(f"{name}: {results[name]}", flush=True)
    n = args.groups * args.per_group
    ideal = (
        (args.per_group - 1)
        * args.prefix_len
        / args.per_group
        / (args.prefix_len + args.question_len)
    )
    print(f"\n{args.groups} groups x {args.per_group} requests, {args.prefix_len}-token shared "
          f"prefix + {args.question_len}-token question, {args.output_len} out, c="
          f"{args.concurrency}, {n} requests (best possible hit rate {ideal:.1%}):\n")  # fmt: skip
    print("| config | prefix-cache hit rate | hits per engine (tokens) | requests per engine "
          "| wall s | latency p50 s |\n|---|---|---|---|---|---|")  # fmt: skip
    for name, r in results.items():
        hits = " / ".join(f"{v:.0f}" for _, v in sorted(r["hits_per_engine"].items()))
        reqs = " / ".join(f"{v:.0f}" for _, v in sorted(r["requests_per_engine"].items()))
        print(f"| {name} | {r['hit_rate']:.1%} | {hits} | {reqs} | {r['wall_s']:.1f} "
              f"| {r['latency_p50_s']:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
