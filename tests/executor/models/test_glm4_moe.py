"""GLM-4.5 (glm4_moe) on Llama's model: its config keys and their GGUF forms read alike (the
sigmoid router with its groups and scale, shared experts, half-rotated heads, head norms,
biases), the converter's multi-token-prediction block past the decoder skipped, and the
router's correction bias loaded from both. Parity (HF directory and GGUF) is the registry
test's `glm4_moe` row; this reads that row's model."""

from __future__ import annotations

import pytest
import torch
from family_cases import CASES, GLM4_MOE
from llama_cpp_convert import convert_hf_to_gguf
from safetensors.torch import load_file

from zllm.executor.layers.moe.router import SIGMOID_BIAS_TOPK, rule_of
from zllm.executor.weights.loader import load_weights
from zllm.model.arch import read_arch_config
from zllm.model.gguf import read_gguf


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return CASES["glm4_moe"].write(tmp_path_factory.mktemp("glm") / "hf")


@pytest.fixture(scope="module")
def glm_gguf(glm_dir, tmp_path_factory):
    return convert_hf_to_gguf(glm_dir, tmp_path_factory.mktemp("glm-gguf") / "g.gguf", "f32")


def test_both_forms_read_as_one_architecture(glm_dir, glm_gguf) -> None:
    hf, gguf = read_arch_config(str(glm_dir)), read_arch_config(str(glm_gguf))
    assert (hf.family, gguf.family) == ("glm4_moe", "glm4_moe")
    moe = hf.moe
    assert moe.sigmoid_scores and moe.norm_topk_prob and moe.routed_scaling_factor == 2.5
    assert (moe.expert_group_count, moe.expert_groups_used) == (4, 2)
    assert moe.shared_expert_intermediate_size == 32 and moe.dense_mlp_layers == (0,)
    assert hf.qk_norm and hf.attention_bias
    assert hf.rope_scaling["partial_rotary_factor"] == 0.5
    for field in ("num_layers", "moe", "qk_norm", "attention_bias", "head_dim", "num_kv_heads"):
        assert getattr(gguf, field) == getattr(hf, field), field
    assert gguf.rope_scaling["partial_rotary_factor"] == 0.5
    rule = rule_of(hf)
    assert (rule.router, rule.shared_name, rule.shared_expert_gated) == (
        SIGMOID_BIAS_TOPK,
        "shared_experts",
        False,
    )


def test_the_prediction_block_is_in_both_files_and_not_read(glm_dir, glm_gguf) -> None:
    layers = GLM4_MOE["num_hidden_layers"]
    stored = load_file(str(next(glm_dir.glob("*.safetensors"))))
    assert f"model.layers.{layers}.eh_proj.weight" in stored
    tensors = read_gguf(str(glm_gguf)).tensors
    assert any(name.startswith(f"blk.{layers}.") for name in tensors)
    for path in (glm_dir, glm_gguf):
        loaded = dict(load_weights(str(path), read_arch_config(str(path))))
        if path == glm_gguf:  # (the directory's are read and left by copy_checkpoint, as
            # another pipeline stage's layer: the registry test's model loads without them)
            assert not any(name.startswith(f"model.layers.{layers}.") for name in loaded)
        name = "model.layers.2.mlp.gate.e_score_correction_bias"
        assert stored[name].abs().sum() > 0
        assert torch.equal(loaded[name], stored[name])
