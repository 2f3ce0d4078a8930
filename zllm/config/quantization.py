"""`--quantization`'s rules, checked before any process starts (torch-free).

Two kinds of quantized weights reach the engine:
- a GGUF file's blocks (`gguf`, `gguf-float`, `gguf-int8`) and fbgemm's `int8`, zllm's own
  CPU choices;
- a Hugging Face checkpoint whose config.json carries a `quantization_config`, as the tools
  users quantize with write it: `compressed-tensors` (llm-compressor: W4A16, W8A16, W8A8,
  FP8), `gptq` (GPTQModel / AutoGPTQ), `awq` (AutoAWQ's GEMM packing) and `fp8` (block- or
  tensor-scaled E4M3, as DeepSeek's and Qwen's FP8 releases ship). Its method is the
  checkpoint's: chosen when `--quantization` is unset, and an explicit name must agree.

read_checkpoint_quantization parses that config into plain data, refusing what the CPU
kernels cannot read with the field named; the executor's reader
(executor/weights/quantized/checkpoint.py) reads the tensors by it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec

GGUF_QUANTIZATIONS = ("gguf", "gguf-float", "gguf-int8")
# vLLM's names for a quantized checkpoint's method (config.json quantization_config.quant_method).
CHECKPOINT_QUANTIZATIONS = ("compressed-tensors", "gptq", "awq", "fp8")
# CPU kernels only. A quantized checkpoint's blocks also have GPU kernels (csrc/block_gemv.cu).
CPU_QUANTIZATIONS = (*GGUF_QUANTIZATIONS, "int8")
# quant_methods a model's own code reads (not a --quantization): gpt-oss's MXFP4 experts
# (executor/weights/mxfp4.py).
MODEL_QUANTIZATIONS = ("mxfp4",)
QUANTIZATION_CHOICES = (*CPU_QUANTIZATIONS, *CHECKPOINT_QUANTIZATIONS, "none")

_CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


class WeightFormat(msgspec.Struct, frozen=True):
    """How one group of a checkpoint's matrices is stored.

    group_size: columns sharing a scale (> 0), -1: one scale per output channel, 0: one per
    tensor; a block-scaled fp8 matrix has `block` (rows, columns) instead. `act_order`: the
    checkpoint stores g_idx, each column's group, in an order other than the columns'.
    `activations`: what the checkpoint's own arithmetic does to the inputs ("" none, "int8
    dynamic", "fp8 dynamic", "fp8 static"); on CPU the kernels keep them fp32.
    """

    kind: str  # "int" | "float"
    bits: int
    group_size: int
    symmetric: bool = True
    act_order: bool = False
    block: tuple[int, int] | None = None
    activations: str = ""

    def describe(self) -> str:
        if self.kind == "float":
            scale = f"{self.block[0]}x{self.block[1]} blocks" if self.block else _scale(self)
            return f"fp8 e4m3 weights ({scale})"
        zero = "symmetric" if self.symmetric else "with zero points"
        order = ", act-order" if self.act_order else ""
        return f"int{self.bits} weights ({_scale(self)}, {zero}{order})"


class CheckpointQuantization(msgspec.Struct, frozen=True):
    """A checkpoint's quantization_config, checked: its method, the format of each group of
    matrices (`targets`: "Linear", a module name, or "re:<regex>"), and the modules left in
    16 bits (`ignore`, same spellings)."""

    method: str
    groups: tuple[tuple[tuple[str, ...], WeightFormat], ...]
    ignore: tuple[str, ...] = ()
    packing: str = ""  # CT's format, GPTQ's checkpoint_format, AWQ's version

    def format_of(self, module: str) -> WeightFormat | None:
        """The format of the matrix of `module` (e.g. model.layers.0.self_attn.q_proj), or
        None when the checkpoint keeps it in 16 bits."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, fmt in self.groups:
            if any(_matches(pattern, module) for pattern in targets):
                return fmt
        return None

    @property
    def act_order(self) -> bool:
        return any(fmt.act_order for _, fmt in self.groups)

    def describe(self) -> str:
        formats = "; ".join(dict.fromkeys(fmt.describe() for _, fmt in self.groups))
        packing = f" {self.packing}" if self.packing else ""
        return f"{self.method}{packing}: {formats}"


