"""The mixture-of-experts layer (executor/layers/moe/) and the models that use it.

the block    routing (softmax-then-top-k, renormalised or not; gpt-oss's top-k-then-softmax),
             ties to the lower expert id, tokens grouped by expert, a shared expert: against
             a float64 reference written out token by token; gpt-oss's rule against
             transformers' GptOssMLP; a decode step reads only its chosen experts
blocks       each expert's matmuls in every GGUF type the CPU kernel reads, against float64
             on gguf-py's dequantized weights
models       tiny random Qwen3-MoE (and Qwen2-MoE with its shared expert, Mixtral) run
             natively: greedy tokens equal transformers' from the Hugging Face directory
             (fp32, and bf16 with the experts held as BF16 rows) and from the GGUF files
             llama.cpp's converter writes (F32, Q8_0: the experts held in the file's
             blocks, byte for byte); one Qwen3-MoE Q8_0 file served by `zllm serve`
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from family_cases import MIXTRAL, QWEN2_MOE, QWEN2_MOE_ALL_SPARSE, QWEN2_MOE_SEED, QWEN3_MOE
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from gguf_files import random_blocks
from kernel_cases import moe_arch
from llama_cpp_convert import convert_hf_to_gguf, write_convertible_model
from parity import assert_greedy_parity, hf_greedy
from safetensors.torch import load_file
from tiny_models import write_lora_adapter, write_tiny_model

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.layers.linear.gguf import GGUFLinear
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.checkpoint import per_expert_weights
from zllm.executor.layers.moe.experts import ExpertMatrices
from zllm.executor.layers.moe.router import GPT_OSS_RULE, SIGMOID_BIAS_TOPK, MoERule, route
from zllm.executor.weights.loader import load_weights
from zllm.lora import LoRAError, LoRARequest, read_adapter
from zllm.model.arch import read_arch_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.gguf import read_gguf
from zllm.model.impl import choose_model_impl

T = GGMLQuantizationType
# Every type the CPU kernel reads in blocks.
BLOCK_TYPES = [int(t) for t in cpu_kernels.SUPPORTED_GGML_TYPES if t not in (1, 30)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def random_block(arch: ModelArchConfig, seed: int) -> MoEBlock:
    """A MoEBlock (with a shared expert when arch has one) of random weights. The router's
    weights and the inputs the tests give are multiples of 1/8 and small integers, so every
    logit is exact in fp32 and float64 alike, two logits differ by 1/64 or more, or are equal:
    with 8 experts or more, router rows 1 and 5 (and 2 and 6) are the same: ties that go to
    the lower id."""
    from zllm.executor.layers.mlp import GatedMLP as LlamaMLP

    gen = torch.Generator().manual_seed(seed)
    shared = None
    if arch.moe.shared_expert_intermediate_size:
        shared = LlamaMLP(
            arch, torch.float32, intermediate_size=arch.moe.shared_expert_intermediate_size
        )
    block = MoEBlock(arch, torch.float32, shared_expert=shared).requires_grad_(False)
    with torch.no_grad():
        router = torch.randint(-4, 5, block.gate.weight.shape, generator=gen) / 8.0
        if arch.moe.num_experts >= 8:
            router[5], router[6] = router[1], router[2]
        block.gate.weight.copy_(router)
        for param in [block.experts_gate_up.weight, block.experts_down.weight]:
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
        if shared is not None:
            for linear in (shared.gate_up_proj, shared.down_proj, block.shared_expert_gate):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 0.2)
    return block


def integer_rows(num_tokens: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, (num_tokens, hidden), generator=gen).float()


def reference_moe(
    x: np.ndarray,
    router: np.ndarray,
    gate_up: np.ndarray,
    down: np.ndarray,
    top_k: int,
    norm: bool,
) -> np.ndarray:
    """The routed experts in float64, written out token by token: softmax over every expert,
    the top k (equal scores: the lower id first), optionally renormalised, each chosen
    expert's silu(gate) * up then down, summed with its weight."""
    inter = gate_up.shape[1] // 2
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        logits = router @ x[t]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = sorted(range(len(probs)), key=lambda e: (-probs[e], e))[:top_k]
        weights = np.array([probs[e] for e in chosen])
        if norm:
            weights /= weights.sum()
        for e, w in zip(chosen, weights, strict=True):
            projected = gate_up[e] @ x[t]
            gate, up = projected[:inter], projected[inter:]
            out[t] += w * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def reference_block(block: MoEBlock, x: torch.Tensor) -> np.ndarray:
    """reference_moe on the block's own float weights (plus its shared expert)."""

    def f64(t: torch.Tensor) -> np.ndarray:
        return t.detach().double().numpy()

    xs = f64(x)
    gate_up, down = block.experts_gate_up.weight, block.experts_down.weight
    args = (f64(block.gate.weight), f64(gate_up), f64(down), block.top_k)
    out = reference_moe(xs, *args, block.rule.norm_topk_prob)
    if block.shared_expert is not None:
        shared = block.shared_expert
        inter = shared.intermediate_size
        projected = xs @ f64(shared.gate_up_proj.weight).T
        gate, up = projected[:, :inter], projected[:, inter:]
        mlp = (gate / (1 + np.exp(-gate)) * up) @ f64(shared.down_proj.weight).T
        scale = 1 / (1 + np.exp(-(xs @ f64(block.shared_expert_gate.weight).T)))
        out += scale * mlp
    return out


