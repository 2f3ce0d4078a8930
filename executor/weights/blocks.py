"""Which of a model's matrices read weight blocks, and swapping them in.

A GGUF file's blocks (gguf_raw_weights) or a bf16/fp16 checkpoint's rows
(sixteen_bit_raw_weights), cut to this rank's part, become the model's GGUFLinear /
GGUFSplitLinear / GGUFEmbedding modules (executor/layers/linear/gguf.py). BlockPlan names the
tensors they serve before the weights load, so the loader never widens those to fp32. Every
type gguf-py dequantizes but F32 is read in its blocks (IQ1-IQ3, TQ and NVFP4 included:
csrc/cpu/gguf_lattice.h), so the weights take the file's bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from torch import nn

from zllm.config.quantization import CHECKPOINT_QUANTIZATIONS, read_checkpoint_quantization
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import gguf_arithmetic
from zllm.executor.layers.linear.act_order import ActOrderLinear, ActOrderParts
from zllm.executor.layers.linear.gguf import GGUFEmbedding, GGUFLinear, GGUFSplitLinear
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.parallel.groups import SINGLE, TensorParallel
from zllm.executor.parallel.shards import release_weight, shard_blocks
from zllm.executor.weights import expert_blocks
from zllm.executor.weights.quantized.checkpoint import (
    QuantizedCheckpoint,
    read_quantized_checkpoint,
)
from zllm.model.arch_config import ModelArchConfig
from zllm.model.gguf import GGUFFile, read_gguf
from zllm.model.registry import family_for_gguf, family_of

logger = logging.getLogger(__name__)


def gguf_kernel_plan(model_path: str, strict: bool = False) -> str | None:
    """Why the GGUF kernel cannot serve this file, or None when it can. Reads only the header.

    A file may mix types (llama.cpp's presets do: Q4_K_M holds Q4_K, Q6_K and sometimes Q5_0
    or Q8_0). The kernel reads the blocks of the types in SUPPORTED_GGML_TYPES; others (F32
    matrices) stay fp32.
    Not strict, the engine's default: the kernel serves the file if it can serve any matmul;
    the others keep fp32 matmuls on the weights every path loads (use_gguf_blocks_ logs
    which). Strict, --quantization gguf asked for: every decoder matmul must be served, else
    the reason names the first tensor that is not. The logits may stay fp32 either way.
    """
    if not model_path.endswith(".gguf"):
        return "the model is not a GGUF file"
    decoder, head = gguf_matmuls(read_gguf(model_path))
    reasons = [m.unservable() for m in decoder]
    if strict:
        first = next((r for r in reasons if r is not None), None)
        if first is not None:
            return (
                f"{first}; leave --quantization unset to use the kernel where the file allows "
                f"and fp32 matmuls elsewhere"
            )
        return None
    if any(r is None for r in reasons) or (head is not None and head.unservable() is None):
        return None
    types = sorted({t.name for m in [*decoder, head] if m is not None for t in m.types})
    return f"the kernel reads none of its matrices' types ({', '.join(types)})"


@dataclass(frozen=True, slots=True)
class GGUFMatmul:
    """The GGUF tensors one kernel matmul would read (a fused one reads several, which may be
    of different types: one kernel call per part)."""

    tensors: tuple[str, ...]
    types: tuple[GGMLQuantizationType, ...]

    def unservable(self) -> str | None:
        """Why the kernel cannot read these blocks (naming tensor and type), or None."""
        for name, ggml_type in zip(self.tensors, self.types, strict=True):
            if int(ggml_type) not in cpu_kernels.SUPPORTED_GGML_TYPES:
                readable = ", ".join(cpu_kernels.SUPPORTED_GGML_TYPES.values())
                return f"tensor {name!r} is {ggml_type.name} (the kernel reads {readable})"
        return None


# Per layer, the GGUF tensors (blk.{i}.<key>.weight) behind each matmul the kernel replaces:
# the model's fused qkv and gate/up projections, then the output and down projections. Phi-3
# files store the first two fused already (attn_qkv; ffn_up holding gate and up).
_LAYER_MATMULS = (
    ("attn_q", "attn_k", "attn_v"),
    ("attn_output",),
    ("ffn_gate", "ffn_up"),
    ("ffn_down",),
    ("ffn_gate_exps", "ffn_up_exps"),  # mixture of experts (expert_blocks.py)
    ("ffn_down_exps",),
    ("ffn_gate_shexp", "ffn_up_shexp"),  # Qwen2-MoE's shared expert
    ("ffn_down_shexp",),
)
_FUSED_LAYER_MATMULS = (("attn_qkv",), ("attn_output",), ("ffn_up",), ("ffn_down",))


def gguf_matmuls(gguf: GGUFFile) -> tuple[list[GGUFMatmul], GGUFMatmul | None]:
    """The decoder's matmuls layer by layer, and the logits' (output.weight, else the tied
    embedding), from the file's tensor names and types."""

    def matmul(names: list[str]) -> GGUFMatmul | None:
        infos = [gguf.tensors.get(n) for n in names]
        if any(info is None for info in infos):
            return None
        return GGUFMatmul(tuple(names), tuple(info.ggml_type for info in infos))

    numbers = {name.split(".")[1] for name in gguf.tensors if name.startswith("blk.")}
    layers = sorted((n for n in numbers if n.isdigit()), key=int)
    family = family_for_gguf(gguf)
    fused = family is not None and family.fused_checkpoint
    decoder = [
        matmul([f"blk.{layer}.{key}.weight" for key in keys])
        for layer in layers
        for keys in (_FUSED_LAYER_MATMULS if fused else _LAYER_MATMULS)
    ]
    head = matmul(["output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"])
    return [m for m in decoder if m is not None], head


