"""What naming KV blocks costs per prompt token: the 128-bit SHA-256 keys the engine uses
(zllm/kv/block_hash.py) against Python's 64-bit tuple hash they replaced, and the candidates
the issue named (BLAKE2b, keyed and not), in the same run.

The tokenizer workers hash each prompt once (data-parallel routing, disaggregation), and the
core hashes it at admission (prefix lookup) and as blocks fill: a prompt of n tokens costs
about n x (the figure) in each. Prompts of `--tokens` random ids from a 49,152-token
vocabulary, `--block-size` tokens a block.

    python benchmarks/block_key_cost.py [--tokens 1024 --block-size 16]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import struct
import time
from collections.abc import Callable, Sequence

from zllm.kv.block_hash import hash_full_blocks

Chain = Callable[[Sequence[int], int], list]


def tuple_hash_chain(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The keys before issue 39: hash((parent, tuple(ids))), 64 bits."""
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = keys[-1] if keys else 0
        keys.append(hash((parent, tuple(token_ids[start : start + block_size]))))
    return keys


def blake2b_chain(key: bytes = b"") -> Chain:
    def chain(token_ids: Sequence[int], block_size: int) -> list[bytes]:
        pack = struct.Struct(f"<{block_size}I").pack
        keys: list[bytes] = []
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            data = (keys[-1] if keys else bytes(16)) + pack(*token_ids[start : start + block_size])
            keys.append(hashlib.blake2b(data, digest_size=16, key=key).digest())
        return keys

    return chain


def ns_per_token(chain: Chain, prompts: list[list[int]], block_size: int, runs: int = 9) -> float:
    """Median over `runs` of the nanoseconds per prompt token to key every prompt's blocks."""
    tokens = sum(len(p) for p in prompts)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for prompt in prompts:
            chain(prompt, block_size)
        times.append((time.perf_counter() - start) / tokens * 1e9)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompts", type=int, default=200)
    args = p.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(49_152) for _ in range(args.tokens)] for _ in range(args.prompts)]
    rows = [
        ("tuple hash, 64-bit (before)", tuple_hash_chain),
        ("SHA-256, 128-bit (the engine's)", hash_full_blocks),
        ("BLAKE2b, 128-bit", blake2b_chain()),
        ("BLAKE2b keyed, 128-bit", blake2b_chain(bytes(range(32)))),
    ]
    base = None
    print(f"{args.prompts} prompts of {args.tokens} tokens, block size {args.block_size}")
    for name, chain in rows:
        ns = ns_per_token(chain, prompts, args.block_size)
        base = base or ns
        print(
            f"{name:34s} {ns:7.1f} ns/token  {ns / base:5.2f}x  {ns * args.tokens / 1e6:.3f} ms/prompt"
        )


if __name__ == "__main__":
    main()