def assert_close(ours: torch.Tensor, expected: np.ndarray, rtol: float = 2e-5) -> None:
    """fp32 sums against float64: within rtol of the output's scale."""
    err = np.abs(ours.detach().double().numpy() - expected).max()
    assert err <= rtol * np.abs(expected).max(), f"max error {err} of {np.abs(expected).max()}"


# ---------------------------------------------------------------------------------------------
# Routing


def test_softmax_topk_renormalises_and_breaks_ties_toward_the_lower_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0], [5.0, -1.0, 5.0, 4.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, experts = route(logits, 2, MoERule(norm_topk_prob=False))
    assert experts.tolist() == [[1, 3], [0, 1], [0, 2]]
    assert torch.equal(weights, probs.gather(1, experts))
    weights, experts = route(logits, 3, MoERule(norm_topk_prob=True))
    assert experts.tolist() == [[1, 3, 2], [0, 1, 2], [0, 2, 3]]
    top = probs.gather(1, experts)
    assert torch.equal(weights, top / top.sum(dim=-1, keepdim=True))


def test_gpt_oss_routing_takes_the_top_logits_then_their_softmax() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0]])
    weights, experts = route(logits, 3, GPT_OSS_RULE)
    assert experts.tolist() == [[1, 3, 4]]
    assert torch.equal(weights, torch.softmax(torch.tensor([[2.0, 2.0, 1.0]]), dim=-1))


