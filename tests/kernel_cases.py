"""Cases shared by the GPU kernels' emulated tests (tests/test_csrc_moe.py,
tests/test_csrc_blocks.py) and their GPU runs (tests/test_cuda_moe.py, tests/test_cuda_quant.py):
random mixture-of-experts blocks (the layer's shape, which tests/test_moe.py uses too) and
their float64 reference, random quantized blocks of each
type the GPU reads, the quantized checkpoints the model tests load."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf_files import stored_matrix

from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.weights.quantized.to_blocks import FloatWeight, float_blocks
from zllm.model.arch_config import ModelArchConfig, MoEConfig


def moe_arch(
    hidden: int = 64,
    experts: int = 8,
    top_k: int = 2,
    inter: int = 32,
    norm: bool = True,
    shared: int = 0,
) -> ModelArchConfig:
    """One Qwen3-MoE layer's shapes (tests/test_moe.py's blocks, the kernels' cases)."""
    return ModelArchConfig(
        architecture="qwen3_moe",
        family="qwen3_moe",
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=4 * inter,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=hidden,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        moe=MoEConfig(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=inter,
            norm_topk_prob=norm,
            shared_expert_intermediate_size=shared,
        ),
    )


def random_moe(rule, dtype, hidden=64, inter=48, experts=8, top_k=3, seed=0) -> MoEBlock:
    gen = torch.Generator().manual_seed(seed)
    kw = {} if rule is None else {"rule": rule}
    block = MoEBlock(moe_arch(hidden, experts, top_k, inter), dtype, **kw).requires_grad_(False)
    for param in block.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return block


def moe_reference(x, weight, bias, experts, pair_div):
    """float64: out[p] = weight[e(p)] @ x[p // pair_div] + bias[e(p)], an expert at a time
    (never a [pairs, out, in] copy of the weights)."""
    pairs = experts.reshape(-1)
    rows = x.double()[torch.arange(pairs.numel()) // pair_div]
    out = torch.empty(pairs.numel(), weight.shape[1], dtype=torch.float64)
    for e in pairs.unique().tolist():
        chosen = pairs == e
        out[chosen] = rows[chosen] @ weight[e].double().T
        if bias is not None:
            out[chosen] += bias[e].double()
    return out


FP8 = cpu_kernels.FP8_E4M3
TYPES = {"Q4_0": int(T.Q4_0), "Q4_1": int(T.Q4_1), "Q8_0": int(T.Q8_0), "FP8_E4M3": FP8}


def blocks_of(ggml_type: int, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    if ggml_type != FP8:
        rng = np.random.default_rng(seed)
        return torch.from_numpy(stored_matrix((out_features, in_features), T(ggml_type), rng))
    # every finite e4m3 byte (0x7F / 0xFF are NaN), a scale per row
    gen = torch.Generator().manual_seed(seed)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite[torch.randint(0, len(finite), (out_features, in_features), generator=gen)]
    scale = torch.rand(out_features, 1, generator=gen) * 0.01 + 2.0**-10
    ggml_type, rows = float_blocks(FloatWeight(codes.view(torch.float8_e4m3fn), scale))
    assert ggml_type == FP8
    return rows


# One case per block type (and 16-bit rows: GPTQ 8-bit with zero points), act-order's
# per-part gathers and split matmuls.
MODEL_CASES = ["ct-w4a16", "awq-g64", "ct-w8a8", "ct-fp8-dynamic", "gptq-8bit-asym",
               "gptq-4bit-act-order-per-matrix"]  # fmt: skip
