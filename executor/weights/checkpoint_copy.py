"""Copying a checkpoint's tensors into a model of ours: each Hugging Face name to the tensor
(or row slice of a fused matrix) it fills, cut to this rank's part first, refusing what does
not fit. Every model's load_weights ends here, with the targets its own module names.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

import torch
from torch import nn

from zllm.executor.parallel.shards import fill_tied_logits_shard, shard_weight
from zllm.executor.weights.loader import layer_of


def copy_checkpoint(
    model: nn.Module,
    targets: dict[str, torch.Tensor],
    weights: Iterable[tuple[str, torch.Tensor]],
    recomputed: tuple[str, ...] = (),
    served: Container[str] = frozenset(),
) -> None:
    """Copy Hugging Face-named checkpoint tensors into `targets` (name -> the tensor it
    fills), each cut to this rank's part first (model.tp); names ending in `recomputed`, a
    tied model's lm_head and the layers of other pipeline stages are skipped. Refuses
    unexpected names, wrong shapes and missing ones, but for `served` (GGUF blocks will
    serve those matrices: the loader skipped them, weight_blocks.BlockPlan)."""
    arch, tp = model.arch, model.tp
    layers = model.layer_indices
    loaded: set[str] = set()
    for name, tensor in weights:
        layer = layer_of(name)
        if layer is not None and layer not in layers:
            continue  # another pipeline stage's
        tensor = shard_weight(name, tensor, model.checkpoint_arch, tp)
        target = targets.get(name)
        if target is None:
            if (recomputed and name.endswith(recomputed)) or (
                name == "lm_head.weight" and arch.tie_word_embeddings
            ):
                continue  # recomputed by the model / the tied embedding serves as lm_head
            raise ValueError(f"unexpected weight {name!r} for a {arch.architecture} model")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        loaded.add(name)
        if name == "model.embed_tokens.weight":
            fill_tied_logits_shard(model.lm_head, tensor, arch, tp)
    missing = sorted(name for name in targets.keys() - loaded if name not in served)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")