@pytest.mark.parametrize(("groups", "used", "norm"), [(1, 1, True), (4, 2, True), (4, 1, False)])
def test_sigmoid_bias_routing_equals_transformers_nemotron_router(groups, used, norm) -> None:
    """Nemotron 3's router (SIGMOID_BIAS_TOPK): the experts chosen by score plus correction
    bias among the best groups (their two best biased scores summed), weighted by the
    unbiased scores, renormalised or not, times routed_scaling: transformers' router's
    choice and weights."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    config = NemotronHConfig(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=groups,
        topk_group=used, norm_topk_prob=norm, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = NemotronHTopkRouter(config)
    gen = torch.Generator().manual_seed(groups * 10 + used)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.3)
    x = torch.randn(9, 32, generator=gen)
    _, their_weights, their_experts = router(x)
    rule = MoERule(
        router=SIGMOID_BIAS_TOPK, norm_topk_prob=norm, group_count=groups, groups_used=used,
        routed_scaling=2.5,
    )  # fmt: skip
    weights, experts = route(x @ router.weight.t(), 3, rule, router.e_score_correction_bias)
    order = their_experts.sort(dim=-1)[1]  # (transformers' top k is unsorted)
    theirs = their_experts.gather(1, order)
    ours_order = experts.sort(dim=-1)[1]
    assert torch.equal(experts.gather(1, ours_order), theirs)
    torch.testing.assert_close(weights.gather(1, ours_order), their_weights.gather(1, order))


# ---------------------------------------------------------------------------------------------
# The block against float64


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "norm", "shared"),
    [(1, 2, True, 0), (3, 1, False, 0), (17, 2, True, 0), (17, 3, False, 0), (9, 2, False, 48)],
)
def test_the_block_equals_the_float64_reference(num_tokens, top_k, norm, shared) -> None:
    block = random_block(moe_arch(top_k=top_k, norm=norm, shared=shared), seed=num_tokens)
    x = integer_rows(num_tokens, 64, seed=top_k)
    rows = route(block.gate(x), top_k, block.rule)[1].tolist()
    # Twin experts (1 and 5, 2 and 6) score alike: no token takes the higher without the
    # lower, and some take the lower alone (a tie at the top-k boundary).
    twins = ((1, 5), (2, 6))
    assert all(low in row or high not in row for row in rows for low, high in twins)
    assert num_tokens == 1 or any((low in r) != (high in r) for r in rows for low, high in twins)
    assert_close(block(x), reference_block(block, x))


def test_a_decode_step_reads_only_the_chosen_experts(monkeypatch) -> None:
    block = random_block(moe_arch(top_k=2), seed=3)
    x = integer_rows(2, 64, seed=4)
    read: list[tuple[str, int, int]] = []
    for name in ("experts_gate_up", "experts_down"):
        matrices = getattr(block, name)
        original = matrices.forward

        def spy(rows, expert, name=name, original=original):
            read.append((name, expert, rows.shape[0]))
            return original(rows, expert)

        monkeypatch.setattr(matrices, "forward", spy)
    _, chosen = route(block.gate(x), 2, block.rule)
    block(x)
    expected = sorted(set(chosen.flatten().tolist()))
    counts = {e: int((chosen == e).sum()) for e in expected}
    assert sorted(e for n, e, _ in read if n == "experts_down") == expected
    assert sorted(e for n, e, _ in read if n == "experts_gate_up") == expected
    assert all(rows == counts[e] for _, e, rows in read)


def test_gpt_oss_rule_equals_transformers_block() -> None:
    """Router bias, top-k-then-softmax, interleaved gate/up, expert biases, clamped SwiGLU
    (alpha 1.702, limit 7): transformers' GptOssMLP on random weights, in our layout
    ([E, out, in] matrices: its [E, in, out] transposed)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(
        hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=3
    )
    assert (config.swiglu_limit, GPT_OSS_RULE.swiglu_limit) == (7.0, 7.0)
    theirs = GptOssMLP(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in theirs.parameters():
            # wide enough that the clamps at +-7 bite
            param.copy_(torch.randn(param.shape, generator=gen) * 0.6)
    arch = moe_arch(hidden=64, experts=8, top_k=3, inter=32)
    ours = MoEBlock(arch, torch.float32, rule=GPT_OSS_RULE)
    experts = theirs.experts
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.router.weight)
        ours.gate.bias.copy_(theirs.router.bias)
        ours.experts_gate_up.weight.copy_(experts.gate_up_proj.transpose(1, 2))
        ours.experts_gate_up.bias.copy_(experts.gate_up_proj_bias)
        ours.experts_down.weight.copy_(experts.down_proj.transpose(1, 2))
        ours.experts_down.bias.copy_(experts.down_proj_bias)
    x = torch.randn(11, 64, generator=gen)
    with torch.no_grad():
        expected, _ = theirs(x.unsqueeze(0))
        gate_up = ours.experts_gate_up(x, 0)
        assert (gate_up[:, 0::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()
        torch.testing.assert_close(ours(x), expected[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Expert matrices in GGUF blocks


def expert_blocks(
    experts: int, rows: int, cols: int, ggml_type: int, seed: int
) -> tuple[torch.Tensor, np.ndarray]:
    """(blocks [E, rows, bytes per row], gguf-py's dequantization [E, rows, cols] in float64):
    quantized by gguf-py where it can, else random blocks with sane scales."""
    rng = np.random.default_rng(seed)
    stacked = []
    for _ in range(experts):
        try:
            weights = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
            q = quantize(weights, T(ggml_type))
        except NotImplementedError:  # K-quants and others: gguf-py only dequantizes them
            q = random_blocks((rows, cols), T(ggml_type), rng)
        stacked.append(q.view(np.uint8).reshape(rows, -1))
    blocks = np.stack(stacked)
    values = dequantize(blocks.reshape(experts * rows, -1), T(ggml_type)).reshape(
        experts, rows, cols
    )
    assert np.isfinite(values).all() and values.std() > 0
    return torch.from_numpy(blocks), values.astype(np.float64)


def block_in_blocks(
    types: tuple[int, int, int], seed: int, hidden: int = 256, inter: int = 256
) -> tuple[MoEBlock, np.ndarray, np.ndarray]:
    """A 4-expert block whose gate, up and down matrices are in `types`' blocks, and the
    float64 values those blocks hold ([E, 2 x inter, hidden], [E, hidden, inter])."""
    arch = moe_arch(hidden=hidden, experts=4, top_k=2, inter=inter)
    block = random_block(arch, seed)
    gate, gate_values = expert_blocks(4, inter, hidden, types[0], seed)
    up, up_values = expert_blocks(4, inter, hidden, types[1], seed + 1)
    down, down_values = expert_blocks(4, hidden, inter, types[2], seed + 2)
    parts = [(torch.cat([gate, up], dim=1), types[0])] if types[0] == types[1] else None
    block.experts_gate_up.hold_blocks_(parts or [(gate, types[0]), (up, types[1])])
    block.experts_down.hold_blocks_([(down, types[2])])
    return block, np.concatenate([gate_values, up_values], axis=1), down_values


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: T(t).name)
def test_expert_matmuls_in_blocks_equal_float64(ggml_type) -> None:
    """Every type the kernel reads, at a decode step's few rows and a prefill's many."""
    block, gate_up, down = block_in_blocks((ggml_type,) * 3, seed=ggml_type)
    assert block.experts_gate_up.weight is None and block.experts_down.weight is None
    router = block.gate.weight.detach().double().numpy()
    for num_tokens in (1, 21):
        x = integer_rows(num_tokens, 256, seed=num_tokens) / 4
        expected = reference_moe(x.double().numpy(), router, gate_up, down, 2, True)
        assert_close(block(x), expected, rtol=1e-4)


def test_gate_and_up_of_different_types_write_their_own_columns() -> None:
    """A Q4_K_M file's mix: gate Q4_K beside up Q6_K (two kernel calls per expert), down Q5_0."""
    types = (int(T.Q4_K), int(T.Q6_K), int(T.Q5_0))
    block, gate_up, down = block_in_blocks(types, seed=7)
    assert [t for _, t in block.experts_gate_up.parts] == list(types[:2])
    x = integer_rows(6, 256, seed=1) / 4
    router = block.gate.weight.detach().double().numpy()
    expected = reference_moe(x.double().numpy(), router, gate_up, down, 2, True)
    assert_close(block(x), expected, rtol=1e-4)


def test_expert_blocks_of_the_wrong_shape_are_refused() -> None:
    matrices = ExpertMatrices(4, 32, 64, torch.float32)
    blocks = torch.zeros(4, 16, 68, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"expert blocks \[\(4, 16, 68\)\] for 4 x 32"):
        matrices.hold_blocks_([(blocks, int(T.Q8_0))])


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_placeholder_larger_than_the_machine_is_built_untouched() -> None:
    """DeepSeek-V3's experts hold a [256, 4096, 7168] fp32 placeholder (30 GB) until their
    blocks replace it: one mapping larger than the machine's memory, which Linux's default
    overcommit check refuses to torch.empty. Here twice the machine's memory: built without
    a page of it resident, written and read like torch.empty's."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    rows = 4096
    experts = 2 * total // (rows * 7168 * 4) + 1
    before = _resident_bytes()
    matrices = ExpertMatrices(experts, rows, 7168, torch.float32)
    weight = matrices.weight
    assert weight is not None and weight.shape == (experts, rows, 7168)
    assert weight.is_contiguous() and weight.nbytes > 2 * total
    assert _resident_bytes() - before < 64 << 20
    weight.data[experts - 1, rows - 1, 7167] = 1.5  # one page touched, at the far end
    assert float(weight.data[experts - 1, rows - 1, 7167]) == 1.5
    assert float(weight.data[0, 0].abs().sum()) == 0.0  # fresh pages read as zeros


# ---------------------------------------------------------------------------------------------
# Models from Hugging Face directories

# The tiny MoE configs are tests/family_cases.py's (the registry's parity test runs them too).
HF_CASES = {"qwen3_moe": QWEN3_MOE, "qwen2_moe": QWEN2_MOE, "mixtral": MIXTRAL}
PROMPT_LENGTHS = [40, 45, 52]


def prompts(seed: int = 0, high: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, high) for _ in range(n)] for n in PROMPT_LENGTHS]


def assert_generates_as(llm: LLM, hf, label: str, high: int = 400) -> None:
    """Greedy tokens of three prompts (batched, prefill and decode) equal transformers'."""
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts(high=high)], GREEDY, use_tqdm=False
    )
    for i, (prompt, out) in enumerate(zip(prompts(high=high), outputs, strict=True)):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 2, f"{label}[{i}]: a degenerate output: {ours}"
        theirs = hf_greedy(hf, prompt, len(ours))
        assert_greedy_parity(hf, prompt, ours, theirs, label=f"{label}[{i}]")


def moe_layers(llm: LLM) -> list[MoEBlock]:
    return [layer.mlp for layer in llm.model_runner.model.layers if isinstance(layer.mlp, MoEBlock)]


@pytest.mark.parametrize("case", HF_CASES)
def test_checkpoint_greedy_tokens_equal_transformers(tmp_path, case) -> None:
    """Qwen3-MoE; Qwen2-MoE with its shared expert, q/k/v biases and a dense middle layer;
    Mixtral's block_sparse_moe names (w1, w3, w2)."""
    import transformers

    path = write_tiny_model(tmp_path / case, case, **HF_CASES[case])
    assert choose_model_impl(str(path)).name == "zllm"
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=4)
    sparse = moe_layers(llm)
    assert len(sparse) == 2  # (Qwen2-MoE's layer 1 stays dense)
    if case == "qwen2_moe":
        assert not isinstance(llm.model_runner.model.layers[1].mlp, MoEBlock)
        assert all(block.shared_expert is not None for block in sparse)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert_generates_as(llm, hf, case, high=hf.config.vocab_size)


