"""How a model's layers share the KV pool: KV cache groups (no torch; core and executor both
derive the same groups from the same ModelArchConfig).

A group is a set of layers that share one block table per request. All layers attending the
whole context can share one: they need the same tokens. A sliding-window layer needs only the
last `window` tokens, so its group frees blocks as they fall out of the window, while a full
group keeps every block. Mixing the two in one model (Gemma 3: five sliding layers to one
global) is the hybrid KV cache.

The pool is one set of block ids for every group, and every group has the same number of
layers (`group_size`), so a block means the same bytes whichever group holds it. The executor
allocates `group_size` cache tensors of `num_blocks` blocks each; layer `i` of every group
reads and writes tensor `i`:

    Gemma 3 270M, 18 layers (every 6th global):  group_size 3
        group 0  full      layers  5 11 17       tensors 0 1 2
        group 1  window    layers  0  1  2       tensors 0 1 2
        group 2  window    layers  3  4  6       ...
        ...      (6 groups: 1 full, 5 sliding)

A block held by group 1 stores K/V of layers 0, 1, 2 in tensors 0, 1, 2; the same block id
in group 0's table would hold layers 5, 11, 17 there instead, but a block belongs to one
group at a time. A request at 8K tokens holds 512 blocks in group 0 and about 33 in each
sliding group (window 512, block 16): 677 blocks of 3 layers, against 512 blocks of 18
layers without groups.

A hybrid model's state layers (arch.state: Qwen3-Next's linear attention) hold no K and V:
they are in no group, and keep their state in slots of their own (zllm/kv/state_layout.py).

When the sliding layers don't split evenly, the last group is short and leaves part of its
blocks' bytes unused (vLLM pads the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

from zllm.kv.kv_dtypes import row_bytes
from zllm.model.arch_config import ModelArchConfig


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # model layer indices; layer i here uses cache tensor i
    sliding_window: int | None  # None: keeps the whole context


def kv_cache_groups(arch: ModelArchConfig, hybrid: bool = True) -> list[KVCacheGroup]:
    """The model's KV cache groups. One group when every layer attends alike (a model with
    only sliding layers frees blocks too); with `hybrid` False, mixed models also get one
    group, which keeps every block (attention still applies each layer's window)."""
    layers = arch.attention_layers
    sliding = [i for i in layers if arch.is_sliding(i)]
    full = [i for i in layers if not arch.is_sliding(i)]
    if not sliding:
        return [KVCacheGroup(tuple(full), None)]
    if not full:
        return [KVCacheGroup(tuple(sliding), arch.sliding_window)]
    if not hybrid:
        return [KVCacheGroup(tuple(layers), None)]
    size = min(len(full), len(sliding))
    return [
        *(KVCacheGroup(tuple(full[i : i + size]), None) for i in range(0, len(full), size)),
        *(
            KVCacheGroup(tuple(sliding[i : i + size]), arch.sliding_window)
            for i in range(0, len(sliding), size)
        ),
    ]


def group_size(groups: list[KVCacheGroup]) -> int:
    """Layers per block: the cache tensors the executor allocates."""
    return max(len(g.layers) for g in groups)


def kv_bytes_per_slot(arch: ModelArchConfig, groups: list[KVCacheGroup], kv_dtype: str) -> int:
    """Bytes of one token slot of a block: K and V of group_size layers, stored as `kv_dtype`
    (kv_dtypes.py: an int8 row carries its scale)."""
    return 2 * group_size(groups) * arch.num_kv_heads * row_bytes(arch.head_dim, kv_dtype)
