"""The hash chain that names a full KV block by its tokens (automatic prefix caching).

The core's block manager keys its prefix cache by it, the KV tiers name their blocks by it
(in memory, in files, across restarts), a producer server names the blocks it ships by it, and
with several data-parallel replicas the tokenizer workers hash each prompt the same way to find
the replica that holds its prefix. Two different token blocks with one key would make one
request compute on another's KV, and a client can choose its tokens: so a key is a
cryptographic hash, 128 bits wide wherever it is kept or travels (a birthday search needs
~2^64 tries; cut to 64 bits it would need ~2^32). Keys are `bytes` of `KEY_BYTES`: msgpack
carries them as they are (its ints stop at 64 bits), and any process computes the same key.

The encoding (tests/test_block_keys.py checks it against hashlib from this text):
- a block's key: the first 16 bytes of SHA-256(parent key || each token id as a 4-byte
  little-endian unsigned int), its parent the previous block's key, or for the first block
  the request's salt, or `NO_SALT` (16 zero bytes) without one;
- a salt: the first 16 bytes of SHA-256(tag || previous salt (NO_SALT for none) || value),
  chained in the order: LoRA adapter (tag b"zllm-lora\\0", value the 16-byte digest of its
  files, zllm/lora.py), tenant (under --prefix-cache-isolation tenant; b"zllm-tenant\\0", its
  name in UTF-8), `cache_salt` (b"zllm-salt\\0", in UTF-8);
- an image's placeholder tokens (a vision model's prompt) are hashed as words of the image's
  pixel digest instead of their id: its k-th token as the 32-bit big-endian word k mod 8 of
  the SHA-256 hex digest (`ImageData.digest`) with its top bit set (no token id has it), so a
  block's key names the images in it: equal text with other images never shares that block,
  and the text before a prompt's first image shares as any text does (`with_image_words`);
- a KV cache group's copy of a block in the tiers (the hybrid KV cache, group > 0): the first
  16 bytes of SHA-256(b"zllm-group\\0" || key || group as a 4-byte little-endian int).
SHA-256 is vLLM's default. Measured (benchmarks/block_key_cost.py, BENCHMARKS.md "Block
keys"): 62-64 ns per prompt token, against 19 for the tuple hash it replaced; a keyed BLAKE2b
is no faster, an unkeyed one saves 13 ns a token (0.1 ms on an 8,192-token prompt), not
enough to leave the standard every peer's users can check.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from zllm.protocol import PlacedImage, RequestOptions

BlockHash = bytes  # KEY_BYTES of a SHA-256 digest
KEY_BYTES = 16

# The first block's parent for a request without a salt.
NO_SALT: BlockHash = bytes(KEY_BYTES)
# Tags keep each kind of salt (and a group's copy) apart from the others and from block keys.
_LORA_TAG = b"zllm-lora\0"
_TENANT_TAG = b"zllm-tenant\0"
_SALT_TAG = b"zllm-salt\0"
_IMAGE_WORD = 0x80000000  # set on every image word: no token id has it
_GROUP_TAG = b"zllm-group\0"

# struct.Struct("<{n}I") per block length: packing a block's ids is most of a key's cost.
_packers: dict[int, struct.Struct] = {}


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chain a block's tokens onto its parent's key."""
    packer = _packers.get(len(token_ids))
    if packer is None:
        packer = _packers[len(token_ids)] = struct.Struct(f"<{len(token_ids)}I")
    return hashlib.sha256(parent_hash + packer.pack(*token_ids)).digest()[:KEY_BYTES]


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    known: list[BlockHash] | None = None,
    salt: BlockHash | None = None,
) -> list[BlockHash]:
    """Key chain of every full block of `token_ids`, extending the `known` prefix of it.

    `salt` is the first block's parent: the same tokens under another salt (a LoRA adapter's,
    a tenant's, `cache_salt`) hash apart, so their KV blocks are never shared."""
    hashes = list(known) if known else []
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else (NO_SALT if salt is None else salt)
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
    return hashes


def with_image_words(token_ids: Sequence[int], images: Sequence[PlacedImage]) -> list[int]:
    """`token_ids` as the prefix cache hashes them: each image's tokens as words of its
    pixel digest (the encoding above)."""
    ids = list(token_ids)
    for image in images:
        digest = image.image.digest
        words = [int(digest[8 * k : 8 * k + 8], 16) | _IMAGE_WORD for k in range(8)]
        for k in range(max(0, min(image.length, len(ids) - image.offset))):
            ids[image.offset + k] = words[k % 8]
    return ids


def group_block_key(block_hash: BlockHash, group: int) -> BlockHash:
    """What the KV tiers name one KV cache group's copy of a full block by. With several
    groups (the hybrid KV cache) the same tokens live in a block per group, each holding
    other layers' K/V; group 0's key is the block key itself, so a model with one group
    names its blocks as before."""
    if group == 0:
        return block_hash
    return hashlib.sha256(_GROUP_TAG + block_hash + group.to_bytes(4, "little")).digest()[
        :KEY_BYTES
    ]


def cache_salt(options: RequestOptions) -> BlockHash | None:
    """The prefix-cache salt of a request's blocks, from its options: its LoRA adapter's, its
    tenant's (under --prefix-cache-isolation tenant) and its `cache_salt`'s, chained; None
    for the base model with neither. Requests share blocks only under equal salts."""
    salt = None
    if options.lora is not None:  # its files' digest: alike on every server (lora.py)
        lora = options.lora
        # (offline, before the digest is filled in, the caller's id stands in)
        salt = _salt(_LORA_TAG, salt, lora.lora_digest or b"id:%d" % lora.lora_int_id)
    if options.isolate_tenant_cache:
        salt = _salt(_TENANT_TAG, salt, options.tenant.encode())
    if options.cache_salt is not None:
        salt = _salt(_SALT_TAG, salt, options.cache_salt.encode())
    return salt


def _salt(tag: bytes, previous: BlockHash | None, value: bytes) -> BlockHash:
    return hashlib.sha256(tag + (previous or NO_SALT) + value).digest()[:KEY_BYTES]


def key_to_int(block_hash: BlockHash) -> int:
    """A key as a non-negative int (its first 8 bytes, little-endian), for spreading keys
    over a few buckets (data-parallel engines): any 8 bytes of a SHA-256 are uniform."""
    return int.from_bytes(block_hash[:8], "little")
