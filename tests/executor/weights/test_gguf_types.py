"""Every GGUF weight type loads: bit for bit what gguf-py dequantizes, and transformers' outputs.

Each type gets a tiny Llama GGUF (hidden 256, the K-quants' block) whose every matrix is stored
in it: quantized by gguf-py where it can, else random blocks with sane fp16 scales. The CPU
kernel multiplies each in its blocks (Q4_0-Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS, MXFP4, the
IQ1-IQ3 lattice types, TQ1_0/TQ2_0, NVFP4, F16/BF16); the weights it holds are the file's
bytes. Files that mix types check how the kernel shares a model with fp32 matmuls, and how one
fused matmul reads parts stored in different types.
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
    LlamaDims,
    gguf_dequantizes,
    llama_cpp_permute,
    write_llama_gguf,
)
from parity import assert_greedy_parity, hf_greedy
from resident_memory import resident_after_load
from torch import nn

from zllm import LLM, SamplingParams
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.layers.linear.gguf import GGUFEmbedding, GGUFLinear, GGUFSplitLinear
from zllm.executor.weights.blocks import gguf_kernel_plan
from zllm.executor.weights.loader import load_weights
from zllm.model.arch import read_arch_config
from zllm.model.gguf import read_gguf

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


KERNEL_TYPES = [
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K,
    T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4,
    T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
    T.TQ1_0, T.TQ2_0, T.NVFP4,
    T.F16, T.BF16,
]  # fmt: skip


def test_every_type_gguf_py_dequantizes_is_multiplied_by_the_kernel() -> None:
    """In its blocks: only F32 matrices keep fp32 matmuls."""
    assert sorted(KERNEL_TYPES) == sorted(T(t) for t in cpu_kernels.SUPPORTED_GGML_TYPES)
    assert set(DEQUANTIZABLE) == {*KERNEL_TYPES, T.F32}


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_greedy_matches_transformers_on_kernel_types(gguf_of_type, ggml_type, caplog) -> None:
    caplog.set_level(logging.INFO, logger="zllm.executor.weights.blocks")
    path, _ = gguf_of_type(ggml_type)
    llm = tiny_llm(path, quantization="gguf-float")  # transformers' arithmetic: bitwise parity
    model = llm.model_runner.model
    assert all(isinstance(layer.mlp.down_proj, GGUFLinear) for layer in model.layers)
    assert model.logits_proj is not None and model.embed_rows is not None
    assert model.lm_head.numel() == 0 and model.embed_tokens.numel() == 0  # no fp32 copies
    assert f"GGUF weight types: in blocks {ggml_type.name}\n" in caplog.text
    check_greedy_parity(path, llm, ggml_type.name)


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the blocks the kernel modules hold, bytes of fp32 matrices)."""
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, GGUFLinear | GGUFEmbedding):
            tensors[module.qweight.data_ptr()] = module.qweight
        elif isinstance(module, GGUFSplitLinear):
            tensors |= {rows.data_ptr(): rows for rows, _ in module.parts}
    fp32 = sum(p.nbytes for p in model.parameters() if p.dim() >= 2)
    return sum(t.nbytes for t in tensors.values()), fp32


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_weights_held_are_the_files_blocks(gguf_of_type, ggml_type):
    """What stays in memory for the matrices: the file's bytes, whatever the type (the IQ1-IQ3,
    TQ and NVFP4 ones too: no 16-bit or fp32 copy)."""
    path, _ = gguf_of_type(ggml_type)
    model = tiny_llm(path).model_runner.model
    matrices = [info for info in read_gguf(path).tensors.values() if len(info.shape) == 2]
    assert held_bytes(model) == (sum(info.nbytes for info in matrices), 0)


# Big enough that fp32 weights (~290 MB) overshoot the bound that the file's blocks meet.
RESIDENT_DIMS = LlamaDims(hidden=1024, ffn=2816, heads=8, kv_heads=4, layers=6)


@pytest.mark.parametrize("ggml_type", [T.Q3_K, T.Q2_K, T.IQ2_XXS], ids=lambda t: t.name)
def test_executor_memory_after_load_is_the_weights_the_pool_and_150_mb(tmp_path, ggml_type):
    """The executor's resident growth at load (its own process) stays within the file + the KV
    pool + 150 MB (fp32 weights, quantization none, do not fit that bound): IQ2_XXS too, read
    in its blocks (2.06 bits a weight), where it had been held as 16-bit rows (16 bits)."""
    path = tmp_path / f"resident-{ggml_type.name}.gguf"
    write_llama_gguf(path, lambda name: ggml_type, dims=RESIDENT_DIMS)
    bound = path.stat().st_size + (64 << 20) + (150 << 20)
    grown = {"gguf": _growth_at_load(path, "gguf")}
    # fp32 rows of RESIDENT_DIMS whatever the file's type: measured on the first file only.
    if "none" not in _FP32_GROWTH:
        _FP32_GROWTH["none"] = _growth_at_load(path, "none")
    grown["none"] = _FP32_GROWTH["none"]
    print(f"{ggml_type.name}: resident growth at load {grown}, bound {bound}")
    assert grown["gguf"] <= bound
    assert grown["none"] > bound


_FP32_GROWTH: dict[str, int] = {}


def _growth_at_load(path, method: str) -> int:
    measured = resident_after_load(str(path), method)
    return measured["after"] - measured["before"]


# ---------------------------------------------------------------------------------------------
# Files mixing types: the kernel serves what it can, fp32 the rest; asked for, it refuses


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_llama_gguf(path, lambda name: MIXED_TYPES[name.removesuffix(".weight")])
    return str(path)


