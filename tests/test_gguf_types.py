"""Every GGUF weight type loads: bit for bit what gguf-py dequantizes, and transformers' outputs.

Each type gets a tiny Llama GGUF (hidden 256, the K-quants' block) whose every matrix is stored
in it: quantized by gguf-py where it can, else random blocks with sane fp16 scales. Files that
mix types check how the CPU kernel (Q4_0-Q8_0 and Q4_K-Q6_K blocks) shares a model with fp32
matmuls, and how one fused matmul reads parts stored in different types.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from gguf_files import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    MIXED_TYPES,
    gguf_dequantizes,
    llama_cpp_permute,
    write_llama_gguf,
)
from parity import assert_greedy_parity, hf_greedy

from zllm import LLM, SamplingParams
from zllm.executor.weights.blocks import gguf_kernel_plan
from zllm.executor.weights.gguf_modules import GGUFLinear, GGUFSplitLinear
from zllm.executor.weights.loader import load_weights
from zllm.model.arch import read_arch_config

# Every type gguf-py dequantizes (test_the_list_is_every_type_gguf_py_dequantizes keeps it so).
DEQUANTIZABLE = [
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ4_NL, T.IQ4_XS,
    T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
    T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4,
]  # fmt: skip

# ---------------------------------------------------------------------------------------------
# The files (tests/gguf_files.py writes them)


@pytest.fixture(scope="module")
def gguf_of_type(tmp_path_factory: pytest.TempPathFactory) -> Callable:
    """type -> (path, stored tensors) of the model whose every matrix is of that type."""

    @cache
    def make(ggml_type: T) -> tuple[str, dict]:
        path = tmp_path_factory.mktemp("gguf") / f"tiny-{ggml_type.name}.gguf"
        return str(path), write_llama_gguf(path, lambda name: ggml_type)

    return make


# ---------------------------------------------------------------------------------------------
# Loading: bit for bit what gguf-py dequantizes


def test_the_list_is_every_type_gguf_py_dequantizes() -> None:
    assert set(DEQUANTIZABLE) == {t for t in T if gguf_dequantizes(t)}


@pytest.mark.parametrize("ggml_type", DEQUANTIZABLE, ids=lambda t: t.name)
def test_loaded_weights_are_gguf_py_dequantization_bit_for_bit(gguf_of_type, ggml_type) -> None:
    path, stored = gguf_of_type(ggml_type)
    arch = read_arch_config(path)
    ours = dict(load_weights(path, arch))
    for gguf_name, (stored_type, data) in stored.items():
        expected = dequantize(data, stored_type).reshape(data.shape[0], -1).astype(np.float32)
        assert np.isfinite(expected).all() and 0.01 < expected.std() < 1, gguf_name
        tensor = ours[hf_name(gguf_name)]
        assert tensor.dtype == torch.float32 and tensor.shape == expected.shape, gguf_name
        got = tensor.numpy()
        if gguf_name.split(".")[-2] in ("attn_q", "attn_k"):  # back to llama.cpp's row order
            got = llama_cpp_permute(got, HEADS if "attn_q" in gguf_name else KV_HEADS)
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), gguf_name


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, key, _ = gguf_name.split(".")
    module = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }[key]
    return f"model.layers.{layer}.{module}.weight"


def test_a_type_gguf_py_cannot_dequantize_names_tensor_and_type(tmp_path: Path) -> None:
    path = tmp_path / "q8_1.gguf"
    write_llama_gguf(path, lambda name: T.Q8_1 if name == "blk.1.ffn_up.weight" else T.Q8_0)
    with pytest.raises(ValueError, match="tensor 'blk.1.ffn_up.weight' uses Q8_1, which gguf"):
        dict(load_weights(str(path), read_arch_config(str(path))))


# ---------------------------------------------------------------------------------------------
# Generating: the same greedy tokens as transformers loading the same file

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 77, 300, 12], list(range(40, 71)), [400, 3, 3, 9, 250, 31, 100]]


def check_greedy_parity(path: str, llm: LLM, label: str) -> None:
    from transformers import AutoModelForCausalLM

    gguf = Path(path)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
        ours = out.outputs[0].token_ids
        theirs = hf_greedy(hf_model, prompt, len(ours))
        assert_greedy_parity(hf_model, prompt, ours, theirs, label=f"{label}[{i}]")


def tiny_llm(path: str, **kwargs) -> LLM:
    return LLM(path, kv_cache_memory_bytes=16 << 20, max_num_seqs=4, **kwargs)


@pytest.mark.parametrize("ggml_type", [T.Q3_K, T.IQ4_XS, T.Q2_K], ids=lambda t: t.name)
def test_greedy_matches_transformers_on_fp32_dequantized_types(gguf_of_type, ggml_type) -> None:
    path, _ = gguf_of_type(ggml_type)
    llm = tiny_llm(path)
    assert llm.model_runner.quantization == "none"  # no kernel for these: fp32 matmuls
    check_greedy_parity(path, llm, ggml_type.name)


KERNEL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16]


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_greedy_matches_transformers_on_kernel_types(gguf_of_type, ggml_type) -> None:
    path, _ = gguf_of_type(ggml_type)
    llm = tiny_llm(path)
    assert llm.model_runner.quantization == "gguf"
    model = llm.model_runner.model
    assert all(isinstance(layer.mlp.down_proj, GGUFLinear) for layer in model.layers)
    assert model.logits_proj is not None and model.embed_rows is not None
    assert model.lm_head.numel() == 0 and model.embed_tokens.numel() == 0  # no fp32 copies
    check_greedy_parity(path, llm, ggml_type.name)


# ---------------------------------------------------------------------------------------------
# Files mixing types: the kernel serves what it can, fp32 the rest; asked for, it refuses


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_llama_gguf(path, lambda name: MIXED_TYPES[name.removesuffix(".weight")])
    return str(path)


def test_mixed_file_uses_the_kernel_where_it_can(mixed_gguf: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="zllm.executor.weights.blocks")
    llm = tiny_llm(mixed_gguf)
    assert llm.model_runner.quantization == "gguf"
    layers = llm.model_runner.model.layers
    kinds = [
        [type(m).__name__ for m in (a.qkv_proj, a.o_proj, p.gate_up_proj, p.down_proj)]
        for a, p in ((layer.self_attn, layer.mlp) for layer in layers)
    ]
    assert kinds == [
        ["GGUFLinear", "Linear", "GGUFLinear", "Linear"],
        ["GGUFSplitLinear", "GGUFLinear", "GGUFSplitLinear", "GGUFLinear"],
    ]
    # q and k (Q5_0) share one kernel call, v (Q8_0) has its own.
    qkv = layers[1].self_attn.qkv_proj
    assert [(w.shape[0], t) for w, t in qkv.parts] == [(HIDDEN + KV_HEADS * HEAD_DIM, 6), (128, 8)]
    assert llm.model_runner.model.logits_proj is None  # Q2_K logits: fp32
    assert llm.model_runner.model.embed_rows is not None  # Q4_K embedding: blocks
    assert (
        "GGUF kernels: 6 of 8 decoder matmuls, not the logits and the embedding read GGUF "
        "blocks; 2 multiply fp32 weights dequantized at load (first: tensor "
        "'blk.0.attn_output.weight' is Q3_K"
    ) in caplog.text
    check_greedy_parity(mixed_gguf, llm, "mixed")


def test_asked_for_gguf_kernels_refuse_a_mixed_file_naming_the_tensor(mixed_gguf: str) -> None:
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_output.weight' is Q3_K .*unset"):
        tiny_llm(mixed_gguf, quantization="gguf")


def test_fused_matmul_of_two_kernel_types_runs_one_call_per_type(tmp_path: Path) -> None:
    """q/k Q4_1 with v Q8_0: one fused qkv matmul, two kernel calls writing their columns."""
    path = tmp_path / "v8.gguf"
    write_llama_gguf(path, lambda name: T.Q8_0 if "attn_v" in name else T.Q4_1)
    assert gguf_kernel_plan(str(path), strict=True) is None
    llm = tiny_llm(str(path), quantization="gguf")
    qkv = llm.model_runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFSplitLinear) and [t for _, t in qkv.parts] == [3, 8]
    check_greedy_parity(str(path), llm, "v8")


def test_file_without_kernel_types_runs_fp32_and_says_why(gguf_of_type, caplog) -> None:
    caplog.set_level(logging.INFO, logger="zllm.executor.weights.model_weights")
    path, _ = gguf_of_type(T.Q3_K)
    assert tiny_llm(path).model_runner.quantization == "none"
    assert (
        "GGUF kernels not used, fp32 matmuls: the kernel reads none of its matrices' types "
        "(Q3_K)" in caplog.text
    )
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_q.weight' is Q3_K"):
        tiny_llm(path, quantization="gguf")
