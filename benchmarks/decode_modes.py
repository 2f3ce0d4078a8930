"""Decode speed of the CPU quantization modes, side by side in one process (issue 20).

Loads one `LLM` per mode (default `gguf-float` and `gguf`, the default's own arithmetic) and
decode path (`--paths`: the fused C++ decode step, the default, and/or the module path,
`ZLLM_FUSED_DECODE=0`) and, for ROUNDS rounds in rotated order, times a batch of BATCH random prompts of INPUT_LEN tokens:
the prefill (max_tokens=1) and the whole request (OUTPUT_LEN greedy tokens, ignore_eos);
time per output token = (whole - prefill) / (OUTPUT_LEN - 1). Prints each engine's median
TPOT and its speed relative to the first engine's.

    OMP_NUM_THREADS=2 python benchmarks/decode_modes.py --model smollm2 --batch 1 8
    OMP_NUM_THREADS=2 python benchmarks/decode_modes.py --modes gguf --paths fused module
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from zllm import LLM, SamplingParams


def tpot(llm: LLM, prompts: list[dict], output_len: int) -> float:
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    prefilled = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    done = time.perf_counter()
    return ((done - prefilled) - (prefilled - start)) / (output_len - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--modes", nargs="+", default=["gguf-float", "gguf"])
    parser.add_argument("--paths", nargs="+", default=["fused"], choices=["fused", "module"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engines = {}
    for mode in args.modes:
        for path in args.paths:
            # Read when the engine is built: each engine keeps the path it was built with.
            os.environ["ZLLM_FUSED_DECODE"] = "1" if path == "fused" else "0"
            engines[f"{mode}/{path}"] = LLM(
                args.model,
                quantization=mode,
                max_num_seqs=max(args.batch),
                enable_prefix_caching=False,
                max_model_len=2048,
            )
    os.environ.pop("ZLLM_FUSED_DECODE", None)
    labels = list(engines)
    vocab = engines[labels[0]].get_tokenizer().vocab_size
    rng = np.random.default_rng(0)
    for batch in args.batch:
        prompts = [
            {"prompt_token_ids": rng.integers(256, vocab - 1, args.input_len).tolist()}
            for _ in range(batch)
        ]
        for llm in engines.values():  # warm
            tpot(llm, prompts, 4)
        times: dict[str, list[float]] = {label: [] for label in labels}
        for r in range(args.rounds):
            order = labels[r % len(labels) :] + labels[: r % len(labels)]
            for label in order:
                times[label].append(tpot(engines[label], prompts, args.output_len))
        base = statistics.median(times[labels[0]])
        for label in labels:
            med = statistics.median(times[label])
            rounds = ", ".join(f"{t * 1e3:.1f}" for t in times[label])
            print(
                f"batch {batch:3d} {label:16s} TPOT median {med * 1e3:6.2f} ms "
                f"({base / med:.2f}x the first's speed; rounds: {rounds})"
            )


if __name__ == "__main__":
    main()
