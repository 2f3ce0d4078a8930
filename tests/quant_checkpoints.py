"""Quantized Hugging Face checkpoints of a tiny random Llama, laid out as users' quantization
libraries write them: compressed-tensors (llm-compressor's output, made here through
compressed-tensors' own API), GPTQ (GPTQModel's "gptq" v1 checkpoint format) and AWQ
(AutoAWQ's GEMM format). The engine's loaders are tested against these files.

Quantization is round-to-nearest from each group's min/max: no calibration set and no Hessian.
The layouts, not the quantizers' accuracy, are what a loader must get right.
`dequantized_weights` unpacks every format with its own plain code, written from the formats'
documentation rather than taken from the writers, so it is a reference independent of both
the writers here and the engine under test.

What one projection W [out, in] becomes (b bits, p = 32 // b values per int32, G groups; "the
i-th value of a word" sits at bits [i*b, (i+1)*b)):

    compressed-tensors pack-quantized   weight_packed int32 [out, in/p]: a row's value k is the
                                        (k%p)-th of word k//p, stored as q + 2^(b-1);
                                        weight_scale bf16 [out, G] (group) or [out, 1] (channel);
                                        weight_zero_point int32 [out/p, G], packed the same way
                                        but down the out dimension (asymmetric schemes only);
                                        weight_shape int64 [2] = (out, in)
    compressed-tensors int-quantized    weight int8 [out, in], weight_scale bf16 [out, 1]
    compressed-tensors float-quantized  weight float8_e4m3fn [out, in], weight_scale bf16
                                        [out, 1] (per channel) or [1] (per tensor),
                                        input_scale bf16 [1] (static activation scale only)
    GPTQ "gptq" (v1)                    qweight int32 [in/p, out]: input row r is the (r%p)-th
                                        value of word r//p; qzeros int32 [G, out/p], zero - 1
                                        packed along out; scales fp16 [G, out]; g_idx int32 [in]
    AWQ GEMM                            qweight int32 [in, out/8]: word c holds output columns
                                        c*8 + AWQ_ORDER[i] as its i-th values; qzeros int32
                                        [G, out/8] in the same order; scales fp16 [G, out]

Dequantized: compressed-tensors w = (q - zero) * scale; GPTQ w[o, i] = scales[g_idx[i], o] *
(q[i, o] - (qzeros[g_idx[i], o] + 1)); AWQ w[o, i] = scales[i // group_size, o] * (q[i, o] -
zero[i // group_size, o]). Computed here in fp32, which is exact (a small integer times a
16-bit scale). compressed-tensors' own decompression computes in the scale's dtype (bf16), so
it gives these values rounded to bf16; transformers loads the scales as fp32 and gives them
exactly.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from tiny_models import write_tiny_model

if TYPE_CHECKING:
    import transformers
    from compressed_tensors.quantization import QuantizationScheme

# Every in_features (128 hidden, 256 intermediate, 4 heads x 32) is a multiple of 128, the
# group size most checkpoints use.
QUANT_BASE_OVERRIDES: dict[str, int] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
CT_SCHEMES = (
    "W4A16", "W4A16_ASYM", "W4A16_G32", "W4A16_ACT_ORDER", "W8A16", "W8A8", "FP8_DYNAMIC", "FP8"
)  # fmt: skip
# The order AutoAWQ's GEMM kernel reads a word's eight 4-bit values in: the i-th value of
# word c is output column c*8 + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The GPTQModel release whose quantization_config layout write_gptq mirrors.
GPTQMODEL_VERSION = "4.2.5"
# Tensors that carry a quantized weight; dequantized_weights replaces them by `<module>.weight`.
_QUANT_SUFFIXES = (
    ".weight_packed",
    ".weight_scale",
    ".weight_zero_point",
    ".weight_shape",
    ".weight_g_idx",
    ".weight_scale_inv",
    ".input_scale",
    ".input_zero_point",
    ".qweight",
    ".qzeros",
    ".scales",
    ".g_idx",
)


# A tiny Qwen3-MoE base: 4 experts of 64 (two groups of 32) beside the dense attention.
MOE_OVERRIDES: dict = dict(
    QUANT_BASE_OVERRIDES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64
)
# A mixture-of-experts layer's own projections (each expert's; the router stays 16-bit).
_EXPERT_PROJECTION = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")


def write_base_model(out: Path, seed: int = 0, arch: str = "llama") -> Path:
    """The unquantized model every writer starts from: tiny Llama (or Qwen3-MoE, `arch`
    "qwen3_moe"), bf16 (as real checkpoints are), tied embeddings, QUANT_BASE_OVERRIDES."""
    if arch == "qwen3_moe":
        return write_tiny_model(out, arch, seed=seed, dtype=torch.bfloat16, **MOE_OVERRIDES)
    return write_tiny_model(out, seed=seed, dtype=torch.bfloat16, **QUANT_BASE_OVERRIDES)


def _is_projection(tensor_name: str) -> bool:
    module = tensor_name.removesuffix(".weight")
    if module == tensor_name:
        return False
    return module.endswith(PROJECTIONS) or _EXPERT_PROJECTION.search(module) is not None


# --- compressed-tensors ---------------------------------------------------------------------


def _ct_scheme(scheme: str) -> QuantizationScheme:
    """compressed-tensors' preset for `scheme`, but for the two that are not presets in 0.20:
    group 32, and W8A16 per channel (0.20's preset groups by 128; llm-compressor's published
    W8A16 checkpoints came from the older per-channel preset)."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        preset_name_to_scheme,
    )

    targets = ["Linear"]
    if scheme in ("W4A16_G32", "W4A16_ACT_ORDER"):
        # compressed-tensors 0.20 writes act-order "weight" (columns quantized in activation
        # order, groups kept contiguous: no g_idx); write_ct_group_order makes the older
        # "group" layout.
        actorder = "weight" if scheme == "W4A16_ACT_ORDER" else None
        weights = QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=32, actorder=actorder
        )
        return QuantizationScheme(targets=targets, weights=weights)
    if scheme == "W8A16":
        weights = QuantizationArgs(num_bits=8, type="int", strategy="channel")
        return QuantizationScheme(targets=targets, weights=weights)
    if scheme not in CT_SCHEMES:
        raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; one of {CT_SCHEMES}")
    return preset_name_to_scheme(scheme, targets)


