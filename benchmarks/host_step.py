"""The executor's host work per step besides the forward, by part, at a given batch size.

On a GPU the executor's Python is what the asynchronous executor must hide behind the
kernels (issue 41: at concurrency 64 the host's step is the longer one). That Python is the
same on any machine, so it is timed here on CPU, with a tiny random model whose forward is
negligible: the offline engine decodes `--rows` requests together, and each part of the
step is timed by a wrapper around it (medians over every step of the run).

    python benchmarks/host_step.py --rows 64 --steps 128
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# The parts of a step, as (object, attribute, label): the inputs (ids, positions,
# attention metadata), which requests sample and their rows, logits + processors +
# sampler, the output's packing.
PARTS = [
    ("zllm.executor.model_runner", "prepare_inputs", "inputs + metadata"),
    ("zllm.executor.sample.step_sampler:StepSampler", "choose_rows", "sample rows"),
    ("zllm.executor.sample.step_sampler:StepSampler", "sample", "logits + sampling"),
    ("zllm.executor.sample.step_sampler:StepSampler", "pack", "pack"),
]


def wrap_parts(times: dict[str, list[float]]) -> None:
    import importlib

    for where, attr, label in PARTS:
        module, _, cls = where.partition(":")
        owner = (
            getattr(importlib.import_module(module), cls)
            if cls
            else importlib.import_module(module)
        )
        original = getattr(owner, attr)

        def timed(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            out = _original(*args, **kwargs)
            times[_label].append(time.perf_counter() - start)
            return out

        setattr(owner, attr, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="requests decoding together")
    parser.add_argument("--steps", type=int, default=128, help="output tokens per request")
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args()

    from tiny_models import write_tiny_model

    from zllm import LLM, SamplingParams

    path = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    times: dict[str, list[float]] = defaultdict(list)
    wrap_parts(times)
    llm = LLM(str(path), kv_cache_memory_bytes=256 << 20, max_num_seqs=args.rows)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(args.prompt_len)]}
        for _ in range(args.rows)
    ]
    params = SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    times.clear()
    llm.generate(prompts, params, use_tqdm=False)
    print(f"{args.rows} rows, {args.steps} decode steps (medians over the run's steps, ms):")
    total = 0.0
    for _, _, label in PARTS:
        median = statistics.median(times[label]) * 1e3
        total += median
        print(f"  {label:20s} {median:7.3f}   ({len(times[label])} steps)")
    print(f"  {'sum':20s} {total:7.3f}")


if __name__ == "__main__":
    main()