def test_a_bf16_checkpoint_keeps_its_experts_as_bf16_rows(tmp_path) -> None:
    """The 16-bit path: every expert's bf16 matrix stacked into [E, rows, 2 x in] rows the
    kernel widens in registers (2 bytes a weight), the values transformers multiplies."""
    import transformers

    path = write_tiny_model(tmp_path / "bf16", "qwen3_moe", dtype=torch.bfloat16, **QWEN3_MOE)
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=4)
    assert llm.model_runner.quantization == "16-bit"
    for block in moe_layers(llm):
        for matrices in (block.experts_gate_up, block.experts_down):
            assert [t for _, t in matrices.parts] == [30]  # BF16
            assert matrices.held_bytes() == 2 * 8 * matrices.out_features * matrices.in_features
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_generates_as(llm, hf, "qwen3_moe-bf16", high=hf.config.vocab_size)


def test_deterministic_mode_keeps_the_experts_batch_invariant(tmp_path) -> None:
    """--deterministic: a request's every logprob is bitwise the same alone and among others
    that route tokens to the same experts (each expert's matmuls in fixed-size tiles)."""
    path = write_tiny_model(tmp_path / "det", "qwen3_moe", **QWEN3_MOE)
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, block_size=4, deterministic=True)
    vocab = llm.config.arch.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=vocab, ignore_eos=True)
    needle = {"prompt_token_ids": prompts(high=vocab)[0]}

    def needle_logprobs(others: list[dict]) -> list[dict[int, float]]:
        out = llm.generate([needle, *others], params, use_tqdm=False)[0].outputs[0]
        return [{t: p.logprob for t, p in position.items()} for position in out.logprobs]

    alone = needle_logprobs([])
    assert len(alone) == 4 and len(alone[0]) == vocab
    others = [{"prompt_token_ids": p} for p in prompts(seed=5, high=vocab) * 3]
    assert needle_logprobs(others) == alone


