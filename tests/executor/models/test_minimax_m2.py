"""MiniMax-M2 (minimax_m2) on Llama's model: both forms read as one architecture (q/k norms
over all heads, rotary_dim as a partial rotation, sigmoid routing with its correction bias under
Mixtral's names), and the config values transformers' class would not run refused by name.
Parity (HF directory and GGUF) is the registry test's `minimax_m2` row."""

from __future__ import annotations

import json

import pytest
import torch
from family_cases import CASES
from llama_cpp_convert import convert_hf_to_gguf
from safetensors.torch import load_file

from zllm.executor.layers.moe.router import SIGMOID_BIAS_TOPK, rule_of
from zllm.executor.weights.loader import load_weights
from zllm.model.arch import read_arch_config


@pytest.fixture(scope="module")
def m2_dir(tmp_path_factory):
    return CASES["minimax_m2"].write(tmp_path_factory.mktemp("m2") / "hf")


def test_both_forms_read_as_one_architecture(m2_dir, tmp_path) -> None:
    hf = read_arch_config(str(m2_dir))
    gguf_path = convert_hf_to_gguf(m2_dir, tmp_path / "m2.gguf", "f32")
    gguf = read_arch_config(str(gguf_path))
    assert hf.qk_norm_whole and not hf.qk_norm
    assert hf.rope_scaling["partial_rotary_factor"] == 0.5  # rotary_dim 8 of 16
    assert hf.moe.sigmoid_scores and hf.moe.norm_topk_prob and hf.moe.dense_mlp_layers == ()
    for field in ("moe", "qk_norm_whole", "num_layers", "head_dim", "rope_scaling"):
        assert getattr(gguf, field) == getattr(hf, field), field
    rule = rule_of(hf)
    assert (rule.router, rule.group_count, rule.routed_scaling) == (SIGMOID_BIAS_TOPK, 1, 1.0)
    stored = load_file(str(next(m2_dir.glob("*.safetensors"))))
    bias = stored["model.layers.1.block_sparse_moe.e_score_correction_bias"]
    assert bias.abs().sum() > 0
    for path in (m2_dir, gguf_path):
        loaded = dict(load_weights(str(path), read_arch_config(str(path))))
        name = next(n for n in loaded if n.startswith("model.layers.1.") and "e_score" in n)
        assert torch.equal(loaded[name], bias), path


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"qk_norm_type": "per_head"}, "qk_norm_type 'per_head'"),
        ({"use_qk_norm": False}, "use_qk_norm False"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ],
)
def test_what_transformers_would_not_run_is_refused(m2_dir, tmp_path, change, refusal) -> None:
    changed = tmp_path / "changed"
    changed.mkdir()
    config = json.loads((m2_dir / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=refusal):
        read_arch_config(str(changed))
