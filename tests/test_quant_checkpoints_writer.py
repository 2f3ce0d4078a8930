"""tests/quant_checkpoints.py writes what the formats say: each checkpoint's dequantized weights
are the base model's within one quantization step, compressed-tensors' own decompression and
transformers' loading agree with them, and the GPTQ/AWQ word layouts match the documented
bit positions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_checkpoints import (
    AWQ_ORDER,
    CT_SCHEMES,
    dequantized_weights,
    pack_columns,
    pack_rows,
    reference_model,
    transformers_model,
    write_awq,
    write_base_model,
    write_compressed_tensors,
    write_gptq,
)
from safetensors.torch import load_file

SEED = 3


@pytest.fixture(scope="module")
def base_weights(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The unquantized bf16 weights every writer starts from (same seed)."""
    out = write_base_model(tmp_path_factory.mktemp("base"), SEED)
    return load_file(out / "model.safetensors")


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def _quant_config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def _fp8_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of float8_e4m3fn numbers around |x| (3 mantissa bits; subnormals below 2^-6)."""
    return 2.0 ** (torch.floor(torch.log2(x.abs().clamp(min=2**-6))) - 3)


def _assert_within_one_step(
    base: dict[str, torch.Tensor], dequantized: dict[str, torch.Tensor], step_of
) -> None:
    """Quantized projections are within one step of the base weight; everything else is the
    base tensor (converted to the checkpoint's 16-bit type, then fp32)."""
    assert "lm_head.weight" not in dequantized  # tied to the embeddings
    assert set(dequantized) == set(base)
    for name, weight in base.items():
        original = weight.float()
        restored = dequantized[name]
        assert restored.dtype == torch.float32 and restored.shape == original.shape, name
        step = step_of(name.removesuffix(".weight"), original)
        if step is None:
            assert torch.allclose(restored, original, rtol=1e-3, atol=1e-4), name
        else:
            assert ((restored - original).abs() <= step).all(), name
            assert not torch.equal(restored, original), name  # really quantized


@pytest.mark.parametrize("scheme", CT_SCHEMES)
def test_compressed_tensors_round_trip(scheme: str, tmp_path: Path, base_weights) -> None:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out = write_compressed_tensors(tmp_path / scheme, scheme, seed=SEED)
    config = _quant_config(out)
    assert config["quant_method"] == "compressed-tensors"
    assert config["ignore"] == ["lm_head"] and config["quantization_status"] == "compressed"
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"]
    expected_format = {"W8A8": "int-quantized", "FP8": "float-quantized"}
    expected_format["FP8_DYNAMIC"] = "float-quantized"
    assert config["format"] == group["format"] == expected_format.get(scheme, "pack-quantized")
    tensors = _tensors(out)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    weights = group["weights"]

    def step_of(module: str, original: torch.Tensor) -> torch.Tensor | None:
        if f"{module}.weight_scale" not in tensors:
            return None
        scale = tensors[f"{module}.weight_scale"].float()
        if weights["strategy"] == "group":
            scale = scale.repeat_interleave(weights["group_size"], 1)
        if weights["type"] == "float":
            return scale * _fp8_step(original / scale)
        return scale.expand_as(original)

    dequantized = dequantized_weights(out)
    _assert_within_one_step(base_weights, dequantized, step_of)

    # compressed-tensors' own decompression of the stored module tensors: it computes in the
    # scale's dtype, so it is ours rounded to bf16, and ours exactly with fp32 scales.
    scheme_args = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    module = "model.layers.1.mlp.down_proj"
    state = {k.removeprefix(f"{module}."): v for k, v in tensors.items() if k.startswith(module)}
    ours = dequantized[f"{module}.weight"]
    theirs = compressor.decompress(state, scheme_args)["weight"]
    assert torch.equal(theirs, ours.to(theirs.dtype))
    fp32_state = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in state.items()}
    assert torch.equal(compressor.decompress(fp32_state, scheme_args)["weight"].float(), ours)