def test_lora_adapts_the_attention_and_refuses_the_experts(tmp_path) -> None:
    """An adapter on q/v changes the output; one on an expert layer's MLP is refused (its
    updates would otherwise be dropped: the experts have no gate_up_proj to wrap)."""
    path = write_tiny_model(tmp_path / "m", "qwen3_moe", **QWEN3_MOE)
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, block_size=4, enable_lora=True)
    prompt, params = [{"prompt_token_ids": prompts()[0]}], GREEDY
    base = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    attention = write_lora_adapter(tmp_path / "qv", path, targets=("q_proj", "v_proj"))
    adapted = llm.generate(
        prompt, params, lora_request=LoRARequest("qv", 1, str(attention)), use_tqdm=False
    )
    assert adapted[0].outputs[0].token_ids != base
    mlp = write_lora_adapter(tmp_path / "mlp", path, targets=("gate_proj",))
    with pytest.raises(LoRAError, match="mlp.gate_proj of layer 0, a mixture-of-experts layer"):
        read_adapter(str(mlp), llm.config.arch, max_lora_rank=16)


def test_tensor_parallelism_is_refused_for_experts(tmp_path) -> None:
    """The family lacks the capability (its Family.lacks): refused at start, naming the
    option, the reason, the capability and the family."""
    path = str(write_tiny_model(tmp_path / "m", "qwen3_moe", weights=False, **QWEN3_MOE))
    with pytest.raises(ValueError) as refused:
        EngineArgs(model=path, tensor_parallel_size=2).create_engine_config()
    assert str(refused.value) == (
        "qwen3_moe cannot run with --tensor-parallel-size 2: its mixture-of-experts layers are "
        "not split across ranks yet (the Qwen3-MoE family (qwen3_moe) has no tensor parallelism)"
    )
    # On transformers' code (whose plan does not cut experts either): the shape's refusal.
    with pytest.raises(ValueError, match="mixture-of-experts layers \\(not split across ranks"):
        EngineArgs(
            model=path, tensor_parallel_size=2, model_impl="transformers"
        ).create_engine_config()


