"""Quantized matmuls for the transformers backend: after from_pretrained, transformers' own
nn.Linear modules and the embedding are swapped one by one for the modules that read weight
blocks through the CPU kernel (executor/layers/linear/gguf.py), as LoRA wraps them.

Which tensor serves a module comes from transformers itself, so no table per architecture:

  - a GGUF file: transformers' GGUF loader's map (get_gguf_hf_weights_map over gguf-py's
    TensorNameMap) names the GGUF tensor behind each parameter, and the loader's tensor
    processor is applied to the tensor's raw rows (Llama's q/k row order: a row permutation
    moves whole rows, and GGUF blocks run along a row, so it applies to the bytes unchanged);
  - a bf16/fp16 checkpoint directory: the safetensors tensor of the parameter's own name.

Every swap is checked: the blocks must dequantize bit for bit to the fp32 weight transformers
loaded (the kernel then multiplies by exactly those values). A matrix the kernel cannot serve
(a type it lacks, a shape or a processor that does not map whole rows, a name not found)
keeps its fp32 module, and the log says which and why. The fp32 tensor a swap replaces is
dropped with its module (executor/host/model_weights.py releases the freed memory).

`int8` (Q8_0 blocks made at load, executor/weights/quantization.py) takes the same modules
zllm's own models give it: the q/k/v, output, gate/up and down projections, found by their
role in gguf-py's name map.

Over tensor-parallel ranks the names are read on the whole model and the swap runs on the
rank's cut of it (tp.py): a matmul cut by output rows reads those rows' blocks,
one cut by input columns reads each row's blocks over its columns when they start and stop
on block boundaries (else it keeps its fp32 part, logged), as zllm's own models' ranks do
(executor/parallel/shards.py shard_blocks).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.layers.linear.gguf import GGUFEmbedding, GGUFLinear
from zllm.executor.layers.linear.parallel import RankPart
from zllm.executor.weights.gguf_reading import gguf_parsed_once
from zllm.executor.weights.quantization import int8_linear
from zllm.model.gguf import read_gguf

logger = logging.getLogger(__name__)

Blocks = tuple[int, torch.Tensor]  # (ggml type id, rows as uint8 [rows, bytes per row])
# The GGUF roles (blk.N.<role>.weight) int8 quantizes: the decoder's matmuls, as on zllm's
# own models (not the logits).
_INT8_ROLES = frozenset(
    {"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
)


class TransformersQuantization:
    """`method`'s swap for a transformers model, prepared on the whole model (the checkpoint
    tensor behind each parameter is found by name: transformers' GGUF map walks the model's
    state dict, whose names a tensor-parallel cut changes) and applied after any cut, each cut
    matmul then reading its rank's part of the blocks (RankPart, layers/linear/parallel.py)."""

    def __init__(self, hf_model: nn.Module, model_path: str, method: str) -> None:
        self.method = method
        self.roles: dict[str, str] = {}
        self.source: _GGUFBlocks | _SixteenBitRows | None = None
        if method == "int8":
            self.roles = _int8_roles(hf_model)
            cpu_kernels.load()
        elif method != "none":  # gguf, gguf-float, gguf-int8, or a 16-bit checkpoint's rows
            cpu_kernels.load()  # built (or loaded) first: a failure surfaces here, once
            gguf = model_path.endswith(".gguf")
            self.source = _GGUFBlocks(hf_model, model_path) if gguf else _SixteenBitRows(model_path)

    def apply(self, hf_model: nn.Module) -> None:
        """Swap the (possibly cut) model's matmuls for the method's modules, in place."""
        if self.method == "int8":
            _int8_model_(hf_model, self.roles)
        elif self.source is not None:
            swapper = _Swapper(hf_model, self.source, self.method)
            for parent, attr, name, module in list(_leaf_modules(hf_model)):
                swapper.swap(parent, attr, name, module)
            gguf = isinstance(self.source, _GGUFBlocks)
            swapper.log("GGUF blocks" if gguf else "16-bit rows widened in the kernel")


# ---------------------------------------------------------------------------------------------
# Where each parameter's blocks come from


