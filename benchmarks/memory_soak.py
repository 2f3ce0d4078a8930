"""Memory that does not grow (issue 39): a long soak of the real multi-process server, with
each process's anonymous memory plus swap (zllm/bench/process_memory.py) sampled as it goes.

    python benchmarks/memory_soak.py [--requests 20000] [--sample-every 1000] [--warmup 2000]
    python benchmarks/memory_soak.py --model smollm2 --threads 2   # issue 56's setting

Starts `zllm serve` (two tokenizer and two detokenizer workers, LoRA on with one adapter) on
the tests' tiny random Llama (tests/tiny_models.py, built in a temporary directory), or on
`--model` (a path or a registered name, with the CPU's default 1 GiB KV pool and no LoRA,
so its GGUF kernels and fused decode path serve: LoRA turns the fused path off), with
`--threads` torch threads per process, and sends `--requests` requests, `--concurrency` at
a time, each drawn from SHAPES: completions and chat, streamed and not, n > 1, streams the
client abandons after a few events, structured output (a JSON schema, a choice), logprobs
(the prompt's too), the adapter (the tiny model only), and prompts that share a long prefix
(prefix cache hits). After every `--sample-every` requests it waits until the server is
idle, then past the executor's idle trim (zllm/runtime/heap_trim.py: it hands the heap its
steps freed back after IDLE_TRIM_S without a step), and reads every process's RssAnon +
VmSwap. At the end it prints the samples, each process's growth in bytes per request (the
least-squares slope over the samples from `--warmup` requests on; the goal: under 100 B,
0.1 KB) and whether the KV pool's free blocks are back to its total.
Every request is bounded by `--request-timeout`; a failed or hung one is counted and shown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import Server, asse_lines, metric, start_server, stop_server, wait_until  # noqa: E402
from tiny_models import write_lora_adapter, write_tiny_model  # noqa: E402

from zllm.bench.process_memory import MemorySample, growth_per_request, process_memory  # noqa: E402
from zllm.runtime.heap_trim import IDLE_TRIM_S  # noqa: E402

ADAPTER = "soak-lora"
GOAL_BYTES_PER_REQUEST = 100.0  # 0.1 KB
WORDS = ["Paged", "attention", "blocks", "The quick", "brown fox", "你好", "café", "🙂", "1234"]
# Four long shared prefixes (token ids): a request naming one hits the prefix cache.
PREFIX_TOKENS = 192
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
# A request's path through the processes: the table's column order.
ROLE_ORDER = ["supervisor", "frontend", "tokenizer", "core", "executor", "detokenizer"]
# Shape -> share of the requests.
SHAPES = {
    "completion": 0.14,
    "completion-stream": 0.14,
    "chat": 0.10,
    "chat-stream": 0.10,
    "n>1": 0.08,
    "cancel": 0.12,
    "structured": 0.08,
    "lora": 0.08,
    "logprobs": 0.06,
    "prefix-hit": 0.16,
}


@dataclass(frozen=True)
class Plan:
    shape: str
    path: str
    body: dict
    cancel_after: int = 0  # abandon the stream after this many events (0: read it all)


def text_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice((1, 4, 16, 48))))


def make_plan(i: int, seed: int, model: str, prefixes: list[list[int]]) -> Plan:
    """Request `i`'s plan, drawn from its own seed (the same run after run)."""
    rng = random.Random(seed * 1_000_003 + i)
    shape = rng.choices(list(SHAPES), weights=list(SHAPES.values()))[0]
    base = {"model": model, "max_tokens": rng.choice((1, 4, 16)), "temperature": 0}
    base["ignore_eos"] = True
    chat = {"messages": [{"role": "user", "content": text_prompt(rng)}]}
    if shape in ("completion", "completion-stream"):
        body = {**base, "prompt": text_prompt(rng), "stream": shape.endswith("stream")}
        return Plan(shape, "/v1/completions", body)
    if shape in ("chat", "chat-stream"):
        body = {**base, **chat, "stream": shape.endswith("stream")}
        return Plan(shape, "/v1/chat/completions", body)
    if shape == "n>1":
        body = {**base, **chat, "n": rng.choice((2, 3)), "temperature": 0.8, "seed": i}
        return Plan(shape, "/v1/chat/completions", {**body, "stream": rng.random() < 0.5})
    if shape == "cancel":
        body = {**base, "prompt": text_prompt(rng), "max_tokens": 64, "stream": True}
        return Plan(shape, "/v1/completions", body, cancel_after=rng.randint(1, 3))
    if shape == "structured":
        structured = {**base, "max_tokens": 32, "ignore_eos": False}
        if rng.random() < 0.5:
            schema = {"name": "answer", "schema": SCHEMA, "strict": True}
            body = {**structured, **chat}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
            return Plan(shape, "/v1/chat/completions", body)
        body = {**structured, "prompt": text_prompt(rng)}
        body["structured_outputs"] = {"choice": ["yes", "no", "maybe"]}
        return Plan(shape, "/v1/completions", body)
    if shape == "logprobs":  # sampled tokens' top logprobs, and the prompt's on completions
        k = rng.choice((1, 5))
        if rng.random() < 0.5:
            body = {**base, **chat, "logprobs": True, "top_logprobs": k}
            return Plan(shape, "/v1/chat/completions", {**body, "stream": rng.random() < 0.5})
        body = {**base, "prompt": text_prompt(rng), "logprobs": k, "prompt_logprobs": k}
        return Plan(shape, "/v1/completions", {**body, "stream": rng.random() < 0.5})
    if shape == "lora":
        body = {**base, "model": ADAPTER, "prompt": text_prompt(rng)}
        return Plan(shape, "/v1/completions", {**body, "stream": rng.random() < 0.5})
    # prefix-hit: a shared prefix and a short suffix of its own, as token ids.
    prompt = rng.choice(prefixes) + [rng.randrange(3, 400) for _ in range(rng.randint(1, 16))]
    return Plan(shape, "/v1/completions", {**base, "prompt": prompt})