# ---------------------------------------------------------------------------------------------
# GGUF files from llama.cpp's converter

# (llama.cpp's qwen2moe has no dense layers: QWEN2_MOE_ALL_SPARSE.)
GGUF_CASES = {"qwen3_moe": QWEN3_MOE, "qwen2_moe": QWEN2_MOE_ALL_SPARSE, "mixtral": MIXTRAL}
GGUF_SEEDS = {"qwen2_moe": QWEN2_MOE_SEED}
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
OUTTYPES = ("f32", "q8_0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            path = tmp_path_factory.mktemp(case) / "hf"
            seed = GGUF_SEEDS.get(case, 0)
            built[case] = write_convertible_model(path, case, seed, **GGUF_CASES[case])
        return built[case]

    return get


@pytest.fixture(scope="module")
def gguf_file(model_dir) -> Callable[[str, str], str]:
    built: dict[tuple[str, str], str] = {}

    def get(case: str, outtype: str) -> str:
        if (case, outtype) not in built:
            directory = model_dir(case)
            out = directory.parent / f"{case}-{outtype}.gguf"
            built[case, outtype] = str(convert_hf_to_gguf(directory, out, outtype))
        return built[case, outtype]

    return get


def rounded(name: str, weight: torch.Tensor, outtype: str) -> torch.Tensor:
    """What the converter stores of a checkpoint tensor, read back as fp32: matrices (each
    expert's rows too) in the file's type, the router (kept F32) and vectors in F32."""
    if weight.dim() < 2 or outtype == "f32" or name.endswith("mlp.gate.weight"):
        return weight
    rows = weight.reshape(-1, weight.shape[-1]).numpy()
    blocks = quantize(rows, T.Q8_0)
    return torch.from_numpy(dequantize(blocks, T.Q8_0).reshape(weight.shape))


def hf_model_as_stored(directory: Path, outtype: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(rounded(name, param, outtype))
    return model


@pytest.mark.parametrize("case", GGUF_CASES)
def test_the_file_reads_as_its_checkpoint(gguf_file, model_dir, case) -> None:
    path = gguf_file(case, "f32")
    assert read_gguf(path).metadata["general.architecture"] == GGUF_ARCH[case]
    impl = choose_model_impl(path)
    assert (impl.name, impl.architecture) == ("zllm", GGUF_ARCH[case])
    ours, checkpoint = read_arch_config(path), read_arch_config(str(model_dir(case)))
    assert np.float32(ours.rms_norm_eps) == np.float32(checkpoint.rms_norm_eps)
    same = dict(architecture=checkpoint.architecture, rms_norm_eps=checkpoint.rms_norm_eps)
    if case == "mixtral":  # the converter writes Mixtral's expert size as the MLP's
        same["intermediate_size"] = checkpoint.intermediate_size
    assert dataclasses.replace(ours, **same) == checkpoint
    assert ours.moe is not None and ours.moe.norm_topk_prob == (case != "qwen2_moe")


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_loaded_weights_are_the_checkpoints_as_stored(gguf_file, model_dir, outtype) -> None:
    """Bit for bit, each expert's matrices cut from the file's stacked tensors."""
    path = gguf_file("qwen3_moe", outtype)
    ours = dict(per_expert_weights(load_weights(path, read_arch_config(path))))
    checkpoint = load_file(str(model_dir("qwen3_moe") / "model.safetensors"))
    assert ours.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        expected = rounded(name, tensor, outtype)
        assert torch.equal(ours[name].view(torch.int32), expected.view(torch.int32)), name


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("case", GGUF_CASES)
def test_greedy_tokens_equal_transformers(gguf_file, model_dir, case, outtype) -> None:
    path = gguf_file(case, outtype)
    llm = LLM(path, kv_cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=4)
    expected = "none" if outtype == "f32" else "gguf"
    assert llm.model_runner.quantization == expected
    for block in moe_layers(llm):
        matrices = (block.experts_gate_up, block.experts_down)
        if outtype == "q8_0":
            assert all([t for _, t in m.parts] == [int(T.Q8_0)] for m in matrices)
        else:
            assert all(m.parts is None for m in matrices)
        shared = block.shared_expert
        if shared is not None and outtype == "q8_0":  # Qwen2-MoE's, as any MLP
            assert isinstance(shared.gate_up_proj, GGUFLinear)
            assert isinstance(shared.down_proj, GGUFLinear)
    assert_generates_as(llm, hf_model_as_stored(model_dir(case), outtype), f"{case}-{outtype}")


def test_q8_0_experts_are_held_in_the_files_blocks(gguf_file) -> None:
    """The bytes the experts hold are the file's expert tensors' bytes: no fp32 copy."""
    path = gguf_file("qwen3_moe", "q8_0")
    llm = LLM(path, kv_cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=4)
    held = sum(
        matrices.held_bytes()
        for block in moe_layers(llm)
        for matrices in (block.experts_gate_up, block.experts_down)
    )
    tensors = read_gguf(path).tensors
    in_file = sum(info.nbytes for name, info in tensors.items() if "_exps." in name)
    assert held == in_file
    assert all(
        m.weight is None
        for block in moe_layers(llm)
        for m in (block.experts_gate_up, block.experts_down)
    )
    q8 = GGML_QUANT_SIZES[T.Q8_0]
    assert in_file == 2 * 8 * 3 * 32 * 64 // q8[0] * q8[1]  # layers x experts x matrices


# ---------------------------------------------------------------------------------------------
# Served


@pytest.mark.e2e
def test_served_qwen3_moe_q8_0_answers_as_transformers(
    gguf_file, model_dir, engine_pool, tmp_path
) -> None:
    path = gguf_file("qwen3_moe", "q8_0")
    hf = hf_model_as_stored(model_dir("qwen3_moe"), "q8_0")
    with engine_pool.serve(path, tmp_path / "server.log", "--block-size", "4") as server:
        body = dict(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
        body |= dict(return_tokens_as_token_ids=True, prompt=prompts(1))
        body["model"] = server.get("/v1/models").json()["data"][0]["id"]
        answer = server.post("/v1/completions", body).json()
        assert "choices" in answer, answer
        log = server.log_text()
    assert "expert projections read blocks" in log
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    for i, (prompt, choice) in enumerate(zip(prompts(1), choices, strict=True)):
        ours = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        theirs = hf_greedy(hf, prompt, len(ours))
        assert_greedy_parity(hf, prompt, ours, theirs, label=f"served-qwen3moe[{i}]")


# ---------------------------------------------------------------------------------------------
# A decode step's experts grouped into one kernel call per projection (csrc/cpu/moe_experts.cpp)


def grouped_case(types: tuple[int, int, int], top_k: int, int8: bool, rule: MoERule | None):
    """An 8-expert block in `types`' blocks (gate_up 512 wide, down 256), top_k experts a
    token; biases on every expert's outputs when the rule has them."""
    arch = moe_arch(hidden=256, experts=8, top_k=top_k, inter=256)
    block = random_block(arch, seed=top_k)
    if rule is not None:
        block = MoEBlock(arch, torch.float32, rule=rule).requires_grad_(False)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in block.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    gate, _ = expert_blocks(8, 256, 256, types[0], seed=types[0])
    up, _ = expert_blocks(8, 256, 256, types[1], seed=types[1] + 1)
    down, _ = expert_blocks(8, 256, 256, types[2], seed=types[2] + 2)
    parts = [(torch.cat([gate, up], dim=1), types[0])] if types[0] == types[1] else None
    arithmetic = "gguf-int8" if int8 else "gguf-float"
    block.experts_gate_up.hold_blocks_(parts or [(gate, types[0]), (up, types[1])], arithmetic)
    block.experts_down.hold_blocks_([(down, types[2])], arithmetic)
    return block


def assert_grouped_equals_per_expert(block: MoEBlock, monkeypatch) -> None:
    """At 1-4 tokens (and 8), the grouped call's output equals the per-expert calls' bit for
    bit, and the grouped call did run (two kernel calls per part, not one per expert)."""
    from zllm.executor.layers.moe import block as moe

    calls: list[int] = []
    grouped_kernel = cpu_kernels.moe_experts_linear
    monkeypatch.setattr(
        cpu_kernels, "moe_experts_linear", lambda *a: calls.append(1) or grouped_kernel(*a)
    )
    parts = len(block.experts_gate_up.parts) + len(block.experts_down.parts)
    for num_tokens in (1, 2, 3, 4, 8):
        x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(num_tokens))
        calls.clear()
        grouped = block(x)
        assert len(calls) == parts
        with monkeypatch.context() as per_expert:
            per_expert.setattr(moe, "GROUPED_MAX_TOKENS", 0)
            expected = block(x)
        assert len(calls) == parts
        assert torch.equal(grouped, expected), (num_tokens, (grouped - expected).abs().max())


@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("ggml_type", [*BLOCK_TYPES, 1, 30], ids=lambda t: T(t).name)
def test_grouped_experts_equal_the_per_expert_calls(ggml_type, top_k, monkeypatch) -> None:
    """Every type the kernel reads (and a checkpoint's F16/BF16 rows), the float kernel and
    (its types) gguf-int8's."""
    modes = [False, True] if ggml_type in cpu_kernels.INT8_GGML_TYPES else [False]
    for int8 in modes:
        block = grouped_case((ggml_type,) * 3, top_k, int8, rule=None)
        assert block.experts_gate_up.int8_activations == int8
        assert_grouped_equals_per_expert(block, monkeypatch)


@pytest.mark.parametrize("int8", [False, True])
def test_grouped_experts_of_mixed_types_and_biases_equal_the_per_expert_calls(
    int8, monkeypatch
) -> None:
    """A Q4_K_M file's mix (gate Q4_K, up Q6_K: two parts; down Q5_0), and gpt-oss's rule
    (interleaved gate_up, clamped SwiGLU, expert biases) over Q8_0."""
    mixed = grouped_case((int(T.Q4_K), int(T.Q6_K), int(T.Q5_0)), 8, int8, rule=None)
    assert_grouped_equals_per_expert(mixed, monkeypatch)
    biased = grouped_case((int(T.Q8_0),) * 3, 2, int8, rule=GPT_OSS_RULE)
    assert biased.experts_gate_up.bias is not None
    assert_grouped_equals_per_expert(biased, monkeypatch)