def read_checkpoint_quantization(model_path: str) -> CheckpointQuantization | None:
    """The quantization_config of a Hugging Face directory's config.json (None: not quantized,
    or not a directory). Refuses (ValueError) a method or field the kernels cannot read."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    quant = config.get("quantization_config") or config.get("compression_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method in MODEL_QUANTIZATIONS:
        return None  # the model's own loader reads these tensors
    parse = _PARSERS.get(method)
    if parse is None:
        raise ValueError(
            f"{model_path}: quantization_config.quant_method {method!r} is not supported; "
            f"zllm reads {', '.join(CHECKPOINT_QUANTIZATIONS)} checkpoints"
        )
    return parse(quant, model_path)


def check_quantization(
    requested: str | None,
    *,
    device: str,
    model_path: str,
    load_format: str,
    model_impl: str,
    tensor_parallel_size: int,
) -> str | None:
    """The --quantization the engine runs (None: its own choice per model), refusing a name
    that cannot serve this model here, with the reason."""
    gguf_method = requested in GGUF_QUANTIZATIONS
    if load_format == "dummy" and (gguf_method or requested in CHECKPOINT_QUANTIZATIONS):
        raise ValueError(
            f"--quantization {requested} reads the model's quantized weights, which "
            f"--load-format dummy does not load (random weights); use none or int8"
        )
    if requested in CPU_QUANTIZATIONS and device != "cpu":
        raise ValueError(
            f"--quantization {requested} runs on CPU only (its kernels are CPU kernels); on "
            f"{device} leave it unset (the model's dtype) or use none"
        )
    if gguf_method and not model_path.endswith(".gguf"):
        raise ValueError(
            f"--quantization {requested} reads a GGUF file's blocks; {model_path} is not a "
            f"GGUF file (leave it unset: a bf16/fp16 checkpoint's matrices are read 16-bit on "
            f"CPU by default; or use none or int8)"
        )
    checkpoint = None if load_format == "dummy" else read_checkpoint_quantization(model_path)
    if checkpoint is None:
        if requested in CHECKPOINT_QUANTIZATIONS:
            raise ValueError(
                f"--quantization {requested} reads a checkpoint whose config.json names it in "
                f"quantization_config; {model_path} has no quantization_config"
            )
        return requested
    _check_checkpoint(checkpoint, requested, device, model_impl, tensor_parallel_size)
    return checkpoint.method


def _check_checkpoint(
    checkpoint: CheckpointQuantization, requested: str | None, device: str, impl: str, tp: int
) -> None:
    method = checkpoint.method
    if requested is not None and requested != method:
        raise ValueError(
            f"the checkpoint's weights are stored {method}-quantized (config.json's "
            f"quantization_config); --quantization {requested} cannot read them: leave it "
            f"unset or name {method}"
        )
    if impl == "transformers":
        raise ValueError(
            f"{method} checkpoints are read by zllm's own model code; --model-impl "
            f"transformers would need transformers' {method} kernels, which run on GPU only"
        )
    if checkpoint.act_order and tp > 1:
        raise ValueError(
            "an act-order checkpoint (g_idx) cannot be cut across tensor-parallel ranks: its "
            "groups scatter each rank's columns over the whole row, so a rank's part is not "
            "whole groups; use --tensor-parallel-size 1"
        )


def deterministic_refusal(quantization: str | None) -> str | None:
    """Why --deterministic cannot run with this --quantization, or None."""
    if quantization in ("gguf", "gguf-int8"):
        return (
            f"deterministic execution cannot use {quantization} (which arithmetic a matmul "
            f"takes depends on how many rows it has); use gguf-float (the default under "
            f"--deterministic)"
        )
    return None


# ---- parsing each method's config ------------------------------------------------------------


def _refuse(model_path: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{model_path}: quantization_config.{field} = {value!r}: {why}")


def _group_size(value: Any, model_path: str, field: str) -> int:
    """-1 (per channel) or a positive multiple of 32 (the kernels' block)."""
    if value is None or value == -1:
        return -1
    if not isinstance(value, int) or value <= 0 or value % 32:
        raise _refuse(model_path, field, value, "group sizes must be -1 or a multiple of 32")
    return value


def _parse_gptq(quant: dict, model_path: str) -> CheckpointQuantization:
    bits = quant.get("bits")
    if bits not in (4, 8):
        raise _refuse(model_path, "bits", bits, "GPTQ checkpoints of 4 or 8 bits are supported")
    packing = quant.get("checkpoint_format") or "gptq"
    if packing not in ("gptq", "gptq_v2"):
        raise _refuse(
            model_path, "checkpoint_format", packing, "gptq and gptq_v2 packings are supported"
        )
    if quant.get("lm_head"):
        raise _refuse(model_path, "lm_head", True, "a quantized lm_head is not supported")
    if quant.get("dynamic"):
        raise _refuse(
            model_path, "dynamic", "...", "per-module overrides of bits are not supported"
        )
    fmt = WeightFormat(
        kind="int",
        bits=bits,
        group_size=_group_size(quant.get("group_size", 128), model_path, "group_size"),
        symmetric=bool(quant.get("sym", True)),
        act_order=bool(quant.get("desc_act", False)),
    )
    return CheckpointQuantization("gptq", ((("Linear",), fmt),), ("lm_head",), packing)


def _parse_awq(quant: dict, model_path: str) -> CheckpointQuantization:
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise _refuse(model_path, "bits", bits, "AWQ checkpoints are 4-bit")
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(model_path, "version", version, "AWQ's GEMM packing is supported")
    group = quant.get("group_size", quant.get("q_group_size", 128))
    fmt = WeightFormat(
        kind="int",
        bits=4,
        group_size=_group_size(group, model_path, "group_size"),
        symmetric=not quant.get("zero_point", True),
    )
    skipped = tuple(quant.get("modules_to_not_convert") or ())
    return CheckpointQuantization("awq", ((("Linear",), fmt),), ("lm_head", *skipped), "gemm")


def _parse_fp8(quant: dict, model_path: str) -> CheckpointQuantization:
    if quant.get("fmt", "e4m3") != "e4m3":
        raise _refuse(model_path, "fmt", quant.get("fmt"), "fp8 weights in e4m3 are supported")
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) for b in block)):
        raise _refuse(model_path, "weight_block_size", block, "two integers expected")
    activations = quant.get("activation_scheme", "dynamic")
    fmt = WeightFormat(
        kind="float",
        bits=8,
        group_size=0,
        block=None if block is None else (block[0], block[1]),
        activations=f"fp8 {activations}",
    )
    ignore = ("lm_head", *(quant.get("modules_to_not_convert") or ()))
    return CheckpointQuantization("fp8", ((("Linear",), fmt),), ignore)


