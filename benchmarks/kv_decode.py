"""A decode step's time at long context, per --kv-cache-dtype: what the KV cache's width buys.

Offline, one engine: `--batch` prompts of `--context` random tokens are prefilled once (one
output token), then decoded twice over their cached prefixes, to 2 and to 2 + `--steps`
tokens; the difference over `--steps` is one decode step of the whole batch, prefill and
prefix lookup cancelling out. Median of `--repeats`. Run one process per dtype (each engine
holds its own pool):

    for kv in auto bf16 int8; do
        python benchmarks/kv_decode.py smollm2 --kv-cache-dtype $kv --batch 1
        python benchmarks/kv_decode.py smollm2 --kv-cache-dtype $kv --batch 8
    done
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory-bytes", default="2G")
    args = parser.parse_args()

    from zllm import LLM, SamplingParams
    from zllm.config.arg_utils import parse_size

    llm = LLM(
        args.model,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory_bytes),
        max_model_len=args.context + args.steps + 8,
        max_num_seqs=max(args.batch, 1),
    )
    rng = random.Random(7)
    vocab = llm.config.arch.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(args.context)]}
        for _ in range(args.batch)
    ]

    def run(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(o.num_cached_tokens > 0 for o in outputs) or tokens == 1
        return time.perf_counter() - start

    run(1)  # the prefill, cached for the runs below
    steps = []
    for _ in range(args.repeats):
        short, long = run(2), run(2 + args.steps)
        steps.append((long - short) / args.steps)
    step = statistics.median(steps)
    print(
        json.dumps(
            {
                "model": args.model,
                "kv_cache_dtype": args.kv_cache_dtype,
                "context": args.context,
                "batch": args.batch,
                "step_ms": round(step * 1e3, 2),
                "steps_ms": [round(s * 1e3, 2) for s in steps],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
