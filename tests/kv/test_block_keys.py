"""Block keys (zllm/kv/block_hash.py): the documented encoding, checked with hashlib, and why
they are 128 bits wide. A key names a KV block by its tokens: two token blocks under one key
make the engine serve one's KV for the other, and a client chooses its tokens."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from zllm import LLM, SamplingParams
from zllm.kv import block_hash
from zllm.kv.block_hash import NO_SALT, cache_salt, group_block_key, hash_full_blocks, key_to_int
from zllm.lora import LoRARequest
from zllm.protocol import ImageData, PlacedImage, RequestOptions


def sha16(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def ids(*token_ids: int) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def test_block_keys_follow_the_documented_encoding():
    first = sha16(bytes(16) + ids(1, 2, 3, 4))
    second = sha16(first + ids(5, 6, 7, 8))
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [first, second]  # 9: not full
    # A fixed vector too, so the encoding cannot drift with the code that computes both.
    assert first.hex() == "3a60ee17b8d4f5b7d56818719a9b6674"
    assert second.hex() == "e2a36f314815bd416651c87d7307f7cc"
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, known=[first]) == [first, second]
    big = 49_151  # ids past one byte, and past two, pack as 4 bytes little-endian
    assert hash_full_blocks([big, 70_000], 2) == [sha16(bytes(16) + ids(big, 70_000))]


def test_salts_follow_the_documented_encoding():
    alice = sha16(b"zllm-salt\0" + bytes(16) + b"alice")
    assert cache_salt(RequestOptions(cache_salt="alice")) == alice
    tenant = sha16(b"zllm-tenant\0" + bytes(16) + "t\u00e9".encode())
    both = sha16(b"zllm-salt\0" + tenant + b"alice")
    options = RequestOptions(cache_salt="alice", tenant="t\u00e9", isolate_tenant_cache=True)
    assert cache_salt(options) == both
    digest = bytes(range(16))
    adapter = sha16(b"zllm-lora\0" + bytes(16) + digest)
    lora = LoRARequest("a", 3, "/a", lora_digest=digest)
    assert cache_salt(RequestOptions(lora=lora)) == adapter
    assert cache_salt(RequestOptions(lora=LoRARequest("a", 3, "/a"))) == sha16(
        b"zllm-lora\0" + bytes(16) + b"id:3"
    )  # offline, before the files' digest is known
    assert hash_full_blocks([1, 2], 2, salt=alice) == [sha16(alice + ids(1, 2))]
    assert cache_salt(RequestOptions()) is None


def placed(digest: str) -> PlacedImage:
    """An image of that pixel digest whose 10 tokens start at position 3."""
    return PlacedImage(ImageData(b"", 1, 1, digest), offset=3, length=10)


def test_image_tokens_hash_as_their_image_per_the_documented_encoding():
    digest = hashlib.sha256(b"pixels").hexdigest()
    words = [int(digest[8 * k : 8 * k + 8], 16) | 0x80000000 for k in range(8)]
    # Text, then an image's 10 tokens at offset 3 (words 0..7, then 0, 1), then text.
    tokens = [5, 6, 7, *[99] * 10, 8, 9]
    hashed = block_hash.with_image_words(tokens, [placed(digest)])
    assert hashed == [5, 6, 7, *words, words[0], words[1], 8, 9]
    assert hash_full_blocks(hashed, 4)[0] == sha16(bytes(16) + ids(5, 6, 7, words[0]))
    other = block_hash.with_image_words(tokens, [placed(hashlib.sha256(b"other").hexdigest())])
    keys, other_keys = hash_full_blocks(hashed, 3), hash_full_blocks(other, 3)
    assert keys[0] == other_keys[0]  # the text before the image: one block
    assert all(a != b for a, b in zip(keys[1:], other_keys[1:], strict=True))


def test_group_keys_and_engine_spreading_follow_the_documented_encoding():
    key = hash_full_blocks([1, 2, 3, 4], 4)[0]
    assert group_block_key(key, 0) == key
    assert group_block_key(key, 2) == sha16(b"zllm-group\0" + key + (2).to_bytes(4, "little"))
    assert key_to_int(key) == int.from_bytes(key[:8], "little")


def test_block_keys_are_the_same_in_another_process():
    import subprocess
    import sys

    code = (
        "from zllm.kv.block_hash import hash_full_blocks;"
        "print(hash_full_blocks(list(range(100, 164)), 16)[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hash_full_blocks(list(range(100, 164)), 16)[-1].hex()


# ---- why the width matters -------------------------------------------------------------------
BS = 16
TRIES = 1 << 18  # a 32-bit key collides after ~2^16 tries (birthday bound); 128 bits: ~2^64


def birthday_search(key, tries: int = TRIES) -> tuple[list[int], list[int]] | None:
    """Two different first blocks (random tokens) with one key, as a client choosing its
    prompts would look for them; None if `tries` blocks found none."""
    rng = random.Random(7)
    seen: dict[bytes, list[int]] = {}
    for _ in range(tries):
        block = [rng.randrange(3, 400) for _ in range(BS)]
        other = seen.setdefault(key(NO_SALT, block), block)
        if other != block:
            return other, block
    return None


def narrowed_to_32_bits(parent: bytes, token_ids) -> bytes:
    return REAL_KEY(parent, token_ids)[:4]


REAL_KEY = block_hash.hash_block_tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
TAIL = [11, 12, 13, 14, 15, 16, 17, 18]


def serve_second_after_first(model: str, first: list[int], second: list[int]):
    """`second`'s output from an engine that served `first` just before (its blocks cached),
    and from one that never saw it."""
    llm = LLM(model, block_size=BS, kv_cache_memory_bytes=1 << 20)
    llm.generate([{"prompt_token_ids": first + TAIL}], GREEDY, use_tqdm=False)
    after = llm.generate([{"prompt_token_ids": second + TAIL}], GREEDY, use_tqdm=False)[0]
    fresh = LLM(model, block_size=BS, kv_cache_memory_bytes=1 << 20)
    alone = fresh.generate([{"prompt_token_ids": second + TAIL}], GREEDY, use_tqdm=False)[0]
    return after, alone


def test_a_32_bit_key_collides_and_serves_the_wrong_kv(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(block_hash, "hash_block_tokens", narrowed_to_32_bits)
    pair = birthday_search(narrowed_to_32_bits)
    assert pair is not None and pair[0] != pair[1]
    after, alone = serve_second_after_first(tiny_llama_dir, *pair)
    assert after.num_cached_tokens == BS  # the first prompt's block, taken for the second's
    assert after.outputs[0].token_ids != alone.outputs[0].token_ids  # wrong greedy output
    wrong, right = (o.outputs[0].logprobs[0] for o in (after, alone))
    assert wrong != right


def test_the_engines_keys_find_no_collision_and_outputs_stay_right(tiny_llama_dir):
    assert birthday_search(REAL_KEY) is None
    first, second = ([random.Random(seed).randrange(3, 400) for _ in range(BS)] for seed in (1, 2))
    after, alone = serve_second_after_first(tiny_llama_dir, first, second)
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("tokens", [[-1], [1 << 32]])
def test_a_token_id_outside_32_bits_is_refused_not_wrapped(tokens):
    with pytest.raises(struct.error):
        hash_full_blocks(tokens, 1)
