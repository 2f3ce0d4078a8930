"""`zllm bench serve`: an online load generator for any OpenAI-compatible server.

It streams `/v1/completions` requests whose prompts are fixed-length random token-id lists
(so every engine sees exactly the same tokens), either closed loop (`--concurrency N`: N
requests always in flight) or open loop (`--request-rate R`: Poisson arrivals, optionally
capped by `--concurrency`), and measures per request:

- TTFT: time from sending the request to the first streamed token chunk;
- ITL: the gaps between successive streamed token chunks;
- TPOT: (e2e - TTFT) / (output tokens - 1);
- e2e latency, and the output tokens (from the stream's `usage` when the server sends one,
  else the number of token chunks).

It reports request and token throughput over the whole run and mean/p50/p99 of each latency,
prints a table and optionally writes JSON. Works against zllm, vLLM and llama.cpp's
llama-server (which also takes token arrays as `prompt` and honours `ignore_eos`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from zllm.bench.datasets import DATASETS, chat_prompts, random_prompts
from zllm.bench.engine_stats import engine_cost, parse_counters, process_cpu_seconds
from zllm.runtime.percentile import percentile

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


@dataclass(slots=True)
class ServeBenchConfig:
    base_url: str = DEFAULT_BASE_URL
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first id from GET /v1/models
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    concurrency: int | None = None  # None: no cap (all at once unless --request-rate)
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: no pacing
    prompt_seed: int = 0
    arrival_seed: int = 0
    vocab_size: int | None = None
    request_timeout: float = 600.0  # seconds, whole request
    num_warmups: int = 1
    api_key: str | None = None
    temperature: float = 0.0
    label: str | None = None
    # Sent as every request's `structured_outputs` (e.g. {"json": {...}} or {"regex": "..."}):
    # what grammars cost per step.
    structured_outputs: dict | None = None
    # "random": input_len random token ids; "edit" / "free": chat prompts whose answers
    # repeat their input or do not (zllm/bench/datasets.py), tokenized with `tokenizer`.
    dataset: str = "random"
    tokenizer: str | None = None
    # LoRA adapters (served model names): request i names lora_modules[i % len], so every
    # step mixes them; each is warmed up first (the executor loads an adapter on first use).
    lora_modules: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    num_chunks: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # seconds since the benchmark started
    error: str | None = None


# ---------------------------------------------------------------------------------------------
# CLI


def add_parser(bench_sub) -> None:
    d = ServeBenchConfig()
    p = bench_sub.add_parser(
        "serve",
        help="online serving benchmark against an OpenAI-compatible server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default=d.base_url)
    p.add_argument("--endpoint", default=d.endpoint)
    p.add_argument("--model", default=None, help="model name sent; default: first of /v1/models")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        help="LoRA adapter names the server serves: request i names the (i mod N)-th",
    )
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--input-len", type=int, default=d.input_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument(
        "--concurrency",
        "--max-concurrency",
        dest="concurrency",
        type=int,
        default=None,
        help="requests in flight (closed loop); with --request-rate, a cap",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: no pacing)",
    )
    p.add_argument("--prompt-seed", type=int, default=d.prompt_seed)
    p.add_argument("--arrival-seed", type=int, default=d.arrival_seed)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="draw prompt token ids below this; default: read from --tokenizer",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local model (short name, .gguf, HF dir) giving the vocab size; default smollm2",
    )
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.add_argument("--num-warmups", type=int, default=d.num_warmups)
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY if set")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--label", default=None, help="a name for this run, kept in the JSON")
    p.add_argument(
        "--structured-outputs",
        type=json.loads,
        default=None,
        help='JSON sent as each request\'s structured_outputs, e.g. \'{"regex": "[a-z ]+"}\' '
        "(zllm and vLLM): the per-step cost of grammars",
    )
    p.add_argument(
        "--dataset",
        default=d.dataset,
        choices=DATASETS,
        help="random: --input-len random token ids; edit: chat requests to rewrite a given "
        "code or text (the answer repeats the prompt: prompt lookup pays); free: open-ended "
        "writing (it does not); chat prompts use --tokenizer's template",
    )
    p.add_argument("--output-json", default=None)
    p.add_argument(
        "--save-detailed", action="store_true", help="also write per-request records to JSON"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import logging
    import os

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request

    vocab = args.vocab_size
    if vocab is None:
        from zllm.model.arch import arch_of
        from zllm.model.files import resolve_model

        vocab = arch_of(resolve_model(args.tokenizer)).vocab_size
    config = ServeBenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        lora_modules=list(args.lora_modules),
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        prompt_seed=args.prompt_seed,
        arrival_seed=args.arrival_seed,
        vocab_size=vocab,
        request_timeout=args.request_timeout,
        num_warmups=args.num_warmups,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        temperature=args.temperature,
        label=args.label,
        structured_outputs=args.structured_outputs,
        dataset=args.dataset,
        tokenizer=args.tokenizer,
    )
    if config.num_prompts < 1 or config.input_len < 1 or config.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be at least 1")
    if config.concurrency is not None and config.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if not config.request_rate > 0:
        raise ValueError("--request-rate must be positive")
    try:
        summary, results = asyncio.run(run_benchmark(config))
    except BenchmarkError as e:
        print(f"zllm bench serve: {e}", file=sys.stderr)
        return 1
    print(format_table(summary))
    if args.output_json:
        out = dict(summary)
        if args.save_detailed:
            out["requests"] = [asdict(r) for r in results]
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if summary["completed"] > 0 else 1


# ---------------------------------------------------------------------------------------------
# The load generator


class BenchmarkError(RuntimeError):
    pass


def make_prompts(config: ServeBenchConfig) -> list[list[int]]:
    if config.dataset != "random":
        return chat_prompts(
            config.dataset, config.num_prompts, config.tokenizer, config.prompt_seed
        )

    if not config.vocab_size:
        raise ValueError("vocab_size is needed to draw random prompt token ids")
    return random_prompts(
        config.num_prompts, config.input_len, config.vocab_size, config.prompt_seed
    )


def _headers(config: ServeBenchConfig) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if config.api_key:
        h["Authorization"] = f"Bearer {config.api_key}"
    return h


async def fetch_model_name(client, config: ServeBenchConfig) -> str:
    url = config.base_url.rstrip("/") + "/v1/models"
    try:
        r = await client.get(url, headers=_headers(config), timeout=30.0)
        r.raise_for_status()
        data = r.json()["data"]
        return data[0]["id"]
    except Exception as e:  # noqa: BLE001 - any failure here means "pass --model"
        raise BenchmarkError(f"cannot read a model id from GET {url} ({e!r}); pass --model") from e


def request_body(config: ServeBenchConfig, model: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        # max_tokens is also llama-server's alias of n_predict; ignore_eos is a vLLM (and
        # zllm) extension that llama-server honours too.
        "ignore_eos": True,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | ({"structured_outputs": config.structured_outputs} if config.structured_outputs else {})


async def send_request(
    client, config: ServeBenchConfig, model: str, prompt: list[int], max_tokens: int, t0: float
) -> RequestResult:
    """One streamed completion; never raises (errors are recorded in the result)."""
    result = RequestResult(prompt_len=len(prompt))
    start = time.perf_counter()
    result.start = start - t0
    try:
        await asyncio.wait_for(
            _stream(client, config, model, prompt, max_tokens, start, result),
            timeout=config.request_timeout,
        )
    except asyncio.TimeoutError:
        result.error = f"timeout after {config.request_timeout:g} s"
    except Exception as e:  # noqa: BLE001 - a failed request is data, not a crash
        result.error = f"{type(e).__name__}: {e}"[:500]
    else:
        if result.num_chunks == 0 and not result.error:
            result.error = "no token in the stream"
        result.ok = result.error is None
    return result


async def _stream(client, config, model, prompt, max_tokens, start, result: RequestResult):
    url = config.base_url.rstrip("/") + config.endpoint
    body = request_body(config, model, prompt, max_tokens)
    last = start
    async with client.stream("POST", url, json=body, headers=_headers(config)) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            result.error = f"HTTP {resp.status_code}: {text[:300]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            now = time.perf_counter()
            data = json.loads(payload)
            if "error" in data:
                result.error = f"error in stream: {str(data['error'])[:300]}"
                return
            usage = data.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                result.output_tokens = int(usage["completion_tokens"])
                result.usage_reported = True
            choices = data.get("choices")
            if not choices:
                continue
            choice = choices[0]
            # A closing chunk with no text (only finish_reason) adds no token to those counted,
            # unless it is the first: tokens that decode to no text (special tokens, which are
            # skipped, or bytes of an unfinished character) may stream nothing before it.
            if (
                result.num_chunks
                and not choice.get("text")
                and choice.get("finish_reason") is not None
            ):
                continue
            if result.num_chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            result.num_chunks += 1
    result.e2e = time.perf_counter() - start
    if not result.usage_reported:
        result.output_tokens = result.num_chunks


async def run_benchmark(
    config: ServeBenchConfig, prompts: list[list[int]] | None = None
) -> tuple[dict[str, Any], list[RequestResult]]:
    """Run the whole benchmark; returns (summary, per-request results in prompt order)."""
    import httpx

    if prompts is None:
        prompts = make_prompts(config)
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = config.model or await fetch_model_name(client, config)
        models = config.lora_modules or [model]
        for i in range(config.num_warmups):
            for name in models:
                # Reversed, so that no benchmark prompt finds its prefix cached by the warm-up.
                warm = prompts[i % len(prompts)][::-1]
                w = await send_request(client, config, name, warm, 4, 0.0)
                if not w.ok:
                    raise BenchmarkError(
                        f"warm-up request to {config.base_url} ({name}) failed: {w.error}"
                    )

        load_at_start = _loadavg()
        server_before = await _server_snapshot(client, config)
        results: list[RequestResult | None] = [None] * len(prompts)
        sem = asyncio.Semaphore(config.concurrency) if config.concurrency else None
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            name = models[i % len(models)]
            if sem is None:
                results[i] = await send_request(
                    client, config, name, prompts[i], config.output_len, t0
                )
                return
            async with sem:
                results[i] = await send_request(
                    client, config, name, prompts[i], config.output_len, t0
                )

        if math.isinf(config.request_rate):
            # Closed loop under the semaphore (or everything at once without one).
            await asyncio.gather(*(one(i) for i in range(len(prompts))))
        else:
            rng = random.Random(config.arrival_seed)
            tasks = []
            for i in range(len(prompts)):
                tasks.append(asyncio.create_task(one(i)))
                if i + 1 < len(prompts):
                    await asyncio.sleep(rng.expovariate(config.request_rate))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        # zllm's counters arrive with the core's heartbeat (every 0.5 s): let the last steps in.
        await asyncio.sleep(1.2 if server_before[0] else 0.0)
        server_after = await _server_snapshot(client, config)
    done = [r for r in results if r is not None]
    summary = summarize(config, ",".join(models), done, duration)
    summary["loadavg_1m_at_start"] = load_at_start
    summary["engine"] = engine_cost(server_before, server_after, summary["total_output_tokens"])
    return summary, done


async def _server_snapshot(client, config: ServeBenchConfig) -> tuple[dict, dict]:
    """(the server's step counters, local zllm processes' CPU seconds); empty when absent."""
    counters: dict[str, float] = {}
    try:
        r = await client.get(f"{config.base_url}/metrics", headers=_headers(config))
        if r.status_code == 200:
            counters = parse_counters(r.text)
    except Exception:  # another engine, or metrics protected: the figures are optional
        pass
    return counters, process_cpu_seconds(per_process=True)


def _loadavg() -> float | None:
    """This machine's 1-minute load average: a busy machine skews the figures."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


