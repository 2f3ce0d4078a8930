"""What the core and the executor both need to know about the KV cache tiers (no torch).

    tier   where                        bound                     survives
    cpu    the executor's memory        --kv-offload-bytes        nothing (a process restart)
    disk   --kv-offload-dir/<layout>/   --kv-offload-disk-bytes   restarts of the same layout
    remote the executor's memory, filled kv_buffer_size of         nothing
           by a prefill instance        --kv-transfer-config
           (disaggregation: executor/kv/transfer.py)

The core keeps each tier's index (which block hashes it holds, LRU: core/kv/connector.py),
the executor holds the bytes (executor/kv/connector.py). A block on disk is one file named
by its block hash, under a directory named by a fingerprint of everything that decides a
block's bytes (model file, dtype, block size, layout, quantization), so a directory shared
by several models, or outliving a change of flags, never hands one of them another's KV;
with a draft model (speculative decoding) a block is its layers' KV too, and the fingerprint
names the draft.
Block hashes are the same in every process (SHA-256 digests: zllm/kv/block_hash.py), so the
disk tier of a restarted engine still serves its prefixes. What an engine's config decides of
its blocks (their bytes, the layout's fingerprint, its tier directory) is computed from the
config in zllm/config/kv_layout.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from zllm.kv.block_hash import KEY_BYTES, BlockHash

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
