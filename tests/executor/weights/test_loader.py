"""Weights from GGUF files and HF directories against what transformers loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import llama_cpp_permute
from tiny_models import tiny_hf_config, tiny_hf_model

from zllm.executor.weights.loader import hf_name_from_gguf, load_weights, unpermute_rope_rows
from zllm.model.arch import read_arch_config
from zllm.model.registry import family_named


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm2_path: str, smollm2_hf) -> None:
    expected = smollm2_hf.state_dict()
    arch = read_arch_config(smollm2_path)
    ours = dict(load_weights(smollm2_path, arch))
    # Tied: lm_head is the embedding, so it is not yielded separately.
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("shape", [(3 * 8, 5), (3 * 8,)])
def test_unpermute_inverts_llama_cpp_permute(shape: tuple[int, ...]) -> None:
    weight = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(weight, 3), 8), weight)
    # Within a head, GGUF row 2i holds HF row i and row 2i+1 holds HF row i + head_dim/2.
    permuted = llama_cpp_permute(weight, 3)
    assert np.array_equal(permuted[1], weight[4]) and np.array_equal(permuted[8 + 2], weight[9])


def test_gguf_names() -> None:
    """Model-wide names are llama.cpp's; a layer's are its family's (Gemma 3's ffn_norm is
    the norm before the MLP, Llama's the one after the attention)."""
    llama = family_named("llama").gguf_tensor_names
    gemma3 = family_named("gemma3").gguf_tensor_names
    assert hf_name_from_gguf("token_embd.weight", llama) == "model.embed_tokens.weight"
    assert hf_name_from_gguf("output.weight", llama) == "lm_head.weight"
    assert hf_name_from_gguf("blk.7.attn_q.bias", llama) == "model.layers.7.self_attn.q_proj.bias"
    assert (
        hf_name_from_gguf("blk.0.ffn_norm.weight", llama)
        == "model.layers.0.post_attention_layernorm.weight"
    )
    assert (
        hf_name_from_gguf("blk.0.ffn_norm.weight", gemma3)
        == "model.layers.0.pre_feedforward_layernorm.weight"
    )
    assert hf_name_from_gguf("blk.0.attn_q_norm.weight", llama) is None
    assert hf_name_from_gguf("rope_freqs.weight", llama) is None


def test_corrupt_gguf_raises_value_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(np.random.default_rng(2).bytes(1000))
    arch = None  # never reached: the header check comes first
    with pytest.raises(ValueError, match="is not a valid GGUF model file: bad magic"):
        next(load_weights(str(path), arch))


# ---------------------------------------------------------------------------------------------
# Hugging Face directories, from tiny random transformers models


def tiny_model(kind: str, tie: bool, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny config with its own vocabulary, MLP width, context, token ids (two EOS) and,
    for llama, rope theta and linear rope scaling: values the round trip checks."""
    overrides: dict = dict(
        vocab_size=96,
        intermediate_size=80,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    if kind == "llama":
        overrides |= dict(rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    else:
        overrides |= dict(rms_norm_eps=1e-6)
    return tiny_hf_model(tiny_hf_config(kind, **overrides), seed=0, dtype=dtype)


@pytest.mark.parametrize(("kind", "tie"), [("llama", False), ("llama", True), ("qwen2", True)])
def test_hf_dir_round_trip(tmp_path: Path, kind: str, tie: bool) -> None:
    model = tiny_model(kind, tie)
    model.save_pretrained(tmp_path)
    config = model.config

    arch = read_arch_config(str(tmp_path))
    assert arch.architecture == kind
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (96, 64, 80)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (2, 4, 2, 16)
    assert arch.rms_norm_eps == config.rms_norm_eps
    assert arch.rope_theta == config.rope_parameters["rope_theta"]
    assert arch.max_position_embeddings == 256
    assert arch.tie_word_embeddings is tie
    assert arch.attention_bias is (kind == "qwen2")
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, [2, 3])
    expected_scaling = {"rope_type": "linear", "factor": 2.0} if kind == "llama" else None
    assert arch.rope_scaling == expected_scaling

    expected = model.state_dict()
    if tie:
        del expected["lm_head.weight"]
    ours = dict(load_weights(str(tmp_path), arch))
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    if kind == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in ours


def test_hf_dir_bf16_becomes_fp32_and_shards_are_all_read(tmp_path: Path) -> None:
    model = tiny_model("llama", tie=False, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = dict(load_weights(str(tmp_path), read_arch_config(str(tmp_path))))
    expected = model.state_dict()
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name].float()), name


def test_hf_dir_without_safetensors(tmp_path: Path) -> None:
    tiny_model("qwen2", tie=True).config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no \\*.safetensors files"):
        next(load_weights(str(tmp_path), read_arch_config(str(tmp_path))))


# ---- --load-format dummy -----------------------------------------------------------------


def without_weights(tmp_path: Path, arch: str = "llama", **overrides) -> str:
    """A model directory with config.json and a tokenizer but no weight file."""
    from tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path / arch, arch=arch, weights=False, **overrides)
    assert not list(path.glob("*.safetensors"))
    return str(path)


def test_dummy_weights_need_no_weight_file(tmp_path: Path) -> None:
    from zllm import LLM, SamplingParams

    path = without_weights(tmp_path)
    with pytest.raises(ValueError, match="no \\*.safetensors.*--load-format dummy"):
        LLM(path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    answers = []
    for _ in range(2):
        llm = LLM(path, load_format="dummy", kv_cache_memory_bytes=8 << 20)
        model = llm.model_runner.model
        assert llm.model_runner.quantization == "none"
        for name, param in model.named_parameters():
            assert torch.isfinite(param).all(), name
            if param.dim() >= 2:  # every matrix drawn, within +-1/sqrt(fan-in)
                bound = param.shape[-1] ** -0.5
                assert 0 < param.abs().max() <= bound and param.std() > bound / 4, name
        out = llm.generate(["a prompt", "another one"], params, use_tqdm=False)
        answers.append([o.outputs[0].token_ids for o in out])
    assert answers[0] == answers[1]  # seeded: the same weights at every load
    assert len(answers[0][0]) == 12


def test_dummy_weights_through_the_transformers_backend(tmp_path: Path) -> None:
    from zllm import LLM, SamplingParams

    path = without_weights(tmp_path, "gpt_neox", num_key_value_heads=None)
    llm = LLM(path, load_format="dummy", kv_cache_memory_bytes=8 << 20)
    assert llm.config.model_impl == "transformers"
    out = llm.generate(["a prompt"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_dummy_weights_refuse_the_gguf_kernels(smollm2_path: str) -> None:
    """A GGUF file read for its shapes only: fp32 random weights, and the kernel that would
    read its blocks is refused by name."""
    from zllm.config.engine_args import EngineArgs

    with pytest.raises(ValueError, match="--load-format dummy does not load"):
        EngineArgs(smollm2_path, load_format="dummy", quantization="gguf").create_engine_config()
