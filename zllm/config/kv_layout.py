"""What an engine's config decides of its KV blocks: their bytes, the fingerprint of their
layout, and the directory the disk tier keeps them in (zllm/kv/tiers.py has the tiers' rules).

Here, beside the config they read whole, rather than in zllm/kv/ (which sits below the config
and names no part of it): the core sizes its tiers with them, the executor finds its files,
EngineArgs refuses a tier that holds no block.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from zllm.config.engine import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from zllm.kv.block_hash import BlockHash
from zllm.kv.cache_groups import kv_bytes_per_slot, kv_cache_groups
from zllm.kv.kv_dtypes import ELEMENT_BYTES
from zllm.kv.state_layout import seats_for_state
from zllm.kv.tiers import FILE_FORMAT_VERSION, existing_disk_blocks
from zllm.model.fingerprint import weights_fingerprint

logger = logging.getLogger(__name__)


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


def check_moves_whole_blocks(config: EngineConfig, what: str) -> None:
    """What KV offload and disaggregation both ask of the engine: blocks named by their
    prefix-cache hashes. (With several KV cache groups a load that can fail is prefetched in
    a step of its own: core/kv/prefetch.py; a draft model's KV moves with the target's:
    executor/kv/pool.py.)"""
    if config.arch.state is not None:
        raise ValueError(
            f"{what} moves KV blocks, and {config.arch.architecture}'s state layers keep their "
            "recurrent state outside them (a hybrid model's state is not snapshotted yet)"
        )
    if not config.cache.enable_prefix_caching:
        raise ValueError(
            f"{what} names blocks by their prefix-cache hashes: it needs prefix caching "
            "(leave out --no-enable-prefix-caching)"
        )


def fit_state_slots(config: EngineConfig) -> None:
    """A hybrid model's recurrent-state slots (one per seat, and as many prefix snapshots)
    within half the KV cache's budget: fewer seats, logged, where they would not fit
    (zllm/kv/state_layout.py seats_for_state)."""
    budget = config.cache.kv_cache_memory_bytes
    if budget is None and not config.device.startswith("cuda"):
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    seats, why = seats_for_state(
        config.arch,
        config.scheduler.max_num_seqs,
        budget,
        snapshots=config.cache.enable_prefix_caching,
    )
    if why is not None:
        logger.warning(why)
        config.scheduler.max_num_seqs = seats