def test_mixed_file_uses_the_kernel_where_it_can(mixed_gguf: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="zllm.executor.weights.blocks")
    # Not asked for (the default): served where the kernel can; gguf-float's arithmetic, for
    # bitwise parity (the default's own choice per type: tests/test_gguf_arithmetic.py).
    llm = tiny_llm(mixed_gguf, deterministic=True)
    assert llm.model_runner.quantization == "gguf-float"
    layers = llm.model_runner.model.layers
    kinds = [  # (under --deterministic each matmul is wrapped: batch_invariant.Tiled)
        [type(m.inner).__name__ for m in (a.qkv_proj, a.o_proj, p.gate_up_proj, p.down_proj)]
        for a, p in ((layer.self_attn, layer.mlp) for layer in layers)
    ]
    # F32 o_proj and down_proj: fp32 modules, DenseRowsLinear (layers/linear/dense.py)
    fp32 = "DenseRowsLinear"
    assert kinds == [
        ["GGUFLinear", fp32, "GGUFLinear", fp32],
        ["GGUFSplitLinear", "GGUFLinear", "GGUFSplitLinear", "GGUFLinear"],
    ]
    # q and k (Q5_0) share one kernel call, v (Q8_0) has its own.
    qkv = layers[1].self_attn.qkv_proj.inner
    assert [(w.shape[0], t) for w, t in qkv.parts] == [(HIDDEN + KV_HEADS * HEAD_DIM, 6), (128, 8)]
    assert llm.model_runner.model.logits_proj is None  # F32 logits: fp32
    assert llm.model_runner.model.embed_rows is not None  # IQ4_XS embedding: blocks
    assert (
        "GGUF kernels: 6 of 8 decoder matmuls, not the logits and the embedding read GGUF "
        "blocks; 2 multiply fp32 weights dequantized at load (first: tensor "
        "'blk.0.attn_output.weight' is F32"
    ) in caplog.text
    assert (
        "GGUF weight types: in blocks Q4_1, Q5_0, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS\n"
    ) in caplog.text
    check_greedy_parity(mixed_gguf, llm, "mixed")


def test_asked_for_gguf_kernels_refuse_a_mixed_file_naming_the_tensor(mixed_gguf: str) -> None:
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_output.weight' is F32 .*unset"):
        tiny_llm(mixed_gguf, quantization="gguf")


def test_fused_matmul_of_two_kernel_types_runs_one_call_per_type(tmp_path: Path) -> None:
    """q/k Q4_1 with v Q8_0: one fused qkv matmul, two kernel calls writing their columns."""
    path = tmp_path / "v8.gguf"
    write_llama_gguf(path, lambda name: T.Q8_0 if "attn_v" in name else T.Q4_1)
    assert gguf_kernel_plan(str(path), strict=True) is None
    llm = tiny_llm(str(path), quantization="gguf-float")
    qkv = llm.model_runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFSplitLinear) and [t for _, t in qkv.parts] == [3, 8]
    check_greedy_parity(str(path), llm, "v8")


def test_file_without_kernel_types_runs_fp32_and_says_why(gguf_of_type, caplog) -> None:
    caplog.set_level(logging.INFO, logger="zllm.executor.host.model_weights")
    path, _ = gguf_of_type(T.F32)
    assert tiny_llm(path).model_runner.quantization == "none"
    assert (
        "GGUF kernels not used, fp32 matmuls: the kernel reads none of its matrices' types "
        "(F32)" in caplog.text
    )
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_q.weight' is F32"):
        tiny_llm(path, quantization="gguf")


# Like llama.cpp's IQ2_XXS / IQ3_XXS presets: lattice-coded matrices beside IQ4_XS and K-quant
# ones, v of another type than q/k.
IQ_PRESET_TYPES = {
    "attn_q": T.IQ2_XXS,
    "attn_k": T.IQ2_XXS,
    "attn_v": T.IQ4_XS,
    "attn_output": T.IQ3_XXS,
    "ffn_gate": T.IQ2_XXS,
    "ffn_up": T.IQ2_XXS,
    "ffn_down": T.IQ3_S,
    "token_embd": T.Q2_K,
    "output": T.Q5_K,
}


@pytest.mark.parametrize("method", ["gguf-float", "gguf-int8"])
def test_iq_preset_mixes_lattice_and_other_blocks_in_one_matmul(tmp_path, method, caplog) -> None:
    """q/k in IQ2_XXS blocks and v in IQ4_XS ones share one fused matmul (a kernel call each);
    the log names the types read in blocks, and under gguf-int8 which take integer dots.
    Asked for, the method serves it all."""
    caplog.set_level(logging.INFO, logger="zllm.executor.weights.blocks")
    path = tmp_path / "iq-preset.gguf"
    write_llama_gguf(path, lambda name: IQ_PRESET_TYPES[name.split(".")[-2]])
    llm = tiny_llm(str(path), quantization=method)
    qkv = llm.model_runner.model.layers[0].self_attn.qkv_proj
    parts = [t for _, t in qkv.parts]
    assert isinstance(qkv, GGUFSplitLinear) and parts == [int(T.IQ2_XXS), int(T.IQ4_XS)]
    assert not qkv.int8_activations
    expected = "GGUF weight types: in blocks Q2_K, Q5_K, IQ2_XXS, IQ3_XXS, IQ3_S, IQ4_XS"
    if method == "gguf-int8":
        integer = "Q2_K, Q5_K up to 4 rows"
        expected += f"; gguf-int8 ({cpu_kernels.cpu_isa()}): integer dots for {integer}, "
        expected += "the float kernel for the rest"
        assert llm.model_runner.model.logits_proj.int8_activations  # Q5_K: integer dots
    assert expected + "\n" in caplog.text
    if method == "gguf-float":  # (gguf-int8 rounds the logits' input: a near-tie may go further)
        check_greedy_parity(str(path), llm, "iq-preset")
