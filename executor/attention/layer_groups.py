"""Which KV cache group and which window each layer's attention reads: the key its step
metadata is built (and shared) by. A hybrid cache's groups (zllm/kv/cache_groups.py) give
each layer its block tables and its slot among the cache tensors; a sliding layer attends
within its window. The step's inputs (executor/step_inputs.py) build one metadata per
distinct key; the CUDA graphs capture one set of buffers per key (executor/graphs/). A
hybrid model's state layers read no KV: their key is STATE_LAYER, and their metadata is the
step's StateStep (executor/kv/state_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from zllm.kv.cache_groups import KVCacheGroup
from zllm.model.arch_config import ModelArchConfig


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """Which block tables and which view a layer's attention metadata is built from."""

    group: int  # its KV cache group: the block tables it reads (-1: a state layer)
    sliding_window: int | None  # its own window (a non-hybrid group may mix layers)
    attention_chunk: int | None = None  # its chunk, for chunked attention (Llama 4's)

    @property
    def is_state(self) -> bool:
        return self.group < 0


# A hybrid model's state layer: no block tables, its recurrent-state slots instead.
STATE_LAYER = LayerAttention(-1, None)


def layer_attention(
    arch: ModelArchConfig, groups: list[KVCacheGroup], layers: range
) -> list[LayerAttention]:
    """Per layer of `layers`, which block tables and window (or chunk) its attention uses."""
    group_of = {layer: g for g, group in enumerate(groups) for layer in group.layers}
    # (an MLP-only layer takes the state layers' metadata too, and reads none of it)
    return [
        STATE_LAYER
        if arch.is_state_layer(i) or arch.is_mlp_only(i)
        else LayerAttention(
            group_of[i],
            arch.sliding_window if arch.is_sliding(i) else None,
            arch.attention_chunk if i in arch.chunked_layers else None,
        )
        for i in layers
    ]


def layer_kv_slots(groups: list[KVCacheGroup], layers: range) -> dict[int, int]:
    """Layer -> the cache tensor it uses (its place in its group), for `layers`."""
    return {layer: slot for g in groups for slot, layer in enumerate(g.layers) if layer in layers}