def _parse_compressed_tensors(quant: dict, model_path: str) -> CheckpointQuantization:
    fmt_name = quant.get("format", "")
    sparsity = quant.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise _refuse(
            model_path, "sparsity_config.format", sparsity.get("format"), "sparse checkpoints "
            "(2:4 and others) are not supported"
        )  # fmt: skip
    if quant.get("transform_config"):
        raise _refuse(model_path, "transform_config", "...", "transforms are not supported")
    groups = []
    for name, group in (quant.get("config_groups") or {}).items():
        group_format = group.get("format") or fmt_name
        if group_format not in _CT_FORMATS:
            raise _refuse(
                model_path, f"config_groups.{name}.format", group_format,
                f"zllm reads {', '.join(_CT_FORMATS)}",
            )  # fmt: skip
        weights = _ct_weights(group.get("weights"), model_path, f"config_groups.{name}.weights")
        activations = _ct_activations(
            group.get("input_activations"), model_path, f"config_groups.{name}.input_activations"
        )
        targets = tuple(group.get("targets") or ("Linear",))
        groups.append((targets, msgspec.structs.replace(weights, activations=activations)))
    if not groups:
        raise _refuse(model_path, "config_groups", {}, "no quantized group is named")
    ignore = tuple(quant.get("ignore") or ())
    return CheckpointQuantization("compressed-tensors", tuple(groups), ignore, fmt_name)


def _ct_weights(args: dict | None, model_path: str, field: str) -> WeightFormat:
    if not args:
        raise _refuse(model_path, field, args, "weight-less schemes are not supported")
    kind, bits, strategy = args.get("type", "int"), args.get("num_bits"), args.get("strategy")
    if kind == "int" and bits not in (4, 8):
        raise _refuse(model_path, f"{field}.num_bits", bits, "int weights of 4 or 8 bits")
    if kind == "float" and bits != 8:
        raise _refuse(model_path, f"{field}.num_bits", bits, "float weights of 8 bits (fp8)")
    if kind not in ("int", "float"):
        raise _refuse(model_path, f"{field}.type", kind, "int or float weights")
    group_size = {"tensor": 0, "channel": -1}.get(strategy)
    block = None
    if strategy == "group":
        group_size = _group_size(args.get("group_size"), model_path, f"{field}.group_size")
    elif strategy == "block" and kind == "float":
        block = tuple(args.get("block_structure") or ())
        if len(block) != 2:
            raise _refuse(model_path, f"{field}.block_structure", block, "two integers")
        group_size = 0
    elif group_size is None:
        raise _refuse(
            model_path, f"{field}.strategy", strategy, "tensor, channel, group (int) or "
            "block (fp8) scales are supported"
        )  # fmt: skip
    return WeightFormat(
        kind=kind,
        bits=bits,
        group_size=group_size,
        symmetric=bool(args.get("symmetric", True)),
        act_order=args.get("actorder") == "group",
        block=block,  # type: ignore[arg-type]
    )


def _ct_activations(args: dict | None, model_path: str, field: str) -> str:
    if not args:
        return ""
    kind, bits = args.get("type", "int"), args.get("num_bits")
    if bits != 8 or kind not in ("int", "float"):
        raise _refuse(
            model_path, field, f"{kind}{bits}", "activations quantized to int8 or fp8 only"
        )
    name = "int8" if kind == "int" else "fp8"
    return f"{name} {'dynamic' if args.get('dynamic', True) else 'static'}"


_PARSERS = {
    "gptq": _parse_gptq,
    "awq": _parse_awq,
    "fp8": _parse_fp8,
    "compressed-tensors": _parse_compressed_tensors,
}


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' target spellings: "Linear" (any matmul here), "re:<regex>", or a
    module name (a suffix of the full one)."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith(f".{pattern}")


def _scale(fmt: WeightFormat) -> str:
    if fmt.group_size > 0:
        return f"group {fmt.group_size}"
    return "per channel" if fmt.group_size == -1 else "per tensor"
