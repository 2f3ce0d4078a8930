"""What the core and the executor both need to know about the KV cache tiers (no torch).

    tier   where                        bound                     survives
    cpu    the executor's memory        --kv-offload-bytes        nothing (a process restart)
    disk   --kv-offload-dir/<layout>/   --kv-offload-disk-bytes   restarts of the same layout
    remote the executor's memory, filled kv_buffer_size of         nothing
           by a prefill instance        --kv-transfer-config
           (disaggregation: executor/kv/transfer.py)

The core keeps each tier's index (which block hashes it holds, LRU: core/kv_connector.py),
the executor holds the bytes (executor/kv/connector.py). A block on disk is one file named
by its block hash, under a directory named by a fingerprint of everything that decides a
block's bytes (model file, dtype, block size, layout, quantization), so a directory shared
by several models, or outliving a change of flags, never hands one of them another's KV;
with a draft model (speculative decoding) a block is its layers' KV too, and the fingerprint
names the draft.
Block hashes are the same in every process (SHA-256 digests: zllm/kv/block_hash.py), so the
disk tier of a restarted engine still serves its prefixes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from zllm.config.engine import EngineConfig
from zllm.kv.block_hash import KEY_BYTES, BlockHash
from zllm.kv.cache_groups import kv_bytes_per_slot, kv_cache_groups
from zllm.kv.kv_dtypes import ELEMENT_BYTES
from zllm.model.fingerprint import weights_fingerprint

TIER_CPU = 0
TIER_DISK = 1
TIER_REMOTE = 2  # not stored into by the core: a producer fills it
TIER_NAMES = ("cpu", "disk", "remote")
# The tiers whose loads can fail (a damaged or missing file, a block the buffer dropped).
FALLIBLE_TIERS = (TIER_DISK, TIER_REMOTE)

BLOCK_FILE_SUFFIX = ".zkv"
# 2: adapters' blocks salted by their files' digest; 3: an HMAC (zllm/kv/tier_key.py), not a CRC;
# 4: 128-bit block keys (SHA-256), not Python's 64-bit tuple hash
FILE_FORMAT_VERSION = 4


def block_bytes(config: EngineConfig) -> int:
    """The bytes of one KV block: every layer's K and V for block_size tokens, a draft
    model's layers' too (its KV lives under the same block ids and moves with the block)."""
    groups = kv_cache_groups(config.arch, config.cache.hybrid_kv_cache)
    per_slot = kv_bytes_per_slot(config.arch, groups, config.kv_dtype)
    return (per_slot + draft_bytes_per_slot(config)) * config.cache.block_size


def draft_bytes_per_slot(config: EngineConfig) -> int:
    """A draft model's K and V of one token slot (0 without one): every layer of it, at the
    model dtype (the draft's cache is never narrowed), on every tensor-parallel rank."""
    spec = config.speculative
    if spec is None or spec.draft_arch is None:
        return 0
    arch = spec.draft_arch
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * ELEMENT_BYTES[config.dtype]


def layout_fingerprint(config: EngineConfig) -> str:
    """16 hex digits naming everything a block's bytes depend on."""
    arch = config.arch
    key: dict = {
        "version": FILE_FORMAT_VERSION,
        "model": weights_fingerprint(config.model_path),  # the weights' contents
        "load_format": config.load_format,
        "dtype": config.kv_dtype,
        "block_size": config.cache.block_size,
        "layout": [arch.num_layers, arch.num_kv_heads, arch.head_dim],
        "groups": len(kv_cache_groups(arch, config.cache.hybrid_kv_cache)),
        "quantization": str(config.quantization),
        "model_impl": config.model_impl,
        "deterministic": config.deterministic,
        "tensor_parallel": config.tensor_parallel_size,  # a rank's part of a block per file
    }
    if config.pipeline_parallel_size > 1:  # (only then: one stage's directory keeps its name)
        key["pipeline_parallel"] = config.pipeline_parallel_size  # a stage's layers per file
    draft = _draft_identity(config)
    if draft is not None:  # (only then: a single model's directory keeps its name)
        key["draft"] = draft
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _draft_identity(config: EngineConfig) -> list | None:
    """What a draft model's part of a block depends on, None without a draft model."""
    spec = config.speculative
    if spec is None or spec.draft_arch is None or spec.draft_model_path is None:
        return None
    arch = spec.draft_arch
    layout = [arch.architecture, arch.num_layers, arch.num_kv_heads, arch.head_dim]
    return [weights_fingerprint(spec.draft_model_path), *layout, config.dtype]


def tier_directory(config: EngineConfig, rank: int = 0) -> Path:
    """Where the disk tier of this engine's layout keeps its block files: with tensor-
    parallel ranks or pipeline stages, each executor rank (stage x tensor-parallel size +
    tensor-parallel rank) its part of every block (its KV heads of its stage's layers) in a
    directory of its own."""
    assert config.kv_offload is not None and config.kv_offload.disk_dir is not None
    directory = Path(config.kv_offload.disk_dir).expanduser() / layout_fingerprint(config)
    return directory / f"rank-{rank}" if config.world_size > 1 else directory


def blocks_on_every_rank(config: EngineConfig) -> list[BlockHash]:
    """The blocks every rank's disk tier directory holds, least recently written first (as
    rank 0 wrote them): what the core may ask the ranks to load after a restart."""
    order = existing_disk_blocks(tier_directory(config))
    held = set(order)
    for rank in range(1, config.world_size):
        held &= set(existing_disk_blocks(tier_directory(config, rank)))
    return [block_hash for block_hash in order if block_hash in held]


def block_file_name(block_hash: BlockHash) -> str:
    """A block hash as a file name: its 32 hex digits."""
    return f"{block_hash.hex()}{BLOCK_FILE_SUFFIX}"


def parse_block_file_name(name: str) -> BlockHash | None:
    """The block hash a file name holds, or None for a name that is not a block file."""
    digits = 2 * KEY_BYTES
    if not name.endswith(BLOCK_FILE_SUFFIX) or len(name) != digits + len(BLOCK_FILE_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:digits])
    except ValueError:
        return None


def existing_disk_blocks(directory: Path) -> list[BlockHash]:
    """The block hashes a tier directory holds, least recently written first (the order the
    disk tier's LRU starts from after a restart)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    found: list[tuple[int, BlockHash]] = []
    for entry in entries:
        block_hash = parse_block_file_name(entry.name)
        if block_hash is not None:
            try:
                found.append((entry.stat().st_mtime_ns, block_hash))
            except OSError:
                continue  # removed meanwhile
    return [block_hash for _, block_hash in sorted(found)]
