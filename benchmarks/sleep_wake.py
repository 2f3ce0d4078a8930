"""Sleep mode's cost per level: how long `sleep(level)` and `wake_up()` take and how much
resident memory sleeping releases, offline (the served path runs the same EngineCore calls).
Median of `--repeats`; the KV pool is written once first so it is resident.

    python benchmarks/sleep_wake.py smollm2 [--kv-cache-memory-bytes 1G] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def touch_pool(llm) -> None:
    """Write the whole KV pool, so it is resident as a pool in use is (a function: a loop
    variable left in main() would keep a pool tensor alive through the sleep)."""
    for tensor in llm.model_runner.kv_tensors:
        tensor.fill_(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kv-cache-memory-bytes", default="1G")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from zllm import LLM, SamplingParams
    from zllm.config.arg_utils import parse_size

    llm = LLM(
        args.model,
        enable_sleep_mode=True,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory_bytes),
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = "Sleep mode releases memory while the engine is idle."
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    touch_pool(llm)
    results = {}
    for level in (1, 2):
        sleeps, wakes, released = [], [], []
        for _ in range(args.repeats):
            before = resident_bytes()
            start = time.perf_counter()
            llm.sleep(level=level)
            sleeps.append(time.perf_counter() - start)
            released.append(before - resident_bytes())
            start = time.perf_counter()
            llm.wake_up()
            wakes.append(time.perf_counter() - start)
            touch_pool(llm)
            again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            assert again == expected, "outputs after waking differ"
        results[f"level{level}"] = {
            "sleep_s": round(statistics.median(sleeps), 3),
            "wake_s": round(statistics.median(wakes), 3),
            "released_mib": round(statistics.median(released) / 2**20, 1),
        }
    print(
        json.dumps(
            {"model": args.model, "kv_cache_memory_bytes": args.kv_cache_memory_bytes, **results}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