class _WeightBlocks:
    """A GGUF file's blocks (or a 16-bit checkpoint's rows) for this rank's matrices (its
    tensor-parallel part of each), as
    kernel matmuls over them where the kernel reads every tensor involved."""

    def __init__(
        self, model: nn.Module, model_path: str, arithmetic: str, verify: bool = True
    ) -> None:
        """`verify`: the model holds the fp32 weights the blocks replace; check each matrix's
        blocks dequantize to them bit for bit (False: they were never loaded, BlockPlan)."""
        from zllm.executor.weights.loader import gguf_raw_weights, sixteen_bit_raw_weights

        # Tensor parallel: each rank keeps its part of every matrix (executor/parallel/).
        self.tp: TensorParallel = getattr(model, "tp", SINGLE)
        arch: ModelArchConfig = getattr(model, "checkpoint_arch", model.arch)
        self.checkpoint_arch = arch
        self.arithmetic = arithmetic  # the --quantization name: executor/kernels/gguf_arithmetic.py
        self.verify = verify
        self.checkpoint: QuantizedCheckpoint | None = None
        layers = getattr(model, "layer_indices", None)
        if model_path.endswith(".gguf"):
            raw = gguf_raw_weights(model_path, arch, layers)
        elif arithmetic in CHECKPOINT_QUANTIZATIONS:  # compressed-tensors, GPTQ, AWQ, fp8
            quant = read_checkpoint_quantization(model_path)
            tied = arch.tie_word_embeddings
            self.checkpoint = read_quantized_checkpoint(model_path, quant, layers, tied)
            raw = self.checkpoint.blocks
        else:  # a bf16/fp16 checkpoint's matrices, as F16/BF16 rows
            raw = sixteen_bit_raw_weights(model_path, arch, layers)
        # A model that moves a checkpoint's rows as it loads them (Llama 4's q/k heads, from
        # pairs to halves) moves their blocks' rows alike: a row's blocks are one row of bytes.
        moved = getattr(model, "block_rows", None)
        if moved is not None:
            raw = {name: (ggml_type, moved(name, rows)) for name, (ggml_type, rows) in raw.items()}
        self.file_types = {name: ggml_type for name, (ggml_type, _) in raw.items()}
        if self.tp.enabled and arch.tie_word_embeddings and "model.embed_tokens.weight" in raw:
            raw["lm_head.weight"] = raw["model.embed_tokens.weight"]  # each rank's logits rows
            self.file_types["lm_head.weight"] = self.file_types["model.embed_tokens.weight"]
        self.raw = raw
        self.served: set[str] = set()  # the tensors blocks() handed out

    def rank_part(self, name: str) -> tuple[int, torch.Tensor] | None:
        found = self.raw.get(name)
        if found is None or not self.tp.enabled:
            return found
        ggml_type, rows = found
        block_values, block_bytes = cpu_kernels.block_size(ggml_type)
        part = shard_blocks(name, rows, block_values, block_bytes, self.checkpoint_arch, self.tp)
        return None if part is None else (ggml_type, part)

    def reads(self, names: list[str]) -> bool:
        """Whether the kernel reads every one of these tensors (this rank's part of each)."""
        parts = [self.rank_part(n) for n in names]
        return all(p is not None and p[0] in cpu_kernels.KERNEL_TYPES for p in parts)

    def input_order(self, names: list[str]) -> torch.Tensor | None | bool:
        """Act-order checkpoints: the column order the matrices' blocks share (None: natural
        order; False: they differ, so each is a matmul of its own)."""
        if self.checkpoint is None:
            return None
        orders = [self.checkpoint.input_orders.get(n) for n in names]
        first = orders[0]
        same = all(
            (o is None and first is None)
            or (o is not None and first is not None and torch.equal(o, first))
            for o in orders
        )
        return first if same else False

    def blocks(
        self, names: list[str], weight: torch.Tensor
    ) -> list[tuple[torch.Tensor, int]] | None:
        """Each tensor's blocks and type (runs of one type merged), if the kernel reads all.
        `weight`: the fp32 matrix they replace (its shape; its values too where `verify`)."""
        if not self.reads(names):
            return None
        parts = [self.rank_part(n) for n in names]
        _check_shapes(names, parts, weight.shape)
        if self.verify:  # the kernel must multiply by exactly the weights the fp32 path holds
            start = 0
            for name, (ggml_type, rows) in zip(names, parts, strict=True):
                self.check_rows(name, ggml_type, rows, weight[start : start + rows.shape[0]])
                start += rows.shape[0]
        self.served.update(names)
        merged: list[tuple[torch.Tensor, int]] = []
        for ggml_type, rows in parts:
            if merged and merged[-1][1] == ggml_type:
                merged[-1] = (torch.cat([merged[-1][0], rows]), ggml_type)
            else:
                merged.append((rows.contiguous(), ggml_type))
        return merged

    def check_rows(
        self, name: str, ggml_type: int, rows: torch.Tensor, expected: torch.Tensor
    ) -> None:
        """Refuse blocks that do not dequantize to exactly the loaded fp32 rows `expected`."""
        dequantized = cpu_kernels.gguf_dequantize(rows, ggml_type, expected.shape[1])
        if not torch.equal(dequantized, expected):
            raise RuntimeError(f"GGUF blocks of {name} do not dequantize to the loaded weights")

    def type_summary(self) -> str:
        """For the log: the file's types that the served tensors read in blocks, and which of
        them take integer dots (a type alone; a fused matmul takes the smallest limit of its
        parts' types)."""
        in_blocks = sorted({self.file_types[n] for n in self.served})
        parts = [f"in blocks {_type_names(in_blocks) or 'none'}"]
        integer = gguf_arithmetic.describe(self.arithmetic, in_blocks)
        if integer is not None:
            parts.append(integer)
        return "; ".join(parts)

    def fuse(
        self, names: list[str], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> nn.Module | None:
        """A kernel matmul over the row-concatenated blocks of names, if it reads them all."""
        order = self.input_order(names)
        if order is False:
            return self._fuse_parts(names, weight, bias)
        found = self.blocks(names, weight)
        if found is None:
            return None
        if len(found) == 1:
            module = GGUFLinear(*found[0], weight.shape[1], bias, self.arithmetic)
        else:
            module = GGUFSplitLinear(found, weight.shape[1], bias, self.arithmetic)
        return module if order is None else ActOrderLinear(module, order)

    def _fuse_parts(
        self, names: list[str], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> nn.Module | None:
        """A fused matmul whose parts' act-order differs: one matmul per part."""
        parts, start = [], 0
        for name in names:
            rows = self.rank_part(name)[1].shape[0]
            part_bias = None if bias is None else bias[start : start + rows]
            part = self.fuse([name], weight[start : start + rows], part_bias)
            if part is None:
                return None
            parts.append(part)
            start += rows
        return ActOrderParts(parts)


class BlockPlan:
    """The blocks a model's matmuls will read (a GGUF file's, or a 16-bit checkpoint's rows
    as F16/BF16), known before its weights load, so the loader never widens the tensors they
    replace (`served`) to fp32: loading takes the blocks' bytes and none of the fp32 copies'
    time or memory. Built on the model's empty shell."""

    def __init__(
        self, model: nn.Module, model_path: str, method: str, cpu_kernels_run: bool = True
    ) -> None:
        """`cpu_kernels_run`: the CPU kernels will multiply the blocks (False on a GPU)."""
        if cpu_kernels_run:  # build (or load) the extension first: a failure surfaces here, once
            cpu_kernels.load()
        self.source = _WeightBlocks(model, model_path, method, verify=False)
        self.served = self._served(model)

    def _served(self, model: nn.Module) -> frozenset[str]:
        """The checkpoint names whose tensors the swaps below replace with blocks."""
        reads = self.source.reads
        served = {
            name for _, _, names in decoder_matmul_targets(model) if reads(names) for name in names
        }
        head_read = model.lm_head is not None and reads(["lm_head.weight"])
        if head_read:
            served.add("lm_head.weight")
        # A tensor-parallel rank's tied logits are filled from the loaded embedding: load it
        # unless the blocks serve the logits too.
        tied_shard = model.lm_head is not None and model.arch.tie_word_embeddings
        if reads(["model.embed_tokens.weight"]) and (not tied_shard or head_read):
            served.add("model.embed_tokens.weight")
        served |= expert_blocks.served_names(model, reads)
        checkpoint = self.source.checkpoint
        if checkpoint is not None:  # a quantized checkpoint: every quantized matmul, or refuse
            unserved = sorted(checkpoint.quantized - served)
            if unserved:
                raise ValueError(
                    f"{unserved[0]} is stored quantized but no kernel matmul of this model "
                    f"reads it (this rank's part of it is not whole blocks?)"
                )
            served |= checkpoint.stored_names
        return frozenset(served)

    def apply(self, model: nn.Module, model_path: str) -> None:
        """Swap the matmuls (the model loaded without `served`)."""
        _swap_blocks_in(model, model_path, self.source)


def use_gguf_blocks_(model: nn.Module, model_path: str, arithmetic: str = "gguf-float") -> None:
    """Point every matmul whose GGUF tensors the kernel reads at those blocks (their
    arithmetic: `arithmetic`, a --quantization name), checking them against the loaded fp32
    weights."""
    cpu_kernels.load()  # build (or load) the extension first: a build failure surfaces here, once
    _swap_blocks_in(model, model_path, _WeightBlocks(model, model_path, arithmetic))


def _swap_blocks_in(model: nn.Module, model_path: str, source: _WeightBlocks) -> None:
    swapped, kept = _swap_decoder_matmuls(model, source)
    experts_swapped, experts_kept = expert_blocks.swap_experts_(model, source)
    if experts_swapped or experts_kept:
        logger.info(
            "%d of %d expert projections read blocks",
            experts_swapped,
            experts_swapped + experts_kept,
        )
    embedding = _swap_ends(model, source)
    gguf = model_path.endswith(".gguf")
    if source.checkpoint is not None:
        label = f"{source.arithmetic} checkpoint"
        reads = f"blocks ({_type_names(sorted(source.checkpoint.types))}) made at load"
    elif gguf:
        label, reads = "GGUF kernels", "GGUF blocks"
    else:
        label, reads = "16-bit weights", "16-bit rows widened in the kernel"
    logger.info(
        "%s: %d of %d decoder matmuls, %s and %s read %s%s",
        label,
        swapped,
        swapped + kept,
        "the logits" if model.logits_proj is not None else "not the logits",
        "the embedding" if embedding else "not the embedding",
        reads,
        _fp32_note(model_path) if kept and gguf else "",
    )
    if gguf:
        logger.info("GGUF weight types: %s", source.type_summary())


def _swap_decoder_matmuls(model: nn.Module, source: _WeightBlocks) -> tuple[int, int]:
    """Every decoder layer's matmuls the kernel reads become kernel matmuls; returns how many
    were swapped and how many kept."""
    swapped = kept = 0
    for module, attr, names in decoder_matmul_targets(model):
        linear = getattr(module, attr)
        bias = None if linear.bias is None else linear.bias.data
        new = source.fuse(names, linear.weight.data, bias)
        if new is None:
            kept += 1
        else:
            setattr(module, attr, new)
            swapped += 1
    return swapped, kept


def decoder_matmul_targets(model: nn.Module) -> Iterator[tuple[nn.Module, str, list[str]]]:
    """(module, attribute, checkpoint names) of every decoder matmul the blocks may serve."""
    own_targets = getattr(model, "block_matmul_targets", None)
    if own_targets is not None:  # a model laid out otherwise than Llama names its own
        yield from own_targets()
        return
    # (A pipeline stage holds some of the layers: layer_indices names them.)
    fused = family_of(model.arch).fused_checkpoint
    for i, layer in zip(model.layer_indices, model.layers, strict=True):
        p = f"model.layers.{i}."
        attn, mlp, m = layer.self_attn, layer.mlp, f"{p}mlp."
        if fused:  # Phi-3: one checkpoint tensor each, in our [q | k | v] and [gate | up] order
            yield attn, "qkv_proj", [f"{p}self_attn.qkv_proj.weight"]
        else:
            yield attn, "qkv_proj", [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        yield attn, "o_proj", [f"{p}self_attn.o_proj.weight"]
        if isinstance(mlp, MoEBlock):  # experts: expert_blocks.py; a shared one as an MLP
            if mlp.shared_expert is None:
                continue
            mlp, m = mlp.shared_expert, f"{m}{mlp.rule.shared_name}."
        if fused:
            yield mlp, "gate_up_proj", [f"{m}gate_up_proj.weight"]
        else:
            yield mlp, "gate_up_proj", [f"{m}gate_proj.weight", f"{m}up_proj.weight"]
        yield mlp, "down_proj", [f"{m}down_proj.weight"]


def _swap_ends(model: nn.Module, source: _WeightBlocks) -> bool:
    """The embedding table (and, tied, the logits: one set of blocks for both), then an
    untied lm_head; each fp32 tensor the blocks replace is released. Returns whether the
    embedding reads blocks."""
    found = source.blocks(["model.embed_tokens.weight"], model.embed_tokens.data)
    embedding = None if found is None else found[0]
    if embedding is not None:
        model.embed_rows = GGUFEmbedding(*embedding, model.arch.hidden_size)
        if model.lm_head is None:
            model.logits_proj = GGUFLinear(
                *embedding, model.arch.hidden_size, None, source.arithmetic
            )
        release_weight(model.embed_tokens)
    if model.lm_head is not None:
        head = source.fuse(["lm_head.weight"], model.lm_head.data, None)
        if head is not None:
            model.logits_proj = head
            release_weight(model.lm_head)
    return embedding is not None


def _check_shapes(
    names: list[str], parts: list[tuple[int, torch.Tensor]], shape: torch.Size
) -> None:
    """Refuse (ValueError) blocks that are not the model's matrix: rows that do not add up to
    its output features, or rows that are not its input features' bytes in their type."""
    out_features, in_features = shape
    rows = sum(part.shape[0] for _, part in parts)
    for name, (ggml_type, part) in zip(names, parts, strict=True):
        if part.shape[1] != cpu_kernels.row_bytes(ggml_type, in_features) or rows != out_features:
            stored = f"{part.shape[0]} rows of {part.shape[1]} bytes"
            raise ValueError(
                f"{name}: the checkpoint's {_type_names([ggml_type])} blocks are {stored}; "
                f"this model's matrix is [{out_features}, {in_features}]"
                + (f" across {', '.join(names)}" if len(names) > 1 else "")
            )


def _type_names(types: list[int]) -> str:
    return ", ".join(cpu_kernels.KERNEL_TYPES.get(t, str(t)) for t in types)


def _fp32_note(model_path: str) -> str:
    """For the log: why the matmuls the kernel does not serve stay fp32."""
    decoder, _ = gguf_matmuls(read_gguf(model_path))
    reasons = [r for r in (m.unservable() for m in decoder) if r is not None]
    if not reasons:
        return ""
    return f"; {len(reasons)} multiply fp32 weights dequantized at load (first: {reasons[0]})"
