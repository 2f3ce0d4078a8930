"""`zllm bench throughput`: offline throughput on fixed-length random prompts.

`--backend transformers` runs Hugging Face's padded batched `generate` on the same prompts,
so the peer is measured in the same run on the same machine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace

from zllm.bench.datasets import random_prompts
from zllm.config.engine_args import EngineArgs, add_engine_args, engine_args_from


@dataclass(slots=True)
class ThroughputResult:
    backend: str
    num_prompts: int
    input_len: int
    output_len: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def add_parsers(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("throughput", help="offline throughput (LLM.generate)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--backend", choices=["zllm", "transformers"], default="zllm")
    p.add_argument("--hf-batch-size", type=int, default=32, help="transformers batch size")
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    p.set_defaults(func=main)

    p = bench_sub.add_parser(
        "accuracy", help="a quantized engine against the fp32 reference: parity and drift"
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    add_engine_args(p)
    p.set_defaults(func=main_accuracy)

    p = bench_sub.add_parser(
        "prefix", help="prefill time of a request whose long prefix is cached vs not"
    )
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    add_engine_args(p)
    p.set_defaults(func=main_prefix)

    from zllm.bench.kv import add_parser as _add_kv
    from zllm.bench.serve import add_parser as _add_serve

    _add_serve(bench_sub)
    _add_kv(bench_sub)


def run_zllm(args: argparse.Namespace, engine: EngineArgs) -> ThroughputResult:
    from zllm import LLM, SamplingParams

    llm = LLM(**asdict(engine))
    prompts = random_prompts(
        args.num_prompts, args.input_len, llm.config.arch.vocab_size, args.prompt_seed
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Warm up (first-call allocations) on a small job outside the timed region.
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == args.num_prompts * args.output_len
    stats = llm.engine.heartbeat()
    pool = stats.kv_pool
    waste = 1.0 - pool.slots_used / max(1, pool.slots_allocated)
    print(
        f"preemptions: {stats.load.num_preemptions}, KV blocks: {pool.num_blocks}, "
        f"KV slots allocated but unused (mean over steps): {100 * waste:.2f}%, "
        f"blocks still referenced at the end: {llm.engine.block_manager.num_referenced_blocks()}"
    )
    return _result("zllm", args, elapsed, num_out)


def run_transformers(args) -> ThroughputResult:
    import torch

    from zllm.model.arch import arch_of
    from zllm.model.files import resolve_model

    path = resolve_model(
        args.model, getattr(args, "revision", None), getattr(args, "download_dir", None)
    )
    arch = arch_of(path)
    # The engine's device and dtype rules: a GPU when one is visible, bf16 there, else fp32.
    device = (
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if device != "cpu" else "float32"
    model = _load_hf_model(path, dtype).to(device)
    prompts = random_prompts(args.num_prompts, args.input_len, arch.vocab_size, args.prompt_seed)
    pad = arch.eos_token_ids[0] if arch.eos_token_ids else 0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=4, do_sample=False)
        if device != "cpu":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        num_out = 0
        for i in range(0, len(prompts), args.hf_batch_size):
            # Equal lengths: no padding.
            batch = torch.tensor(prompts[i : i + args.hf_batch_size], device=device)
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=pad,
            )
            num_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        elapsed = time.perf_counter() - start
    label = f"transformers(batch={args.hf_batch_size}, {device}, {dtype})"
    return _result(label, args, elapsed, num_out)


def _load_hf_model(path: str, dtype: str = "float32"):
    import os

    from transformers import AutoModelForCausalLM

    from zllm.executor.weights.gguf_reading import gguf_parsed_once

    if path.endswith(".gguf"):
        with gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=dtype
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    return model.eval()


def _result(backend, args, elapsed, num_out) -> ThroughputResult:
    n = args.num_prompts
    return ThroughputResult(
        backend=backend,
        num_prompts=n,
        input_len=args.input_len,
        output_len=args.output_len,
        elapsed_s=round(elapsed, 3),
        requests_per_s=round(n / elapsed, 3),
        output_tokens_per_s=round(num_out / elapsed, 2),
        total_tokens_per_s=round((num_out + n * args.input_len) / elapsed, 2),
    )


def main(args: argparse.Namespace) -> int:
    if args.backend == "transformers":
        result = run_transformers(args)
    else:
        result = run_zllm(args, engine_args_from(args))
    print(
        f"{result.backend}: {result.num_prompts} prompts x {result.input_len} in / "
        f"{result.output_len} out in {result.elapsed_s:.2f} s: "
        f"{result.requests_per_s:.2f} req/s, {result.output_tokens_per_s:.1f} output tok/s, "
        f"{result.total_tokens_per_s:.1f} total tok/s"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0


def main_prefix(args: argparse.Namespace) -> int:
    """Time one-token generations: a fresh prefix each time vs a shared, cached one."""
    import statistics

    from zllm import LLM, SamplingParams

    llm = LLM(**asdict(engine_args_from(args)))
    vocab = llm.config.arch.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1)
    shared = random_prompts(1, args.prefix_len, vocab, seed=1)[0]
    llm.generate({"prompt_token_ids": shared + [300]}, one, use_tqdm=False)  # warm the cache
    cold, warm, cached = [], [], []
    for i in range(args.repeats):
        fresh = random_prompts(1, args.prefix_len, vocab, seed=100 + i)[0]
        suffix = random_prompts(1, args.suffix_len, vocab, seed=200 + i)[0]
        for prefix, times in ((fresh, cold), (shared, warm)):
            start = time.perf_counter()
            out = llm.generate({"prompt_token_ids": prefix + suffix}, one, use_tqdm=False)[0]
            times.append(time.perf_counter() - start)
            if prefix is shared:
                cached.append(out.num_cached_tokens)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    print(
        f"prefix {args.prefix_len} + suffix {args.suffix_len} tokens, median of {args.repeats}: "
        f"uncached {1000 * cold_s:.0f} ms, cached {1000 * warm_s:.0f} ms "
        f"({cold_s / warm_s:.1f}x faster; {statistics.median(cached):.0f} prompt tokens cached)"
    )
    return 0


def main_accuracy(args: argparse.Namespace) -> int:
    """Greedy parity rate and logprob drift of `--quantization` against fp32.

    Drift is measured by teacher forcing: both engines score the fp32 engine's own outputs
    (prompt logprobs of prompt + output), so the comparison is position by position.
    """
    import statistics

    from zllm import LLM, SamplingParams

    kv_dtype = engine_args_from(args).kv_cache_dtype
    measures_quantization = args.quantization not in (None, "none")
    if not measures_quantization and kv_dtype == "auto":
        raise ValueError(
            "bench accuracy compares a --quantization method or a --kv-cache-dtype against fp32"
        )
    engine = engine_args_from(args)
    # The reference differs in what is measured only: fp32 matmuls, or fp32 KV.
    quantization = "none" if measures_quantization else engine.quantization
    reference = LLM(**asdict(replace(engine, quantization=quantization, kv_cache_dtype="auto")))
    prompts = random_prompts(
        args.num_prompts, args.input_len, reference.config.arch.vocab_size, seed=7
    )
    # Real text too: random ids are an unusual input for a language model.
    tok = reference.get_tokenizer()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        "The three laws of thermodynamics are",
    ]
    prompts += [tok.encode(t) for t in texts]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    ref_out = [o.outputs[0].token_ids for o in reference.generate(reqs, greedy, use_tqdm=False)]
    forced = [{"prompt_token_ids": p + o} for p, o in zip(prompts, ref_out, strict=True)]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    ref_lp = reference.generate(forced, score, use_tqdm=False)
    del reference
    quant = LLM(**asdict(engine))
    q_out = [o.outputs[0].token_ids for o in quant.generate(reqs, greedy, use_tqdm=False)]
    if args.quantization in ("gguf", "gguf-int8"):
        # Its integer path may serve decode-sized calls only; score every position as decode
        # computes it (the matmuls that take integer dots at one row take them at every size).
        from zllm.executor.weights.quantization import set_int8_max_rows

        set_int8_max_rows(quant.model_runner.model, 1 << 30)
        # The fused decode step copied the row limit at load: the modules score from here on.
        quant.model_runner.fused_decode = None
    q_lp = quant.generate(forced, score, use_tqdm=False)

    same = sum(a == b for a, b in zip(ref_out, q_out, strict=True))
    first_div = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in zip(ref_out, q_out, strict=True)
    ]
    drifts = []
    for p, r, q in zip(prompts, ref_lp, q_lp, strict=True):
        for pos in range(len(p), len(r.prompt_token_ids)):
            t = r.prompt_token_ids[pos]
            drifts.append(
                abs(r.prompt_logprobs[pos][t].logprob - q.prompt_logprobs[pos][t].logprob)
            )
    measured = args.quantization if measures_quantization else f"{kv_dtype} KV"
    print(
        f"{measured} vs fp32 on {len(prompts)} prompts x {args.output_len} greedy tokens: "
        f"identical outputs {same}/{len(prompts)} ({100 * same / len(prompts):.0f}%), "
        f"median first divergence at token {statistics.median(first_div):.0f}, "
        f"logprob drift of the fp32 tokens: mean {statistics.mean(drifts):.4f}, "
        f"p99 {sorted(drifts)[int(0.99 * (len(drifts) - 1))]:.4f}, max {max(drifts):.4f} nats"
    )
    return 0