# ---------------------------------------------------------------------------------------------
# Statistics


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    return {
        "mean": round(1000 * sum(values) / len(values), 3),
        "p50": round(1000 * percentile(values, 50), 3),
        "p99": round(1000 * percentile(values, 99), 3),
    }


def summarize(
    config: ServeBenchConfig, model: str, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown")[:120]
            errors[key] = errors.get(key, 0) + 1
    return {
        "label": config.label,
        "base_url": config.base_url,
        "model": model,
        "num_prompts": config.num_prompts,
        "input_len": config.input_len,
        "output_len": config.output_len,
        "concurrency": config.concurrency,
        "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
        "prompt_seed": config.prompt_seed,
        "dataset": config.dataset,
        "duration_s": round(duration, 3),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "short_outputs": sum(1 for r in ok if r.output_tokens < config.output_len),
        "usage_reported": sum(1 for r in ok if r.usage_reported),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "total_chunks": sum(r.num_chunks for r in ok),
        "request_throughput": round(len(ok) / duration, 4),
        "output_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms(itls),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
    }


def format_table(s: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = [
        ("Model", str(s["model"])),
        ("Base URL", str(s["base_url"])),
        (
            "Load",
            f"concurrency {s['concurrency'] or 'unbounded'}, "
            f"rate {s['request_rate'] or 'inf'} req/s",
        ),
        (
            "Prompts x input / output",
            f"{s['num_prompts']} x {s['input_len']} / {s['output_len']}"
            if s.get("dataset", "random") == "random"
            else f"{s['num_prompts']} {s['dataset']} chats / {s['output_len']}",
        ),
        ("Successful requests", str(s["completed"])),
        ("Failed requests", str(s["failed"])),
        ("Outputs shorter than asked", str(s["short_outputs"])),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", str(s["total_input_tokens"])),
        ("Total output tokens", str(s["total_output_tokens"])),
        ("Request throughput (req/s)", f"{s['request_throughput']:.3f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E latency"),
    ):
        for stat in ("mean", "p50", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", f"{s[key][stat]:.2f}"))
    engine = s.get("engine") or {}
    if "per_step_ms" in engine:
        step = engine["per_step_ms"]
        rows.append(("Engine steps", str(engine["steps"])))
        for key, name in (
            ("busy", "Executor step"),
            ("prepare", "  inputs + metadata"),
            ("forward", "  forward"),
            ("sample", "  logits + sampling"),
            ("idle", "Executor idle"),
            ("schedule", "Core scheduling"),
            ("core_output", "Core output handling"),
        ):
            rows.append((f"{name} (ms/step)", f"{step[key]:.2f}"))
        if engine.get("executor_idle_share") is not None:
            rows.append(("Executor idle share", f"{engine['executor_idle_share']:.1%}"))
        if engine.get("gpu_idle_share") is not None:
            rows.append(("GPU idle between steps (share)", f"{engine['gpu_idle_share']:.1%}"))
        if engine.get("overlapped_share"):
            rows.append(("Steps launched over the one before", f"{engine['overlapped_share']:.1%}"))
    for stage, share in enumerate(engine.get("pipeline_stage_idle_share") or []):
        if share is not None:
            rows.append((f"Pipeline stage {stage} idle share", f"{share:.1%}"))
    spec = engine.get("spec_decode")
    if spec:
        rows.append(("Spec decode acceptance rate", f"{spec['acceptance_rate']:.1%}"))
        rows.append(("Spec decode tokens per verify", f"{spec['mean_acceptance_length']:.2f}"))
    for role, ms in (engine.get("cpu_ms_per_output_token") or {}).items():
        rows.append((f"CPU {role} (ms/token)", f"{ms:.2f}"))
    width = max(len(k) for k, _ in rows) + 2
    vwidth = max(12, *(len(v) for _, v in rows))
    line = "=" * (width + vwidth)
    body = "\n".join(f"{k:<{width}}{v:>{vwidth}}" for k, v in rows)
    errors = "".join(f"\n  error x{n}: {e}" for e, n in s["errors"].items())
    title = f"{'Serving benchmark result':^{width + vwidth}}"
    return f"{line}\n{title}\n{line}\n{body}\n{line}{errors}"
