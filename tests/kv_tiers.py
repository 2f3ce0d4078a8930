"""KV pools and tiers at test sizes, for the tests of offloading (a CPU or disk tier, a
consumer's remote buffer): a pool of random K/V, a scheduler-side connector, and on a real
engine traffic that pushes a prefix out of the pool, a damaged disk block, and outputs
compared with recomputing's."""

from __future__ import annotations

import hashlib
import hmac
import random
from pathlib import Path

import torch
from scheduler_parts import BS

from zllm import LLM, SamplingParams
from zllm.config.engine import KVOffloadConfig
from zllm.config.kv_layout import tier_directory
from zllm.core.kv.connector import TieredKVConnector
from zllm.executor.kv.connector import KVPool
from zllm.executor.kv.quant import narrow
from zllm.kv.block_hash import hash_full_blocks
from zllm.kv.tiers import TIER_DISK, block_file_name

POOL_BYTES = 64 * 8192  # the tiny model: 512 bytes a token, 8 KiB a block: 64 blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
DISK_HEADER_BYTES = 64  # magic, version, hash, size, then the 32-byte MAC


def tiered_connector(cpu_blocks: int = 0, disk_blocks: int = 0, on_disk=()) -> TieredKVConnector:
    """The scheduler's side of a CPU and a disk tier of that many 100-byte blocks, the disk
    holding `on_disk` already."""
    config = KVOffloadConfig(
        cpu_bytes=cpu_blocks * 100, disk_dir="/unused" if disk_blocks else None,
        disk_bytes=disk_blocks * 100,
    )  # fmt: skip
    return TieredKVConnector(config, block_bytes=100, disk_blocks=on_disk)


def make_pool(num_blocks: int = 8, layers: int = 3, dtype=torch.float32) -> KVPool:
    """A pool of random K/V of head_dim 8 stored as `dtype` (int8: quantized rows, 10 bytes)."""
    gen = torch.Generator().manual_seed(5)
    return KVPool(
        [narrow(torch.randn(2, num_blocks, BS, 2, 8, generator=gen), dtype) for _ in range(layers)]
    )


def random_prompt(rng: random.Random, n: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(n)]}


def flush_pool(llm: LLM, rng: random.Random) -> None:
    """Other traffic: more distinct prompts than the pool holds."""
    for _ in range(3):
        llm.generate([random_prompt(rng, 300) for _ in range(2)], GREEDY, use_tqdm=False)


def assert_same_outputs(ours, reference) -> None:
    """The same tokens, and logprobs within 1e-4."""
    assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
    for a, b in zip(ours.outputs[0].logprobs, reference.outputs[0].logprobs, strict=True):
        for token, lp in b.items():
            assert abs(a[token].logprob - lp.logprob) < 1e-4


def damage_a_disk_block(llm: LLM, prompt: dict, forge_key: bytes | None = None) -> Path:
    """Serve `prompt`, push its blocks out of the pool to the disk tier, and flip one bit of
    its 8th block's file (in the middle of its prefix; a hybrid model's full group's): the
    file's path. With `forge_key`, the header's MAC is then recomputed under that key, as
    someone who can write the directory but does not hold the tier's key would."""
    llm.generate([prompt], GREEDY, use_tqdm=False)
    flush_pool(llm, random.Random(2))
    llm.model_runner.kv_tiers.tiers[TIER_DISK].flush()
    hashes = hash_full_blocks(prompt["prompt_token_ids"][:240], 16)
    victim = tier_directory(llm.config) / block_file_name(hashes[7])
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x01
    if forge_key is not None:
        mac = hmac.new(forge_key, bytes(data[: DISK_HEADER_BYTES - 32]), hashlib.sha256)
        mac.update(bytes(data[DISK_HEADER_BYTES:]))
        data[DISK_HEADER_BYTES - 32 : DISK_HEADER_BYTES] = mac.digest()
    victim.write_bytes(bytes(data))
    return victim
