"""Which proposer speculative decoding uses (config.speculative), made by the model host
with the KV pool (a draft model's KV shares its block ids)."""

from __future__ import annotations

import torch

from zllm.config.engine import EngineConfig
from zllm.executor.spec_decode.draft_model import DraftModelProposer
from zllm.executor.spec_decode.ngram import NgramProposer
from zllm.kv.cache_groups import kv_cache_groups

Proposer = NgramProposer | DraftModelProposer


def make_proposer(config: EngineConfig, num_blocks: int, dtype: torch.dtype) -> Proposer | None:
    """Speculative decoding's proposer (config.speculative), None without speculation."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    if spec.method == "draft_model":
        groups = kv_cache_groups(config.arch, config.cache.hybrid_kv_cache)
        if groups[0].sliding_window is not None:
            raise ValueError(
                "speculative draft_model needs a target with full-attention layers (the draft "
                "reads the first KV cache group's block tables)"
            )
        return DraftModelProposer(config, num_blocks, dtype)
    raise ValueError(f"speculative method {spec.method!r} is not available")
