"""`cache_salt` (vLLM's per-request option): a request's KV blocks are shared, through the
prefix cache, only with requests that give the same salt. The salt's rules are
zllm/kv/block_hash.py's `cache_salt`; the option travels in `RequestOptions`. Served: see
tests/test_api_surface.py; offline: tests/test_llm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zllm.config.engine import MAX_CACHE_SALT_CHARS, SchedulerConfig, check_request_options
from zllm.core.kv.block_manager import BlockManager
from zllm.errors import ParamError
from zllm.kv.block_hash import cache_salt, hash_full_blocks
from zllm.lora import LoRARequest
from zllm.protocol import EngineCoreRequest, RequestOptions
from zllm.sampling_params import SamplingParams

ADAPTER = LoRARequest("a", 1, "/a")


def test_salts_tell_options_apart_and_repeat_for_equal_ones():
    options = [
        RequestOptions(),
        RequestOptions(cache_salt="alice"),
        RequestOptions(cache_salt="bob"),
        RequestOptions(lora=ADAPTER),
        RequestOptions(lora=ADAPTER, cache_salt="alice"),
    ]
    salts = [cache_salt(o) for o in options]
    assert salts[0] is None  # the base model, unsalted: blocks shared with every such request
    assert len(set(salts)) == len(salts)
    assert [cache_salt(o) for o in options] == salts
    # Options that do not touch the cache (priority, tenant) leave the salt alone.
    assert cache_salt(RequestOptions(cache_salt="alice", priority=3, tenant="t")) == salts[1]
    tokens = list(range(32))
    chains = {tuple(hash_full_blocks(tokens, 8, salt=s)) for s in salts}
    assert len(chains) == len(salts)  # every block of the chain differs, not only the first


def test_blocks_are_found_only_under_the_same_salt():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    alice = cache_salt(RequestOptions(cache_salt="alice"))
    assert bm.allocate_slots("a", tokens, 0, 13, salt=alice)
    assert bm.find_cached_prefix(tokens, alice).num_tokens == 12
    assert (
        bm.find_cached_prefix(tokens, cache_salt(RequestOptions(cache_salt="bob"))).num_tokens == 0
    )
    assert bm.find_cached_prefix(tokens, None).num_tokens == 0


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 7])
def test_the_core_refuses_a_bad_salt_by_name(salt):
    config = SimpleNamespace(lora=None, scheduler=SchedulerConfig())  # what the check reads
    with pytest.raises(ParamError, match="cache_salt must be a non-empty string") as e:
        check_request_options(RequestOptions(cache_salt=salt), config)
    assert e.value.param == "cache_salt"


def test_the_salt_crosses_the_wire_whole():
    import msgspec

    req = EngineCoreRequest(
        "r", [1, 2, 3], SamplingParams(), options=RequestOptions(cache_salt="s")
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back.options.cache_salt == "s"