def test_fp8_static_input_scale(tmp_path: Path) -> None:
    tensors = _tensors(write_compressed_tensors(tmp_path / "fp8", "FP8", seed=SEED))
    input_scales = [v for k, v in tensors.items() if k.endswith(".input_scale")]
    assert len(input_scales) == 14
    assert all(s.shape == (1,) and s.dtype == torch.bfloat16 and s.item() > 0 for s in input_scales)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(bits=8),
        dict(group_size=32, desc_act=True),
        dict(group_size=64, sym=False),
        dict(group_size=-1),
        dict(bits=8, group_size=32, desc_act=True, sym=False),
    ],
    ids=str,
)
def test_gptq_round_trip(options: dict, tmp_path: Path, base_weights) -> None:
    out = write_gptq(tmp_path / "gptq", seed=SEED, **options)
    bits, group_size = options.get("bits", 4), options.get("group_size", 128)
    config = _quant_config(out)
    assert config == json.loads((out / "quantize_config.json").read_text())
    assert config["quant_method"] == "gptq" and config["checkpoint_format"] == "gptq"
    assert (config["bits"], config["group_size"]) == (bits, group_size)
    assert config["desc_act"] == options.get("desc_act", False)
    assert config["sym"] == options.get("sym", True)
    tensors = _tensors(out)
    assert tensors["model.norm.weight"].dtype == torch.float16
    q_proj = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q_proj}.qweight"].shape == (128 * bits // 32, 128)
    g_idx = tensors[f"{q_proj}.g_idx"].long()
    size = 128 if group_size == -1 else group_size
    # every group has group_size members; act-order scatters them, else they run in order
    assert torch.equal(torch.bincount(g_idx), torch.full((128 // size,), size))
    in_order = torch.equal(g_idx, torch.arange(128) // size)
    assert in_order == (not options.get("desc_act") or group_size == -1)
    if options.get("sym", True):  # zero 2^(bits-1) in every field, stored minus one
        assert (tensors[f"{q_proj}.qzeros"] == {4: 0x77777777, 8: 0x7F7F7F7F}[bits]).all()

    def step_of(module: str, original: torch.Tensor) -> torch.Tensor | None:
        if f"{module}.scales" not in tensors:
            return None
        return tensors[f"{module}.scales"].float()[tensors[f"{module}.g_idx"].long()].T

    _assert_within_one_step(base_weights, dequantized_weights(out), step_of)


@pytest.mark.parametrize("group_size", [128, 32])
def test_awq_round_trip(group_size: int, tmp_path: Path, base_weights) -> None:
    out = write_awq(tmp_path / "awq", group_size=group_size, seed=SEED)
    config = _quant_config(out)
    assert config == {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    tensors = _tensors(out)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16
    down = "model.layers.0.mlp.down_proj"  # in 256, out 128
    assert tensors[f"{down}.qweight"].shape == (256, 16)
    assert tensors[f"{down}.qzeros"].shape == tensors[f"{down}.scales"].shape[:1] + (16,)
    assert tensors[f"{down}.scales"].shape == (256 // group_size, 128)

    def step_of(module: str, original: torch.Tensor) -> torch.Tensor | None:
        if f"{module}.scales" not in tensors:
            return None
        return tensors[f"{module}.scales"].float().repeat_interleave(group_size, 0).T

    _assert_within_one_step(base_weights, dequantized_weights(out), step_of)


def test_word_layouts() -> None:
    """The documented bit positions, as literals: GPTQ puts input row r at bits 4*(r%8) of
    word r//8; AutoAWQ puts output columns 0,2,4,6,1,3,5,7 at bits 0,4,...,28."""
    ramp = torch.arange(8)
    assert pack_rows(ramp[:, None], 4).item() == 0x76543210
    assert pack_columns(ramp[None, :], 4, AWQ_ORDER).item() == 0x75316420
    assert pack_rows(torch.tensor([[1], [2], [3], [255]]), 8).item() == 0xFF030201 - 2**32


@pytest.mark.parametrize("scheme", ["W4A16_G32", "W8A8"])
def test_transformers_loads_compressed_tensors(scheme: str, tmp_path: Path) -> None:
    """transformers' CPU model of the checkpoint computes reference_model's logits exactly
    when it leaves activations unquantized (it fake-quantizes them for W8A8)."""
    out = write_compressed_tensors(tmp_path / scheme, scheme, seed=SEED)
    tokens = torch.randint(0, 400, (1, 10), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        reference = reference_model(out)(tokens).logits
        weights_only = transformers_model(out, quantize_activations=False)(tokens).logits
        as_scheme = transformers_model(out)(tokens).logits
    assert torch.equal(weights_only, reference)
    assert torch.equal(as_scheme, reference) == (scheme == "W4A16_G32")
    assert (as_scheme - reference).abs().max() < 2.0