def gguf_names_of(hf_model: nn.Module, processor: Any) -> dict[str, str]:
    """Parameter name -> GGUF tensor name, by transformers' GGUF loader's own map (which
    visits every submodule: gguf_parsed_once builds gguf-py's name map once for them)."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with gguf_parsed_once():
        names = get_gguf_hf_weights_map(hf_model, processor)
    return {hf: name for name, hf in names.items()}


class _GGUFBlocks:
    """A GGUF file's blocks for each parameter, as transformers' loader maps and orders them."""

    def __init__(self, hf_model: nn.Module, model_path: str) -> None:
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.gguf = read_gguf(model_path)
        architecture = self.gguf.metadata.get("general.architecture", "")
        processor_cls = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
        self.processor = processor_cls(config=hf_model.config.to_dict())
        self.names = gguf_names_of(hf_model, self.processor)

    def blocks(self, param: str) -> Blocks | str:
        """The parameter's blocks, or why there are none the kernel reads."""
        name = self.names.get(param)
        info = None if name is None else self.gguf.tensors.get(name)
        if info is None:
            return f"no GGUF tensor for {param}"
        if len(info.shape) != 2:
            return f"tensor {name!r} has {len(info.shape)} dimensions"
        if int(info.ggml_type) not in cpu_kernels.SUPPORTED_GGML_TYPES:
            return f"tensor {name!r} is {info.ggml_type.name}, a type the kernel does not read"
        try:  # the loader's own reordering, on whole rows of blocks
            out = self.processor.process(
                weights=self.gguf.tensor_data(name),
                name=name,
                tensor_key_mapping={},
                parsed_parameters={"tensors": {}, "config": {}},
            )
        except (ValueError, KeyError, IndexError, TypeError):  # one that needs the values
            return f"transformers' processing of {name!r} does not act on whole rows"
        if out.weights is None or out.weights.ndim != 2:
            return f"transformers' processing of {name!r} does not keep a matrix"
        rows = np.array(out.weights, dtype=np.uint8)  # a copy: the file's pages are released
        return int(info.ggml_type), torch.from_numpy(rows)


class _SixteenBitRows:
    """A checkpoint directory's bf16/fp16 matrices as F16/BF16 rows, read one by one."""

    _TYPES = {torch.float16: 1, torch.bfloat16: 30}  # ggml type ids, as loader.py's

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open

        self.file_of: dict[str, str] = {}
        for file in sorted(Path(directory).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as shard:
                self.file_of.update({name: str(file) for name in shard.keys()})

    def blocks(self, param: str) -> Blocks | str:
        from safetensors import safe_open

        file = self.file_of.get(param)
        if file is None:
            return f"no checkpoint tensor named {param}"
        with safe_open(file, framework="pt") as shard:
            tensor = shard.get_tensor(param)
        if tensor.dtype not in self._TYPES or tensor.dim() != 2:
            return f"{param} is {tensor.dtype} of {tensor.dim()} dimensions"
        # A copy: get_tensor's tensor maps the file, whose pages would stay resident.
        return self._TYPES[tensor.dtype], tensor.view(torch.uint8).clone()


# ---------------------------------------------------------------------------------------------
# The swap


def _leaf_modules(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, nn.Module]]:
    """(parent, attribute, qualified name, module) of every plain nn.Linear (exact type: a
    subclass may do more in its forward) and every nn.Embedding (subclasses too: a scaled
    one is served if it checks out, _embedding_of)."""
    for name, module in model.named_modules():
        if type(module) is nn.Linear or isinstance(module, nn.Embedding):
            parent_name, _, attr = name.rpartition(".")
            yield model.get_submodule(parent_name), attr, name, module


class GGUFScaledEmbedding(nn.Module):
    """transformers' scaled word embeddings (Gemma 3's): the rows looked up, times
    embed_scale, as their forward computes it."""

    def __init__(self, rows: GGUFEmbedding, embed_scale: torch.Tensor) -> None:
        super().__init__()
        self.rows = rows
        self.embed_scale = embed_scale.float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(input_ids) * self.embed_scale


