"""Every GGUF weight type loads: bit for bit what gguf-py dequantizes, and transformers' outputs.

Each type gets a tiny Llama GGUF (hidden 256, the K-quants' block) whose every matrix is stored
in it: quantized by gguf-py where it can, else random blocks with sane fp16 scales. Files that
mix types check how the CPU kernel (Q4_0-Q8_0 and Q4_K-Q6_K blocks) shares a model with fp32
matmuls, and how one fused matmul reads parts stored in different types.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from parity import assert_greedy_parity, hf_greedy
from test_loader import llama_cpp_permute
from tiny_models import build_tiny_tokenizer

from zllm import LLM, SamplingParams
from zllm.executor.weights.blocks import gguf_kernel_plan
from zllm.executor.weights.gguf_modules import GGUFLinear, GGUFSplitLinear
from zllm.executor.weights.loader import load_weights
from zllm.model.arch import read_arch_config

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
WEIGHT_STD = 0.08

# Every type gguf-py dequantizes (test_the_list_is_every_type_gguf_py_dequantizes keeps it so).
DEQUANTIZABLE = [
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ4_NL, T.IQ4_XS,
    T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
    T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4,
]  # fmt: skip

# Byte offsets of the fp16 scales in one block, for types gguf-py cannot quantize: random
# bytes elsewhere are bounded integers (quants, sub-block scales), so the values stay finite.
F16_SCALE_OFFSETS = {
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.IQ1_S: (0,),
}


# ---------------------------------------------------------------------------------------------
# Writing the files


def matrix_shapes(vocab: int) -> dict[str, tuple[int, int]]:
    """GGUF name -> (rows, columns) of every matrix of the tiny model (untied logits)."""
    kv = KV_HEADS * HEAD_DIM
    per_layer = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (kv, HIDDEN),
        "attn_v": (kv, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.{key}.weight": shape for key, shape in per_layer.items()}
    return shapes


def stored_matrix(shape: tuple[int, int], ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """What the file holds for a matrix of `shape` in `ggml_type`: floats or raw blocks."""
    if not gguf_dequantizes(ggml_type):  # only for load errors: its values are never read
        return random_bytes(shape, ggml_type, rng).reshape(shape[0], -1)
    if ggml_type in F16_SCALE_OFFSETS or ggml_type in (T.IQ1_M, T.NVFP4):
        return random_blocks(shape, ggml_type, rng)
    weights = (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)
    return weights if ggml_type == T.F32 else quantize(weights, ggml_type)


def random_blocks(shape: tuple[int, int], ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """Random blocks, their scales set so the values spread about WEIGHT_STD around zero
    (a model whose weights share one sign answers every prompt with the same token)."""
    blocks = random_bytes(shape, ggml_type, rng)
    if ggml_type == T.NVFP4:  # four E4M3 scales: exponents 2-4 give 2^-6..2^-3 (times 1/2)
        blocks[:, :4] = rng.integers(2, 5, (len(blocks), 4)) << 3 | rng.integers(0, 8, (1, 4))
        return blocks.reshape(shape[0], -1)
    d = rng.uniform(0.5, 1.5, len(blocks))
    scales = [d]
    if len(F16_SCALE_OFFSETS.get(ggml_type, ())) == 2:  # d * scale * q - dmin * min: centre it
        one, zero = np.ones_like(d), np.zeros_like(d)
        scaled = dequantize(set_scales(blocks, ggml_type, one, zero), ggml_type).mean()
        offset = -dequantize(set_scales(blocks, ggml_type, zero, one), ggml_type).mean()
        scales.append(d * scaled / offset)
    spread = dequantize(set_scales(blocks, ggml_type, *scales), ggml_type).std()
    set_scales(blocks, ggml_type, *(s * WEIGHT_STD / spread for s in scales))
    return blocks.reshape(shape[0], -1)


def random_bytes(shape: tuple[int, int], ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """[blocks, bytes per block] of random bytes for a `shape` matrix."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return rng.integers(0, 256, (shape[0] * shape[1] // block_size, type_size), np.uint8)


def set_scales(blocks: np.ndarray, ggml_type: T, *scales: np.ndarray) -> np.ndarray:
    """Write each block's fp16 scales (d, then dmin where the type has one); returns blocks."""
    if ggml_type == T.IQ1_M:  # d's four nibbles top the block's last four uint16s
        bits = scales[0].astype(np.float16).view(np.uint16)
        for k, byte in enumerate((49, 51, 53, 55)):
            blocks[:, byte] = blocks[:, byte] & 0x0F | ((bits >> 4 * k) & 0xF) << 4
        return blocks
    for offset, values in zip(F16_SCALE_OFFSETS[ggml_type], scales, strict=True):
        blocks[:, offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks


def write_tokenizer(writer: GGUFWriter) -> int:
    """The tiny byte-level BPE as GGUF metadata; returns the vocabulary size."""
    model = json.loads(build_tiny_tokenizer().to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    special = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(pair) for pair in model["merges"]])
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    return len(tokens)


def write_llama_gguf(path: Path, type_of: Callable[[str], T], seed: int = 0) -> dict:
    """A tiny Llama GGUF whose matrix `name` is stored in `type_of(name)`; norms are F32.
    Returns GGUF name -> (type, what was written), the reference for dequantization."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = write_tokenizer(writer)
    stored = {}
    for name, shape in matrix_shapes(vocab).items():
        ggml_type = type_of(name)
        data = stored_matrix(shape, ggml_type, rng)
        raw_dtype = None if data.dtype in (np.float32, np.float16) else ggml_type
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        stored[name] = (ggml_type, data)
    norms = ["output_norm.weight"]
    norms += [f"blk.{i}.{n}.weight" for i in range(LAYERS) for n in ("attn_norm", "ffn_norm")]
    for name in norms:
        writer.add_tensor(name, rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


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


def gguf_dequantizes(ggml_type: T) -> bool:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, 256 // block_size * type_size), np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


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

# Like llama.cpp's Q4_K_M and the Gemma 3 270M file (Q4_K and Q6_K beside Q5_0 and Q8_0, q/k
# and v of different types), with types the kernel does not read (Q3_K, IQ4_XS, Q2_K).
MIXED_TYPES = {
    "blk.0.attn_q": T.Q8_0,
    "blk.0.attn_k": T.Q8_0,
    "blk.0.attn_v": T.Q8_0,
    "blk.0.attn_output": T.Q3_K,
    "blk.0.ffn_gate": T.Q4_1,
    "blk.0.ffn_up": T.Q4_1,
    "blk.0.ffn_down": T.IQ4_XS,
    "blk.1.attn_q": T.Q5_0,
    "blk.1.attn_k": T.Q5_0,
    "blk.1.attn_v": T.Q8_0,
    "blk.1.attn_output": T.Q4_K,
    "blk.1.ffn_gate": T.Q4_K,
    "blk.1.ffn_up": T.Q5_K,
    "blk.1.ffn_down": T.Q6_K,
    "token_embd": T.Q4_K,
    "output": T.Q2_K,
}


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
    caplog.set_level(logging.INFO, logger="zllm.executor.model_host")
    path, _ = gguf_of_type(T.Q3_K)
    assert tiny_llm(path).model_runner.quantization == "none"
    assert (
        "GGUF kernels not used, fp32 matmuls: the kernel reads none of its matrices' types "
        "(Q3_K)" in caplog.text
    )
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_q.weight' is Q3_K"):
        tiny_llm(path, quantization="gguf")
