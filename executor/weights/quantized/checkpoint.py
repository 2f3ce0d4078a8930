"""A quantized checkpoint's matrices as the CPU kernel's blocks, named as the model's
parameters (model.layers.0.self_attn.q_proj.weight), read module by module: every tensor
of a quantized matmul (qweight, scales, ...) becomes one entry of blocks; the checkpoint's
16-bit matrices (the embedding, lm_head, modules the config ignores) become F16/BF16 rows,
as a bf16 checkpoint's do. executor/weights/blocks.py takes it from there, as it takes a
GGUF file's blocks.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Container
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from zllm.config.quantization import CheckpointQuantization
from zllm.executor.weights.quantized import formats, to_blocks
from zllm.executor.weights.quantized.to_blocks import Blocks, UnservableWeight

logger = logging.getLogger(__name__)

# Tensors of a quantized matmul besides its weight (formats.py reads them); activation and
# KV-cache scales are read by nothing: the CPU kernels keep activations in fp32.
_QUANT_SUFFIXES = frozenset(
    {
        "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
        "weight_scale_inv", "qweight", "qzeros", "scales", "g_idx",
    }
)  # fmt: skip
_UNUSED_SUFFIXES = ("input_scale", "output_scale", "k_scale", "v_scale", "input_zero_point")
_STORED_QUANTIZED = (torch.int8, torch.float8_e4m3fn)
_SIXTEEN_BIT = {torch.float16: to_blocks.F16, torch.bfloat16: to_blocks.BF16}


@dataclass
class QuantizedCheckpoint:
    """What the kernels read of a quantized checkpoint (this pipeline stage's layers)."""

    blocks: dict[str, Blocks] = field(default_factory=dict)  # parameter name -> blocks
    quantized: set[str] = field(default_factory=set)  # the names of quantized matmuls
    input_orders: dict[str, torch.Tensor] = field(default_factory=dict)  # act-order
    stored_names: set[str] = field(default_factory=set)  # checkpoint tensors read here
    types: set[int] = field(default_factory=set)  # the block types made


def read_quantized_checkpoint(
    directory: str,
    quant: CheckpointQuantization,
    layers: Container[int] | None = None,
    tied_embeddings: bool = False,
) -> QuantizedCheckpoint:
    """Every quantized matmul of the checkpoint (of decoder layers `layers` only) as blocks,
    and its 16-bit matrices as rows (not lm_head where the embedding serves as the logits).
    Refuses (ValueError) a tensor it cannot read, naming it."""
    from zllm.executor.weights.loader import layer_of, safetensors_files

    with ExitStack() as stack:
        shards = [
            stack.enter_context(safe_open(str(f), "pt")) for f in safetensors_files(Path(directory))
        ]
        where = {name: shard for shard in shards for name in shard.keys()}
        modules: dict[str, dict[str, str]] = defaultdict(dict)  # module -> suffix -> full name
        for name in where:
            module, _, suffix = name.rpartition(".")
            modules[module][suffix] = name
        result = QuantizedCheckpoint()
        for module, names in modules.items():
            layer = layer_of(f"{module}.weight")
            if layers is not None and layer is not None and layer not in layers:
                continue
            if module == "lm_head" and tied_embeddings:
                continue
            result.stored_names.update(n for s, n in names.items() if s in _UNUSED_SUFFIXES)
            read = [s for s in names if _read(s, where[names[s]].get_slice(names[s]))]
            tensors = {s: where[names[s]].get_tensor(names[s]) for s in read}
            if tensors:
                _add_module(result, quant, module, names, tensors)
    return result


def _add_module(
    result: QuantizedCheckpoint,
    quant: CheckpointQuantization,
    module: str,
    names: dict[str, str],
    tensors: dict[str, torch.Tensor],
) -> None:
    """One module's tensors: a quantized matmul's as blocks, a 16-bit matrix as rows."""
    fmt = quant.format_of(module)
    quantized = set(tensors) & _QUANT_SUFFIXES or tensors["weight"].dtype in _STORED_QUANTIZED
    name = f"{module}.weight"
    if quantized and fmt is not None:
        _add_quantized(result, quant, fmt, module, tensors)
        result.stored_names.update(names[s] for s in tensors)
    elif quantized:
        raise ValueError(f"{name}: stored quantized, but quantization_config names no format")
    elif tensors["weight"].dtype in _SIXTEEN_BIT:
        weight = tensors["weight"]
        result.blocks[name] = (_SIXTEEN_BIT[weight.dtype], weight.view(torch.uint8).clone())


def _add_quantized(result, quant, fmt, module: str, tensors: dict[str, torch.Tensor]) -> None:
    name = f"{module}.weight"
    try:
        weight = formats.read_matmul(quant.method, quant.packing, fmt, module, tensors)
        if isinstance(weight, to_blocks.IntegerWeight):
            order = to_blocks.input_order(weight)
            blocks = to_blocks.integer_blocks(weight, order)
            if order is not None:
                result.input_orders[name] = order
        else:
            blocks = to_blocks.float_blocks(weight)
    except UnservableWeight as exc:
        raise ValueError(f"{name} ({fmt.describe()}): {exc}") from None
    result.blocks[name] = blocks
    result.quantized.add(name)
    result.types.add(blocks[0])


def _read(suffix: str, stored) -> bool:
    """Whether a tensor may become blocks: a matmul's weight (2-D: not a norm's) and its
    quantization tensors (not biases, which the loader copies). `stored`: its safetensors
    slice, whose header gives the shape without reading the data."""
    return suffix in _QUANT_SUFFIXES or (suffix == "weight" and len(stored.get_shape()) == 2)
