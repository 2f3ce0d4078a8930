"""Weights fingerprints (zllm/model/fingerprint.py): KV blocks on disk and on the wire are
named by the weights' contents, not a file's name and size."""

from __future__ import annotations

import json
import os
import random

import pytest

from zllm import LLM, SamplingParams
from zllm.kv.tiers import TIER_DISK
from zllm.model.fingerprint import CACHE_FILE, weights_fingerprint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZLLM_CACHE", str(tmp_path / "cache"))


def model_dir(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")  # not a weights file: not hashed
    return str(path)


def test_same_name_and_size_with_other_weights_differ(tmp_path):
    a = model_dir(tmp_path / "a" / "m", b"\x01" * 4096)
    b = model_dir(tmp_path / "b" / "m", b"\x02" * 4096)  # same names, same sizes
    same = model_dir(tmp_path / "c" / "m", b"\x01" * 4096)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(a) == weights_fingerprint(same)
    (tmp_path / "a" / "m" / "tokenizer.json").write_text('{"other": 1}')
    assert weights_fingerprint(a) == weights_fingerprint(same)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    assert len(weights_fingerprint(str(gguf))) == 16


def test_digests_are_cached_and_any_write_is_hashed_anew(tmp_path):
    path = model_dir(tmp_path / "m", b"\x01" * 4096)
    first = weights_fingerprint(path)
    cache = json.loads((tmp_path / "cache" / CACHE_FILE).read_text())
    assert len(cache) == 2  # config.json and the weights, each under its inode, size, times
    weights = tmp_path / "m" / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as f:  # rewritten in place, same size, mtime set back
        f.write(b"\x02" * 4096)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert weights_fingerprint(path) != first  # its change time moved: hashed again


def test_replaced_weights_find_no_old_disk_blocks(tmp_path):
    """An HF directory whose weights are rewritten between runs (same files, same sizes):
    unchanged, a restarted engine loads its prompt's blocks from the disk tier; rewritten,
    it finds none there (another directory), and its outputs are the new weights'."""
    from conftest import write_tiny_model
    from kv_tiers import POOL_BYTES, flush_pool

    path = tmp_path / "model"
    write_tiny_model(path, seed=0)
    prompt = {"prompt_token_ids": [random.Random(3).randrange(3, 300) for _ in range(96)]}
    kw = dict(kv_cache_memory_bytes=POOL_BYTES, kv_offload_dir=str(tmp_path / "kv"),
              kv_offload_key_file=str(tmp_path / "key"))  # fmt: skip

    def serve_and_stop() -> tuple[list[int], int]:
        """The prompt's greedy tokens and its disk-tier hits; its blocks then go to disk."""
        llm = LLM(str(path), **kw)
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        hits = llm.engine.heartbeat().kv_tiers.hits[TIER_DISK]
        flush_pool(llm, random.Random(2))
        tier = llm.model_runner.kv_tiers.tiers[TIER_DISK]
        tier.flush()
        tier._lock_file.close()  # as when it exits
        return out, hits

    first, _ = serve_and_stop()
    again, hits = serve_and_stop()
    # The same weights: five of its six blocks from disk (the last is computed again, for
    # the last prompt token's logits).
    assert again == first and hits == 80
    sizes = {p.name: p.stat().st_size for p in path.iterdir()}
    write_tiny_model(path, seed=1)  # new weights in the same files, of the same sizes
    assert {p.name: p.stat().st_size for p in path.iterdir()} == sizes
    expected = (
        LLM(str(path), kv_cache_memory_bytes=POOL_BYTES)
        .generate([prompt], GREEDY, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    replaced, hits = serve_and_stop()
    assert hits == 0 and replaced == expected


def test_two_models_of_one_name_and_size_have_other_transfer_layouts(tmp_path):
    """Prefill/decode disaggregation: a consumer drops blocks whose header names another
    layout (executor/kv/transfer.py); two models with the same directory name and file
    sizes but other weights no longer share one."""
    from conftest import write_tiny_model

    from zllm.config.engine_args import EngineArgs
    from zllm.config.kv_layout import layout_fingerprint
    from zllm.executor.kv.transfer import transfer_layout

    configs = []
    for seed, where in ((0, "a"), (1, "b"), (0, "c")):
        write_tiny_model(tmp_path / where / "model", seed=seed)
        configs.append(EngineArgs(model=str(tmp_path / where / "model")).create_engine_config())
    a, b, same = configs
    assert transfer_layout(a) != transfer_layout(b)
    assert transfer_layout(a) == transfer_layout(same)  # the same weights elsewhere: shared
    assert layout_fingerprint(a) != layout_fingerprint(b)
