"""A quantized checkpoint's quantization_config read and checked before any process starts
(zllm/config/quantization.py): each method's fields, the refusals naming the field, and
--quantization agreeing with the checkpoint."""

from __future__ import annotations

import json

import pytest

from zllm.config.engine_args import EngineArgs
from zllm.config.quantization import (
    WeightFormat,
    check_quantization,
    read_checkpoint_quantization,
)

W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 128},
        }
    },
    "ignore": ["lm_head", "re:.*mlp.down_proj$"],
}  # fmt: skip


def _dir_with(tmp_path, tiny_llama_dir, quant: dict) -> str:
    """The tiny model's config with `quant` as its quantization_config (no weights needed:
    the config is all these checks read)."""
    source = json.loads(open(f"{tiny_llama_dir}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**source, "quantization_config": quant}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(f"{tiny_llama_dir}/{name}", "rb").read())
    return str(tmp_path)


def test_compressed_tensors_groups_targets_and_ignore(tmp_path, tiny_llama_dir):
    quant = read_checkpoint_quantization(_dir_with(tmp_path, tiny_llama_dir, W4A16))
    assert quant is not None and quant.method == "compressed-tensors"
    fmt = quant.format_of("model.layers.0.self_attn.q_proj")
    assert fmt == WeightFormat(kind="int", bits=4, group_size=128)
    assert quant.format_of("model.layers.0.mlp.down_proj") is None  # re: ignore
    assert quant.format_of("lm_head") is None
    assert quant.describe() == (
        "compressed-tensors pack-quantized: int4 weights (group 128, symmetric)"
    )


@pytest.mark.parametrize(
    ("quant", "field"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "quantization_config.bits = 3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size = 100"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version = 'gemv'"),
        ({"quant_method": "awq", "bits": 8}, "AWQ checkpoints are 4-bit"),
        ({**W4A16, "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparse checkpoints"),
        (
            {**W4A16, "config_groups": {"g": {"weights": {"num_bits": 2, "type": "int"}}}},
            "config_groups.g.weights.num_bits = 2",
        ),
        (
            {**W4A16, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}},
            "float weights of 8 bits",
        ),
        (
            {**W4A16, "config_groups": {"g": {"format": "nvfp4-pack-quantized"}}},
            "config_groups.g.format = 'nvfp4-pack-quantized'",
        ),
        (
            {**W4A16, "config_groups": {"g": {
                "weights": {"num_bits": 4, "type": "int", "strategy": "tensor_group"}}}},
            "strategy = 'tensor_group'",
        ),
    ],
)  # fmt: skip
def test_unreadable_configs_are_refused_naming_the_field(tmp_path, tiny_llama_dir, quant, field):
    model = _dir_with(tmp_path, tiny_llama_dir, quant)
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=model, device="cpu").create_engine_config()


def test_the_checkpoint_method_is_the_default_and_others_are_refused(tmp_path, tiny_llama_dir):
    model = _dir_with(tmp_path, tiny_llama_dir, W4A16)
    config = EngineArgs(model=model, device="cpu").create_engine_config()
    assert config.quantization == "compressed-tensors"
    explicit = EngineArgs(model=model, device="cpu", quantization="compressed-tensors")
    assert explicit.create_engine_config().quantization == "compressed-tensors"
    for other in ("gptq", "none", "int8"):
        args = EngineArgs(model=model, device="cpu", quantization=other)
        with pytest.raises(ValueError, match=f"--quantization {other} cannot read them"):
            args.create_engine_config()


def test_a_checkpoint_method_on_an_unquantized_checkpoint_is_refused(tiny_llama_dir):
    args = EngineArgs(model=tiny_llama_dir, device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="has no quantization_config"):
        args.create_engine_config()


def test_combinations_refused_with_their_reason(tmp_path, tiny_llama_dir):
    act_order = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    model = _dir_with(tmp_path, tiny_llama_dir, act_order)
    assert read_checkpoint_quantization(model).act_order
    with pytest.raises(ValueError, match="act-order checkpoint .* tensor-parallel"):
        EngineArgs(model=model, device="cpu", tensor_parallel_size=2).create_engine_config()
    # A GPU reads the blocks too (csrc/block_gemv.cu): the config lets it through.
    where = dict(model_path=model, load_format="auto", model_impl="zllm", tensor_parallel_size=1)
    assert check_quantization(None, device="cuda", **where) == "gptq"
    with pytest.raises(ValueError, match="runs on CPU only"):
        check_quantization("gguf-int8", device="cuda", **where)
    with pytest.raises(ValueError, match="--model-impl transformers"):
        EngineArgs(model=model, device="cpu", model_impl="transformers").create_engine_config()
