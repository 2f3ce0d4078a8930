"""The hash chain that names a full KV block by its tokens (automatic prefix caching).

The core's block manager keys its prefix cache by it, the KV tiers name their blocks by it,
and with several data-parallel replicas the tokenizer workers hash each prompt the same way to
find the replica that holds its prefix. So a hash must not depend on the process computing
it: only ints and tuples of ints go into Python's `hash` (a `str` or `None` hashes
differently in every process, under hash randomization and address layout).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from zllm.protocol import RequestOptions

BlockHash = int

# The first block's parent for a request without a salt; any fixed int would do.
NO_SALT: BlockHash = 0
# Tag the salts of a LoRA adapter's blocks and of a request's `cache_salt` (fixed ints:
# "LoRA" and "Salt" in ASCII).
_LORA_TAG = 0x4C6F5241
_SALT_TAG = 0x53616C74
# Tags the salt of a tenant's blocks under --prefix-cache-isolation tenant ("Tent").
_TENANT_TAG = 0x54656E74
# Tags a KV cache group's copy of a block in the KV tiers ("Grup" in ASCII).
_GROUP_TAG = 0x47727570


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chain a block's tokens onto its parent's hash."""
    return hash((parent_hash, tuple(token_ids)))


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    known: list[BlockHash] | None = None,
    salt: BlockHash | None = None,
) -> list[BlockHash]:
    """Hash chain of every full block of `token_ids`, extending the `known` prefix of it.

    `salt` is the first block's parent: the same tokens under another salt (a LoRA adapter's,
    `cache_salt`) hash apart, so their KV blocks are never shared."""
    hashes = list(known) if known else []
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else (NO_SALT if salt is None else salt)
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
    return hashes


def group_block_key(block_hash: BlockHash, group: int) -> BlockHash:
    """What the KV tiers name one KV cache group's copy of a full block by. With several
    groups (the hybrid KV cache) the same tokens live in a block per group, each holding
    other layers' K/V; group 0's key is the block hash itself, so a model with one group
    names its blocks as before."""
    return block_hash if group == 0 else hash((_GROUP_TAG, block_hash, group))


def cache_salt(options: RequestOptions) -> BlockHash | None:
    """The prefix-cache salt of a request's blocks, from its options: its LoRA adapter's, its
    tenant's (under --prefix-cache-isolation tenant) and its `cache_salt`'s, chained; None
    for the base model with neither. Requests share blocks only under equal salts."""
    salt = None
    if options.lora is not None:  # its files' digest: alike on every server (lora.py)
        lora = options.lora
        salt = hash((_LORA_TAG, lora.lora_digest or lora.lora_int_id))
    if options.isolate_tenant_cache:
        salt = hash((_TENANT_TAG, salt or NO_SALT, _text_digest(options.tenant)))
    if options.cache_salt is not None:
        salt = hash((_SALT_TAG, salt or NO_SALT, _text_digest(options.cache_salt)))
    return salt


def _text_digest(text: str) -> int:
    """A str hashes differently in every process: its bytes' digest is the same in all."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
