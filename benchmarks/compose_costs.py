"""What a combination of features costs against its parts, offline (issue 38).

Runs `zllm bench throughput` on one model for each configuration below, ROUNDS times,
interleaved (this machine's speed drifts within minutes, so each round runs every
configuration once before the next), and prints a markdown table: output tok/s per round, the
median, and the median against the configuration's parts (the layout alone, the feature
alone).

    python benchmarks/compose_costs.py --rounds 3
    python benchmarks/compose_costs.py --rounds 3 --only tp3 tp3+ngram

The speculative configuration is ngram (prompt lookup) with 4 tokens: on random prompts it
finds few matches, so its row measures what proposing and verifying cost, not a speed-up
(benchmarks/spec_decode.sh measures the gain on repetitive text). The tier rows run 4
requests at a time in a pool of ~91 blocks with a CPU tier every evicted block is stored to,
no prefix shared: the cost of the stores against the same pool without a tier, not a hit's
gain (benchmarks/kv_offload.py measures hits).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
TP3 = ["--tensor-parallel-size", "3"]  # SmolLM2: 9 query heads, 3 KV heads
PP2 = ["--pipeline-parallel-size", "2"]


def pool(share: int) -> list[str]:
    """~91 blocks of SmolLM2 in each rank's pool (64 MiB for the whole model's layers and
    heads, a rank holding 1/share of them) and 4 requests at a time: the finished requests'
    cached blocks are evicted while the others run."""
    return ["--kv-cache-memory-bytes", str((64 << 20) // share), "--max-num-seqs", "4"]


def tier(share: int) -> list[str]:
    """pool(share) and a CPU tier of 4x its size, which every evicted block is stored to."""
    return [*pool(share), "--kv-offload-bytes", str((256 << 20) // share)]


# name -> (flags, its parts: the configurations it is compared with)
CONFIGS: dict[str, tuple[list[str], list[str]]] = {
    "one-rank": ([], []),
    "ngram": (["--speculative-config", NGRAM], ["one-rank"]),
    "small-pool": (pool(1), ["one-rank"]),
    "cpu-tier": (tier(1), ["small-pool"]),
    "tp3": (TP3, ["one-rank"]),
    "tp3+ngram": (TP3 + ["--speculative-config", NGRAM], ["tp3", "ngram"]),
    "tp3+small-pool": (TP3 + pool(3), ["tp3", "small-pool"]),
    "tp3+cpu-tier": (TP3 + tier(3), ["tp3+small-pool", "cpu-tier"]),
    "pp2": (PP2, ["one-rank"]),
    "pp2+ngram": (PP2 + ["--speculative-config", NGRAM], ["pp2", "ngram"]),
    "pp2+small-pool": (PP2 + pool(2), ["pp2", "small-pool"]),
    "pp2+cpu-tier": (PP2 + tier(2), ["pp2+small-pool", "cpu-tier"]),
    "transformers": (["--model-impl", "transformers"], ["one-rank"]),
    "transformers+tp3": (["--model-impl", "transformers"] + TP3, ["transformers", "tp3"]),
}

_RATE = re.compile(r"([\d.]+) output tok/s")


def run(model: str, flags: list[str], args: argparse.Namespace) -> float:
    command = [
        sys.executable, "-m", "zllm.cli", "bench", "throughput", "--model", model,
        "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), *flags,
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=900)
    found = _RATE.findall(out.stdout + out.stderr)
    if out.returncode != 0 or not found:
        raise SystemExit(f"{' '.join(command)} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return float(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="these configurations")
    args = parser.parse_args()
    names = args.only or list(CONFIGS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            rates[name].append(run(args.model, CONFIGS[name][0], args))
            print(f"round {round_ + 1} {name}: {rates[name][-1]:.1f} output tok/s", flush=True)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    print("\n| configuration | flags | output tok/s per round | median | against its parts |")
    print("|---|---|---|---|---|")
    for name in names:
        flags, parts = CONFIGS[name]
        against = ", ".join(f"{medians[name] / medians[p]:.2f}x {p}" for p in parts if p in medians)
        shown = " ".join(flags).replace(NGRAM, "ngram(4)")
        runs = ", ".join(f"{r:.1f}" for r in rates[name])
        print(f"| {name} | `{shown}` | {runs} | {medians[name]:.1f} | {against or '-'} |")


if __name__ == "__main__":
    main()
