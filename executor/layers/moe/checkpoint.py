"""A mixture-of-experts layer's checkpoint names: the model's targets are each expert's own
tensors, transformers' naming (`mlp.experts.{e}.gate_proj.weight`, also what transformers 5
saves); per_expert_weights cuts a GGUF file's stacked tensors (`mlp.experts.gate_proj.weight`,
[E, out, in]) and transformers 5's fused in-memory ones (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) into those views, and spells Mixtral's names as Qwen-MoE's.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator

import torch

# A GGUF file's stacked expert tensors under our names ([E, out, in]; loader.py), and
# transformers 5's fused in-memory ones ([E, 2 x intermediate, hidden] and [E, hidden, inter]).
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)")
# Mixtral's checkpoint names -> Qwen-MoE's, which the model's targets use.
_MIXTRAL_NAMES = (
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    # (MiniMax-M2's router correction sits beside its gate)
    (
        re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"),
        ".mlp.gate.e_score_correction_bias",
    ),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
)


def expert_name(name: str) -> str:
    """A checkpoint's expert tensor name as the model's targets spell it (Mixtral's w1/w3/w2
    under block_sparse_moe -> gate_proj/up_proj/down_proj under mlp)."""
    if ".block_sparse_moe." in name:
        for pattern, replacement in _MIXTRAL_NAMES:
            name = pattern.sub(replacement, name)
    return name


def per_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with stacked and fused expert tensors cut into each expert's
    (views, no copy) and Mixtral's names as the targets spell them."""
    for name, tensor in weights:
        name = expert_name(name)
        stacked, fused = _STACKED.fullmatch(name), _FUSED.fullmatch(name)
        if stacked is not None and tensor.dim() == 3:
            prefix, proj = stacked.groups()
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.{proj}.weight", tensor[e]
        elif fused is not None and tensor.dim() == 3:
            prefix, proj = fused.groups()
            if proj == "down_proj":
                for e in range(tensor.shape[0]):
                    yield f"{prefix}{e}.down_proj.weight", tensor[e]
                continue
            for e in range(tensor.shape[0]):
                gate, up = tensor[e].chunk(2)
                yield f"{prefix}{e}.gate_proj.weight", gate
                yield f"{prefix}{e}.up_proj.weight", up
        else:
            yield name, tensor


def per_expert_names(names: Collection[str], num_experts: int) -> frozenset[str]:
    """`names` (the tensors GGUF blocks serve) with each stacked expert tensor's name
    replaced by its experts' own names, as per_expert_weights cuts it."""
    out = set()
    for name in names:
        stacked = _STACKED.fullmatch(name)
        if stacked is None:
            out.add(expert_name(name))
            continue
        prefix, proj = stacked.groups()
        out.update(f"{prefix}{e}.{proj}.weight" for e in range(num_experts))
    return frozenset(out)