async def run_one(client: httpx.AsyncClient, url: str, plan: Plan) -> str:
    """'ok', 'cancelled', or what went wrong ('status 503', 'error event', ...)."""
    if not plan.body.get("stream"):
        r = await client.post(url + plan.path, json=plan.body)
        if r.status_code != 200:
            return f"status {r.status_code}"
        choices = r.json()["choices"]
        if len(choices) != plan.body.get("n", 1):
            return "wrong number of choices"
        if "response_format" in plan.body and choices[0]["finish_reason"] == "stop":
            json.loads(choices[0]["message"]["content"])  # a bad one raises: counted below
        return "ok"
    async with client.stream("POST", url + plan.path, json=plan.body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        seen, done = 0, False
        async for line in asse_lines(r.aiter_text()):
            if line.startswith("data: {"):
                if '"error"' in line[:20]:
                    return "error event"
                seen += 1
                if plan.cancel_after and seen >= plan.cancel_after:
                    return "cancelled"  # leaving the block closes the connection mid-stream
            done |= line == "data: [DONE]"
    return "ok" if done else "no [DONE]"


async def run_batch(url: str, plans: list[Plan], concurrency: int, timeout: float) -> Counter:
    """Every plan, `concurrency` at a time; the count of each outcome (a timeout: 'hung')."""
    outcomes: Counter = Counter()
    queue: asyncio.Queue[Plan] = asyncio.Queue()
    for plan in plans:
        queue.put_nowait(plan)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                plan = queue.get_nowait()
                try:
                    outcome = await asyncio.wait_for(run_one(client, url, plan), timeout)
                except asyncio.TimeoutError:
                    outcome = "hung"
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    outcome = f"{type(e).__name__}"
                good = outcome in ("ok", "cancelled")
                outcomes[outcome if good else f"{plan.shape}: {outcome}"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def idle(server: Server) -> bool:
    text = server.get("/metrics").text
    return (
        metric(text, "vllm:num_requests_running") == 0
        and metric(text, "vllm:num_requests_waiting") == 0
        and metric(text, "vllm:kv_cache_usage_perc") == 0
        and metric(text, "zllm:num_requests_in_flight") == 0
    )


def kv_pool(server: Server) -> tuple[int, int]:
    """(free blocks, total): free counts cached prefixes, which any request may evict."""
    kv = server.get("/dashboard/stats").json()["kv"]
    return kv["num_blocks"] - kv["num_used"], kv["num_blocks"]


def processes(server: Server) -> dict[str, int]:
    """Every server process by role: the supervisor and its titled children."""
    return {"supervisor": server.proc.pid, **server.children()}


def print_report(
    names: list[str], samples: dict[str, list[MemorySample]], warmup: int, requests: int
) -> dict[str, float]:
    """The samples (KiB of anon + swap) and each process's growth per request; returns it."""
    width = max(12, *(len(n) + 1 for n in names))
    print("\nanonymous memory + swap, KiB, after each sample's requests (the server idle)\n")
    print("| requests | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for k, first in enumerate(samples[names[0]]):
        row = [f"{samples[n][k].memory.total_kib:,}" for n in names]
        print(f"| {first.requests:,} | " + " | ".join(row) + " |")
    swapped = max(s.memory.swap_kib for n in names for s in samples[n])
    print(f"\n(largest VmSwap seen: {swapped:,} KiB)")
    growth = {n: growth_per_request(samples[n], warmup) for n in names}
    kept = [s.requests for s in samples[names[0]] if s.requests >= warmup]
    # The slope over the later half too: memory that fills a bounded structure (a window of
    # latencies, a cache the size of the KV pool) flattens there, a leak keeps its slope.
    half = kept[len(kept) // 2] if len(kept) >= 4 else None
    print(
        f"\ngrowth per request, least-squares slope over the {len(kept)} samples from "
        f"{warmup:,} to {requests:,} requests (goal: under {GOAL_BYTES_PER_REQUEST:.0f} B)"
        + (f"; the same from {half:,} on\n" if half else "\n")
    )
    print(f"| {'process':{width}} | from KiB | to KiB | B / request | goal | later half |")
    print(f"|{'-' * (width + 2)}|---:|---:|---:|---|---:|")
    for n in names:
        first = next(s for s in samples[n] if s.requests >= warmup)
        met = "met" if growth[n] < GOAL_BYTES_PER_REQUEST else "NOT met"
        later = f"{growth_per_request(samples[n], half):+.1f}" if half else "-"
        print(
            f"| {n:{width}} | {first.memory.total_kib:,} | {samples[n][-1].memory.total_kib:,} "
            f"| {growth[n]:+.1f} | {met} | {later} |"
        )
    return growth


def soak(args: argparse.Namespace, server: Server, model: str) -> dict:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, 400) for _ in range(PREFIX_TOKENS)] for _ in range(4)]
    children = processes(server)
    names = sorted(children, key=lambda n: (ROLE_ORDER.index(n.split()[0]), n))
    samples: dict[str, list[MemorySample]] = {n: [] for n in names}
    outcomes: Counter = Counter()

    def sample(done: int) -> None:
        if not wait_until(lambda: idle(server), args.idle_timeout):
            raise RuntimeError(f"not idle {args.idle_timeout} s after {done} requests")
        # Past the executor's idle trim (what it holds between spells), with room for the trim
        # itself and a loaded machine's scheduling (a sample 0.5 s after it read 30 MiB high).
        time.sleep(IDLE_TRIM_S + 3.0)
        if processes(server) != children:
            raise RuntimeError(f"a process restarted before {done} requests: {processes(server)}")
        for n in names:
            samples[n].append(MemorySample(done, process_memory(children[n])))
        row = " ".join(f"{n}={samples[n][-1].memory.total_kib / 1024:.1f}" for n in names)
        print(f"{done:>6} requests  {time.monotonic() - start:6.0f} s  MiB: {row}", flush=True)

    start = time.monotonic()
    sample(0)
    for first in range(0, args.requests, args.sample_every):
        count = min(args.sample_every, args.requests - first)
        plans = [make_plan(i, args.seed, model, prefixes) for i in range(first, first + count)]
        batch = asyncio.run(run_batch(server.url, plans, args.concurrency, args.request_timeout))
        outcomes += batch
        sample(first + count)
    duration = time.monotonic() - start

    # The core's stats come with its heartbeat: give it a few of them to report the pool.
    pool_back = wait_until(lambda: kv_pool(server)[0] == kv_pool(server)[1], 10)
    free, total = kv_pool(server)
    growth = print_report(names, samples, args.warmup, args.requests)
    print(
        f"\n{args.requests:,} requests in {duration:.0f} s ({args.requests / duration:.1f}/s) at "
        f"concurrency {args.concurrency}; outcomes: {dict(outcomes)}"
    )
    print(f"KV pool after the last request: {free:,} of {total:,} blocks free "
          f"({'back to the total' if pool_back else 'NOT back'})")  # fmt: skip
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "duration_s": round(duration, 1),
        "outcomes": dict(outcomes),
        "warmup": args.warmup,
        "samples_kib": {
            n: [[s.requests, s.memory.anon_kib, s.memory.swap_kib] for s in v]
            for n, v in samples.items()
        },
        "growth_bytes_per_request": {n: round(g, 2) for n, g in growth.items()},
        "kv_free_blocks": free,
        "kv_total_blocks": total,
    }