def _observe_inputs(model: torch.nn.Module, seed: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each projection's input min and max over one forward of random tokens: a data-free
    stand-in for llm-compressor's static_minmax calibration of a static input scale."""
    seen: dict[str, tuple[torch.Tensor, ...]] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.endswith(PROJECTIONS):

            def observe(_module, args, name=name) -> None:
                seen[name] = (args[0].amin(), args[0].amax())

            hooks.append(module.register_forward_pre_hook(observe))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (1, 16), generator=generator)
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    return seen


def _set_weight_qparams(module: torch.nn.Module) -> None:
    """Round-to-nearest weight scales and zero points from min/max, as llm-compressor's minmax
    observer reduces a weight for each strategy, through compressed-tensors' own
    calculate_qparams (so scale dtype and rounding are the library's)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    weight = module.weight.data
    if args.strategy == "group":
        grouped = weight.unflatten(-1, (-1, args.group_size))
        low, high = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    else:
        low, high = weight.amin(), weight.amax()
    scale, zero_point = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def write_compressed_tensors(
    out: Path, scheme: str, seed: int = 0, base: Path | None = None
) -> Path:
    """A compressed-tensors checkpoint of `scheme` (one of CT_SCHEMES) under `out`, made the
    way llm-compressor saves one: apply_quantization_config, observe, then
    ModelCompressor.from_pretrained_model / compress_model / save_pretrained / update_config,
    so config.json's quantization_config is compressed-tensors' own serialization. Targets
    Linear, ignores lm_head; embeddings and norms stay bf16. `base`: quantize this bf16
    Hugging Face directory (benchmarks' real-shape models) instead of the tiny model."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    quant_scheme = _ct_scheme(scheme)
    if base is None:
        write_base_model(out, seed)
    else:
        shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    source = out if base is None else base
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    static_inputs = quant_scheme.input_activations is not None and (
        quant_scheme.input_activations.dynamic is False
    )
    observed = _observe_inputs(model, seed) if static_inputs else {}
    config = QuantizationConfig(config_groups={"group_0": quant_scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        _set_weight_qparams(module)
        if static_inputs:
            input_args = module.quantization_scheme.input_activations
            scale, _ = calculate_qparams(*observed[name], input_args)
            module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


def write_ct_group_order(out: Path, seed: int = 0) -> Path:
    """A compressed-tensors W4A16 (group 32) checkpoint in act-order "group" layout, as
    compressed-tensors before 0.12 wrote it (0.20 refuses to): each module's packed columns
    in a random order, `weight_g_idx` naming each column's group, config `actorder: group`.
    The model it holds is the base's with permuted columns; the reference is its dequantized
    weights."""
    write_compressed_tensors(out, "W4A16_G32", seed)
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        in_features = int(tensors[f"{module}.weight_shape"][1])
        order = torch.randperm(in_features, generator=generator)
        codes = _unpack_values(tensors[name], 4)[:, :in_features]
        tensors[name] = pack_columns(codes[:, order], 4)
        tensors[f"{module}.weight_g_idx"] = (order // 32).to(torch.int32)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["actorder"] = "group"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


# --- GPTQ and AWQ ---------------------------------------------------------------------------


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit words -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, m] unsigned values -> int32 [n * bits / 32, m]: row r is the (r % p)-th value of
    word r // p (GPTQ's qweight)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    grouped = values.to(torch.int64).unflatten(0, (-1, per_word))
    return _to_int32((grouped << shifts[None, :, None]).sum(1))


def pack_columns(
    values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """[n, m] unsigned values -> int32 [n, m * bits / 32]: column c*p + order[i] is the i-th
    value of word c (GPTQ's qzeros with the identity order, AWQ's with AWQ_ORDER)."""
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    grouped = values.to(torch.int64).unflatten(1, (-1, per_word))[:, :, list(order)]
    return _to_int32((grouped << shifts).sum(-1))


def _gptq_linear(
    weight: torch.Tensor, bits: int, group_size: int, sym: bool, order: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One projection in GPTQ v1 layout. `order` is the column order GPTQ quantized in (the
    identity, or a permutation under desc_act): groups are consecutive runs of that order, so
    g_idx[i] = (position of column i in order) // group_size. Scales and zeros follow GPTQ's
    min/max quantizer (symmetric: range +-max|w|, zero 2^(bits-1))."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    maxq = 2**bits - 1
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[order] = torch.arange(in_features) // size
    grouped = weight[:, order].unflatten(1, (-1, size))
    low = grouped.amin(-1).clamp(max=0)
    high = grouped.amax(-1).clamp(min=0)
    if sym:
        high = torch.maximum(-low, high)
        low = -high
    flat = (low == 0) & (high == 0)
    low, high = low.masked_fill(flat, -1.0), high.masked_fill(flat, 1.0)
    scales = ((high - low) / maxq).to(torch.float16)
    if sym:
        zeros = torch.full_like(low, 2 ** (bits - 1))
    else:
        zeros = torch.round(-low / scales.float()).clamp(0, maxq)
    if (zeros < 1).any():
        raise ValueError("a GPTQ v1 zero point of 0 cannot be stored (it is written minus one)")
    codes = torch.round(weight / scales.float()[:, g_idx]) + zeros[:, g_idx]
    codes = codes.clamp(0, maxq).to(torch.int64)
    return {
        "qweight": pack_rows(codes.T, bits),
        "qzeros": pack_columns((zeros.T - 1).to(torch.int64), bits),
        "scales": scales.T.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def _awq_linear(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One projection in AutoAWQ GEMM layout, from AutoAWQ's zero-point quantizer: scale =
    (max - min) / 15 per group (the range need not contain 0), zero = -round(min / scale)."""
    grouped = weight.unflatten(1, (-1, group_size))
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)
    zeros = (-torch.round(low / scales.float())).clamp(0, 15)
    per_column = scales.float().repeat_interleave(group_size, 1)
    codes = torch.round(weight / per_column) + zeros.repeat_interleave(group_size, 1)
    codes = codes.clamp(0, 15).to(torch.int64)
    return {
        "qweight": pack_columns(codes.T, 4, AWQ_ORDER),
        "qzeros": pack_columns(zeros.T.to(torch.int64), 4, AWQ_ORDER),
        "scales": scales.T.contiguous(),
    }


def _rewrite_as_packed(
    out: Path,
    seed: int,
    pack: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    quantization_config: dict,
    arch: str = "llama",
) -> Path:
    """Replace the base model's projections by `pack`'s tensors and the rest by fp16 (what
    GPTQModel and AutoAWQ save: they load models in fp16), and add quantization_config."""
    write_base_model(out, seed, arch)
    weights = out / "model.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(weights).items():
        if _is_projection(name):
            module = name.removesuffix(".weight")
            packed = pack(module, tensor.float())
            tensors.update({f"{module}.{part}": value for part, value in packed.items()})
        else:
            tensors[name] = tensor.to(torch.float16)
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def write_gptq(
    out: Path,
    bits: int = 4,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    seed: int = 0,
    shared_order: bool = True,
    arch: str = "llama",
) -> Path:
    """A GPTQ checkpoint as GPTQModel saves its "gptq" (v1) checkpoint_format: q/k/v/o/gate/
    up/down of every layer packed (round-to-nearest, no Hessian), the rest fp16. desc_act
    draws a random column order from `seed` (GPTQ's is by Hessian diagonal), giving a
    non-trivial g_idx; as GPTQ's order comes from its input's Hessian, the matmuls reading one
    input (q/k/v, gate/up) share it unless `shared_order` is False. quantization_config and
    quantize_config.json are GPTQModel 4.2.5's. `arch` "qwen3_moe": each expert's projections
    packed too (as GPTQModel packs a mixture's experts; the router stays fp16)."""
    if bits not in (4, 8) or group_size not in (32, 64, 128, -1):
        raise ValueError(
            f"write_gptq: bits 4 or 8 and group_size 32/64/128/-1, not {bits}, {group_size}"
        )
    generator = torch.Generator().manual_seed(seed)

    orders: dict[str, torch.Tensor] = {}

    def pack(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        in_features = weight.shape[1]
        if not desc_act:
            return _gptq_linear(weight, bits, group_size, sym, torch.arange(in_features))
        shared_input = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
        shared_input = shared_input.replace("up_proj", "gate_proj")
        key = shared_input if shared_order else module
        if key not in orders:
            orders[key] = torch.randperm(in_features, generator=generator)
        return _gptq_linear(weight, bits, group_size, sym, orders[key])

    meta = {
        "quantizer": [f"gptqmodel:{GPTQMODEL_VERSION}"],
        "uri": "https://github.com/modelcloud/gptqmodel",
        "damp_percent": 0.05,
        "damp_auto_increment": 0.01,
        "static_groups": False,
        "true_sequential": True,
        "mse": 0.0,
        "v2": False,
        "v2_alpha": 0.25,
        "act_group_aware": False,
    }
    quantization_config = {
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "lm_head": False,
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "meta": meta,
    }
    _rewrite_as_packed(out, seed, pack, quantization_config, arch)
    (out / "quantize_config.json").write_text(json.dumps(quantization_config, indent=2))
    return out


def write_awq(out: Path, group_size: int = 128, seed: int = 0) -> Path:
    """An AutoAWQ GEMM checkpoint (4 bits, zero points): q/k/v/o/gate/up/down of every layer
    packed (round-to-nearest, no activation-aware scale search), the rest fp16;
    quantization_config is AwqConfig.to_transformers_dict's."""
    if group_size not in (32, 64, 128):
        raise ValueError(f"write_awq: group_size 32, 64 or 128, not {group_size}")
    quantization_config = {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return _rewrite_as_packed(
        out, seed, lambda _, weight: _awq_linear(weight, group_size), quantization_config
    )


def write_fp8(out: Path, block: int = 128, seed: int = 0) -> Path:
    """A block-scaled fp8 checkpoint as DeepSeek's and Qwen's FP8 releases ship it (quant_method
    "fp8", transformers' FineGrainedFP8 layout): e4m3 weights and weight_scale_inv fp32
    [ceil(out/128), ceil(in/128)], each block's max |w| / 448 (the factor the values are
    multiplied by, whatever its name says); the rest fp16."""

    def pack(_: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, columns = weight.shape
        padded = torch.zeros(-(-rows // block) * block, -(-columns // block) * block)
        padded[:rows, :columns] = weight
        tiles = padded.unflatten(0, (-1, block)).unflatten(-1, (-1, block))
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        values = (weight / expanded[:rows, :columns]).to(torch.float8_e4m3fn)
        return {"weight": values, "weight_scale_inv": scale}

    quantization_config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [block, block],
    }
    return _rewrite_as_packed(out, seed, pack, quantization_config)


# --- the reference: dequantized weights and the model made of them --------------------------


def _unpack_values(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> int64 [..., n * 32 / bits]: a word's values in bit order, lowest
    first (a value never straddles two words for 4 or 8 bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    return ((unsigned[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


def _dequantize_ct(tensors: dict[str, torch.Tensor], module: str, weights: dict) -> torch.Tensor:
    """One compressed-tensors module's weight [out, in] from its stored tensors, by its
    config group's `weights` args."""
    scale = tensors[f"{module}.weight_scale"].float()
    if f"{module}.weight_packed" in tensors:
        bits, offset = weights["num_bits"], 2 ** (weights["num_bits"] - 1)
        out_features, in_features = tensors[f"{module}.weight_shape"].tolist()
        codes = _unpack_values(tensors[f"{module}.weight_packed"], bits)[:, :in_features] - offset
        zero = torch.zeros(1)
        if f"{module}.weight_zero_point" in tensors:
            packed_zero = tensors[f"{module}.weight_zero_point"]
            zero = _unpack_values(packed_zero.T, bits).T[:out_features] - offset
    else:  # int-quantized (int8) or float-quantized (float8_e4m3fn): one value per element
        codes, zero = tensors[f"{module}.weight"], torch.zeros(1)
    g_idx = tensors.get(f"{module}.weight_g_idx")
    if g_idx is not None:  # act-order: each column's group
        scale = scale[:, g_idx.long()]
        zero = zero[:, g_idx.long()] if zero.dim() == 2 else zero
    elif weights["strategy"] == "group":
        scale = scale.repeat_interleave(weights["group_size"], 1)
        zero = zero.repeat_interleave(weights["group_size"], 1) if zero.dim() == 2 else zero
    return (codes.float() - zero.float()) * scale


def _dequantize_gptq(tensors: dict[str, torch.Tensor], module: str, bits: int) -> torch.Tensor:
    codes = _unpack_values(tensors[f"{module}.qweight"].T, bits).T  # [in, out]
    zeros = _unpack_values(tensors[f"{module}.qzeros"], bits) + 1  # v1 stores zero - 1
    g_idx = tensors[f"{module}.g_idx"].long()
    scales = tensors[f"{module}.scales"].float()
    return (scales[g_idx] * (codes - zeros[g_idx]).float()).T


def _dequantize_awq(tensors: dict[str, torch.Tensor], module: str, group_size: int) -> torch.Tensor:
    def unpack(words: torch.Tensor) -> torch.Tensor:
        values = _unpack_values(words, 4).unflatten(-1, (-1, 8))
        columns = torch.empty_like(values)
        columns[..., list(AWQ_ORDER)] = values  # the i-th value is column AWQ_ORDER[i]
        return columns.flatten(-2)

    codes, zeros = unpack(tensors[f"{module}.qweight"]), unpack(tensors[f"{module}.qzeros"])
    scales = tensors[f"{module}.scales"].float()
    rows = torch.arange(codes.shape[0]) // group_size
    return (scales[rows] * (codes - zeros[rows]).float()).T


def dequantized_weights(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint written here, as fp32: each quantized module's weight
    [out, in] rebuilt from its codes, scales and zeros, and every other tensor converted
    (no lm_head.weight: the embeddings are tied)."""
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    tensors = load_file(out / "model.safetensors")
    method = config["quant_method"]
    if method == "compressed-tensors":
        (group,) = config["config_groups"].values()
        modules = {n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")}
        weights = {f"{m}.weight": _dequantize_ct(tensors, m, group["weights"]) for m in modules}
    elif method in ("gptq", "awq"):
        modules = {n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")}
        if method == "gptq":
            weights = {f"{m}.weight": _dequantize_gptq(tensors, m, config["bits"]) for m in modules}
        else:
            group_size = config["group_size"]
            weights = {f"{m}.weight": _dequantize_awq(tensors, m, group_size) for m in modules}
    elif method == "fp8":
        block_rows, block_columns = config["weight_block_size"]
        modules = {n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith("_inv")}
        weights = {}
        for m in modules:
            values = tensors[f"{m}.weight"].float()
            scale = tensors[f"{m}.weight_scale_inv"].float()
            scale = scale.repeat_interleave(block_rows, 0).repeat_interleave(block_columns, 1)
            weights[f"{m}.weight"] = values * scale[: values.shape[0], : values.shape[1]]
    else:
        raise ValueError(f"not a checkpoint written by quant_checkpoints: {method!r}")
    for name, tensor in tensors.items():
        if not name.endswith(_QUANT_SUFFIXES) and name not in weights:
            weights[name] = tensor.float()
    return weights


def reference_model(out: Path) -> transformers.PreTrainedModel:
    """The fp32 transformers model of `out`'s dequantized weights: what the engine's output is
    checked against where transformers cannot run the format on CPU."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(out)
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dequantized_weights(out), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{out}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def reference_model_from_files(out: Path, scratch: Path) -> transformers.PreTrainedModel:
    """reference_model's weights saved under `scratch` and loaded by from_pretrained, for
    architectures whose modules transformers lays out otherwise than their checkpoints name
    them (a mixture's experts: one 3-D tensor per projection, converted on load)."""
    import transformers

    shutil.copytree(out, scratch, ignore=shutil.ignore_patterns("*.safetensors", "quantize_*"))
    config = json.loads((scratch / "config.json").read_text())
    del config["quantization_config"]
    (scratch / "config.json").write_text(json.dumps(config))
    weights = {name: t.contiguous() for name, t in dequantized_weights(out).items()}
    save_file(weights, scratch / "model.safetensors", metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32)
    return model.eval()


def transformers_model(
    out: Path, quantize_activations: bool = True
) -> transformers.PreTrainedModel:
    """transformers' own fp32 model of a compressed-tensors checkpoint on CPU. It decompresses
    the weights at the first forward (to exactly dequantized_weights'), and for W8A8, FP8 and
    FP8_DYNAMIC fake-quantizes each projection's input as the scheme says: the reference for
    an engine that quantizes activations. quantize_activations=False turns that off, leaving
    reference_model's arithmetic. transformers 5.24 with compressed-tensors 0.20 cannot load
    asymmetric pack-quantized checkpoints (it expects the zero points unpacked): refused here."""
    import transformers

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    for group in config.get("config_groups", {}).values():
        if group["format"] == "pack-quantized" and not group["weights"]["symmetric"]:
            raise ValueError(f"{out}: transformers cannot load asymmetric pack-quantized weights")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            module.quantization_enabled = quantize_activations
    return model.eval()


# --- the cases the engine is checked on ---------------------------------------------------------

# name -> writer, every format and option the engine reads (tests/test_quantized_checkpoints.py,
# benchmarks/quantized_parity.py).
CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    "ct-w4a16": lambda p: write_compressed_tensors(p, "W4A16"),
    "ct-w4a16-g32": lambda p: write_compressed_tensors(p, "W4A16_G32"),
    "ct-w4a16-asym": lambda p: write_compressed_tensors(p, "W4A16_ASYM"),
    "ct-w4a16-act-order-weight": lambda p: write_compressed_tensors(p, "W4A16_ACT_ORDER"),
    "ct-w4a16-g-idx": write_ct_group_order,
    "ct-w8a16": lambda p: write_compressed_tensors(p, "W8A16"),
    "ct-w8a8": lambda p: write_compressed_tensors(p, "W8A8"),
    "ct-fp8-dynamic": lambda p: write_compressed_tensors(p, "FP8_DYNAMIC"),
    "ct-fp8-static": lambda p: write_compressed_tensors(p, "FP8"),
    "gptq-4bit-g128": lambda p: write_gptq(p, bits=4, group_size=128),
    "gptq-4bit-g32-asym": lambda p: write_gptq(p, bits=4, group_size=32, sym=False),
    "gptq-8bit-g64": lambda p: write_gptq(p, bits=8, group_size=64),
    "gptq-8bit-asym": lambda p: write_gptq(p, bits=8, group_size=128, sym=False),
    "gptq-4bit-channel": lambda p: write_gptq(p, bits=4, group_size=-1),
    "gptq-4bit-act-order": lambda p: write_gptq(p, bits=4, group_size=32, desc_act=True),
    "gptq-4bit-act-order-per-matrix": lambda p: write_gptq(
        p, bits=4, group_size=32, desc_act=True, shared_order=False
    ),
    "awq-g128": lambda p: write_awq(p, group_size=128),
    "awq-g64": lambda p: write_awq(p, group_size=64),
    "fp8-block": lambda p: write_fp8(p),
}
# Where transformers runs the checkpoint on CPU itself: compressed-tensors' symmetric schemes.
TRANSFORMERS_RUNS = frozenset(
    {"ct-w4a16", "ct-w4a16-g32", "ct-w4a16-act-order-weight", "ct-w8a16", "ct-w8a8",
     "ct-fp8-dynamic", "ct-fp8-static"}
)  # fmt: skip


def reference_of(case: str, out: Path) -> transformers.PreTrainedModel:
    """transformers' own model of the checkpoint where it runs one on CPU (activations left
    fp32, as zllm's CPU arithmetic keeps them), else reference_model's dequantized weights."""
    if case in TRANSFORMERS_RUNS:
        return transformers_model(out, quantize_activations=False)
    return reference_model(out)