def _embedding_of(blocks: Blocks, module: nn.Embedding) -> nn.Module | str:
    """A kernel embedding over `blocks` doing what `module` does, or why there is none. A
    subclass (its own forward) is served only as a scaled embedding (an `embed_scale`
    tensor), and only if it looks up the same values as the module on a spread of ids."""
    ggml_type, rows = blocks
    new: nn.Module = GGUFEmbedding(rows, ggml_type, module.embedding_dim)
    if type(module) is nn.Embedding:
        return new
    scale = getattr(module, "embed_scale", None)
    if not isinstance(scale, torch.Tensor):
        return f"{type(module).__name__} has its own forward"
    new = GGUFScaledEmbedding(new, scale)
    ids = torch.arange(0, module.num_embeddings, max(1, module.num_embeddings // 64))
    if not torch.equal(new(ids), module(ids)):
        return f"{type(module).__name__} does more than scale the rows it looks up"
    return new


class _Swapper:
    """Swaps modules one by one, checking each against the fp32 weight it replaces."""

    def __init__(
        self, hf_model: nn.Module, source: _GGUFBlocks | _SixteenBitRows, arithmetic: str
    ) -> None:
        self.source = source
        self.arithmetic = arithmetic  # executor/kernels/gguf_arithmetic.py
        embedding = hf_model.get_input_embeddings()
        # Tied logits: their blocks are the embedding's (one tensor for both modules).
        self.tied = getattr(embedding, "weight", None)
        self.embedding_name = next((n for n, m in hf_model.named_modules() if m is embedding), None)
        self.shared: dict[str, Blocks] = {}
        self.swapped: list[str] = []
        self.kept: list[tuple[str, str]] = []

    def swap(self, parent: nn.Module, attr: str, name: str, module: nn.Module) -> None:
        if module.weight.numel() == 0:
            return  # released: a pipeline stage that does not use it (pp.py)
        found = self._checked_blocks(name, module)
        if isinstance(found, str):
            self.kept.append((name, found))
            return
        if isinstance(module, nn.Embedding):
            new = _embedding_of(found, module)
            if isinstance(new, str):
                self.kept.append((name, new))
                return
        else:
            ggml_type, rows = found
            bias = None if module.bias is None else module.bias.data
            new = GGUFLinear(rows, ggml_type, module.in_features, bias, self.arithmetic)
        setattr(parent, attr, new)  # the fp32 module, and its weight, are dropped
        self.swapped.append(name)

    def _checked_blocks(self, name: str, module: nn.Module) -> Blocks | str:
        """The module's blocks (its rank's part of them, if cut) if they dequantize bit for
        bit to its fp32 weight."""
        part: RankPart | None = getattr(module, "rank_part", None)
        param = f"{whole_module_name(name, part)}.weight"
        if module.weight is self.tied and self.embedding_name is not None:
            param = f"{self.embedding_name}.weight"  # tied logits: the embedding's tensor
        found = self.shared.get(param) or self.source.blocks(param)
        if isinstance(found, str):
            return found
        self.shared[param] = found
        if part is not None:
            found = _rank_blocks(found, part)
            if isinstance(found, str):
                return f"{param}: {found}"
        reason = _mismatch(found, module.weight.data)
        return found if reason is None else f"{param}: {reason}"

    def log(self, what: str) -> None:
        total = len(self.swapped) + len(self.kept)
        first = f"; kept fp32: {self.kept[0][0]} ({self.kept[0][1]})" if self.kept else ""
        logger.info(
            "transformers backend: %d of %d matmuls and embeddings read %s%s",
            len(self.swapped),
            total,
            what,
            first,
        )
        for name, reason in self.kept[1:]:
            logger.debug("kept fp32: %s (%s)", name, reason)


def whole_module_name(name: str, part: RankPart | None) -> str:
    """The uncut module's name: a row-parallel matmul's `local` is its parent's part."""
    return name.removesuffix(".local") if part is not None and part.columns else name


def _rank_blocks(found: Blocks, part: RankPart) -> Blocks | str:
    """The rank's part of a whole matrix's blocks: its rows, or its columns where they start
    and stop on block boundaries (blocks run along a row; else the reason)."""
    ggml_type, rows = found
    if part.rows is not None:
        return ggml_type, rows[part.rows].contiguous()
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    start, stop = part.columns.start, part.columns.stop
    if start % block_values or stop % block_values:
        return f"the rank's columns {start}:{stop} cut blocks of {block_values} values"
    first, end = start // block_values * block_bytes, stop // block_values * block_bytes
    return ggml_type, rows[:, first:end].contiguous()


def _mismatch(found: Blocks, weight: torch.Tensor) -> str | None:
    """Why these blocks are not exactly `weight` (None when they are)."""
    ggml_type, rows = found
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    columns = weight.shape[1]
    if rows.shape[0] != weight.shape[0] or rows.shape[1] * block_values != columns * block_bytes:
        return f"blocks of {tuple(rows.shape)} bytes do not hold a {tuple(weight.shape)} matrix"
    if weight.dtype != torch.float32:
        return f"the model holds {weight.dtype} weights (the kernel's output is fp32)"
    if not torch.equal(cpu_kernels.gguf_dequantize(rows, ggml_type, columns), weight):
        return "its blocks do not dequantize to the weight transformers loaded"
    return None


# ---------------------------------------------------------------------------------------------
# int8


def _int8_roles(hf_model: nn.Module) -> dict[str, str]:
    """Module name -> its GGUF role (attn_q, ffn_up, ...), by gguf-py's name map through
    transformers' GGUF map (which needs no file)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    try:
        return {
            hf.removesuffix(".weight"): gguf.split(".")[2]
            for hf, gguf in gguf_names_of(hf_model, TensorProcessor()).items()
            if gguf.startswith("blk.")
        }
    except NotImplementedError as exc:  # an architecture gguf-py does not name
        raise ValueError(
            f"--quantization int8 cannot tell this model's matmuls apart: {exc}"
        ) from exc


def _int8_model_(hf_model: nn.Module, roles: dict[str, str]) -> None:
    """The decoder's projections (by `roles`) as Q8_0 blocks made from their weights; a cut
    one quantizes its rank's part."""
    swapped = 0
    for parent, attr, name, module in list(_leaf_modules(hf_model)):
        whole = whole_module_name(name, getattr(module, "rank_part", None))
        if type(module) is nn.Linear and roles.get(whole) in _INT8_ROLES:
            new = int8_linear(module)
            if new is not None:
                setattr(parent, attr, new)
                swapped += 1
    if not swapped:
        raise ValueError("--quantization int8: gguf-py's name map finds no projection to quantize")
    logger.info("transformers backend: %d matmuls in Q8_0 blocks (int8)", swapped)