def start_tiny(tmp: Path, threads: int) -> Server:
    """The tiny random Llama served with LoRA on and one adapter (ADAPTER)."""
    model_dir = write_tiny_model(tmp / "model")
    adapter = write_lora_adapter(tmp / "adapter", model_dir)
    return start_server(
        str(model_dir), tmp / "server.log",
        "--tokenizer-workers", "2", "--detokenizer-workers", "2",
        "--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}",
        env={"OMP_NUM_THREADS": str(threads)},
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--sample-every", type=int, default=1_000)
    p.add_argument("--warmup", type=int, default=2_000, help="requests before the slope starts")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--idle-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--model", default=None, help="serve this model (default: the tiny Llama)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args()
    kept = len(range(args.warmup, args.requests + 1, args.sample_every))
    if args.warmup % args.sample_every or kept < 2:
        p.error("--warmup must be a multiple of --sample-every with two samples from it on")
    with tempfile.TemporaryDirectory(prefix="zllm-soak-") as tmp:
        if args.model is None:
            server = start_tiny(Path(tmp), args.threads)
        else:
            del SHAPES["lora"]  # (its adapter is the tiny model's)
            server = start_server(
                args.model, Path(tmp) / "server.log",
                "--tokenizer-workers", "2", "--detokenizer-workers", "2",
                "--kv-cache-memory-bytes", "1G",
                env={"OMP_NUM_THREADS": str(args.threads)},
            )  # fmt: skip
        try:
            result = soak(args, server, server.get("/v1/models").json()["data"][0]["id"])
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            stop_server(server)
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
