"""The fused CPU decode path (executor/graphs/fused_decode.py, csrc/cpu/decode_stack.h) against the
module path it stands in for: the same engine steps through both, every architecture and
weight kind it covers, and the steps and features it leaves to the modules.

The greedy parity tests against transformers (test_architectures.py, test_gemma3.py,
test_gguf_types.py, test_smollm2.py) run their decode steps on this path too, since it is
the default on CPU; here the two paths are compared directly: the same bits, since both
run the same kernels (csrc/cpu/row_ops.h serves the modules' norms, RoPE and activations)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from gguf_files import write_llama_gguf
from tiny_models import randomize_norms_and_biases, tiny_gemma3_overrides, write_tiny_model
from torch import nn

from zllm import LLM, SamplingParams
from zllm.executor.graphs.fused_decode import FusedDecode, Unsupported
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels.gguf_arithmetic import BF16_GEMM_MIN_ROWS
from zllm.executor.layers.linear.dense import DENSE_MAX_ROWS, DenseRowsLinear
from zllm.executor.layers.linear.gguf import GGUFLinear, GGUFSplitLinear
from zllm.executor.step_inputs import build_attention_metadata

pytestmark = pytest.mark.skipif(
    not cpu_kernels.cpu_supports_kernels(), reason="the CPU kernels need AVX2/FMA/F16C"
)

WINDOW = 8
BLOCK = 4

# Model directories (write_tiny_model overrides): each feature the fused layer covers.
MODEL_DIRS = {
    "llama": dict(arch="llama"),
    "qwen2-bias": dict(arch="qwen2"),  # q/k/v biases
    "qwen3-qk-norm": dict(arch="qwen3", head_dim=32),
    "phi3-partial-rotary-window": dict(
        arch="phi3", partial_rotary_factor=0.5, sliding_window=WINDOW
    ),
    "mistral-window": dict(arch="mistral", sliding_window=WINDOW),
    "gemma3": tiny_gemma3_overrides(WINDOW),
    # NoPE layers: the second and fourth (no rope table in the stack for them)
    "smollm3-nope": dict(
        arch="smollm3", num_hidden_layers=4, no_rope_layer_interval=2, pad_token_id=None
    ),  # fmt: skip
}
# A GGUF whose matmuls mix kernel types (q/k beside v of another type: one kernel call per
# part), served by the default `gguf` and by `gguf-int8`.
MIXED_TYPES = {
    "attn_q": T.Q5_0,
    "attn_k": T.Q5_0,
    "attn_v": T.Q8_0,
    "attn_output": T.Q4_K,
    "ffn_gate": T.Q4_1,
    "ffn_up": T.Q6_K,
    "ffn_down": T.Q5_K,
    "token_embd": T.Q8_0,
    "output": T.Q4_0,
}
CASES = [*MODEL_DIRS, "gguf", "gguf-int8"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    built: dict[str, str] = {}

    def get(case: str) -> str:
        if case in built:
            return built[case]
        directory = tmp_path_factory.mktemp(case)
        if case.startswith("gguf"):
            path = directory / "mixed.gguf"
            write_llama_gguf(path, lambda name: MIXED_TYPES[name.split(".")[-2]])
            built[case] = str(path)
        else:
            built[case] = str(
                randomize_norms_and_biases(write_tiny_model(directory, **MODEL_DIRS[case]))
            )
        return built[case]

    return get


def make_llm(path: str, **kwargs) -> LLM:
    kwargs = {
        "block_size": BLOCK,
        "kv_cache_memory_bytes": 8 << 20,
        "enable_prefix_caching": False,
        **kwargs,
    }
    return LLM(path, **kwargs)


def prompts_of(lengths: list[int], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]} for n in lengths]


def count_fused_steps(llm: LLM) -> list[int]:
    """Wraps the runner's fused path; returns the list its served steps' sizes go into."""
    fused = llm.model_runner.fused_decode
    served: list[int] = []
    run = fused.run

    def counting(input_ids, *args, **kwargs):
        hidden = run(input_ids, *args, **kwargs)
        if hidden is not None:
            served.append(input_ids.shape[0])
        return hidden

    fused.run = counting
    return served


@pytest.mark.parametrize("case", CASES)
def test_decode_steps_match_the_module_path(model_path, case) -> None:
    """A batch of ragged prompts (contexts crossing the sliding window, the block size and
    each other) decoded greedily through both paths: the same tokens and the same logprobs,
    bit for bit (the same kernels for the matmuls, attention and row-wise ops)."""
    quantization = "gguf-int8" if case == "gguf-int8" else None
    llm = make_llm(model_path(case), quantization=quantization)
    runner = llm.model_runner
    assert runner.fused_decode is not None
    expected_quantization = "none" if case in MODEL_DIRS else case
    assert runner.quantization == expected_quantization
    served = count_fused_steps(llm)
    prompts = prompts_of([3, 17, 30, 9, 1])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    fused = llm.generate(prompts, params, use_tqdm=False)
    # Every step after the prefill is decode only, all five sequences in it.
    assert len(served) >= 15 and set(served) == {5}, served
    fused_decode, runner.fused_decode = runner.fused_decode, None
    modules = llm.generate(prompts, params, use_tqdm=False)
    runner.fused_decode = fused_decode
    produced = {t for out in fused for t in out.outputs[0].token_ids}
    assert len(produced) > 10, f"degenerate outputs prove little: {produced}"
    for a, b in zip(fused, modules, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("kv", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_a_narrow_kv_cache_decodes_as_the_module_path(model_path, case, kv) -> None:
    """--kv-cache-dtype: the fused step writes K/V rounded (int8: quantized per row) as torch
    does and reads them widened, so both paths give the same tokens and logprobs bit for
    bit."""
    llm = make_llm(model_path(case), kv_cache_dtype=kv)
    runner = llm.model_runner
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}[kv]
    assert {t.dtype for t in runner.kv_tensors} == {expected}
    served = count_fused_steps(llm)
    prompts = prompts_of([3, 17, 30, 9, 1], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    fused = llm.generate(prompts, params, use_tqdm=False)
    assert len(served) >= 15
    fused_decode, runner.fused_decode = runner.fused_decode, None
    modules = llm.generate(prompts, params, use_tqdm=False)
    runner.fused_decode = fused_decode
    for a, b in zip(fused, modules, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_every_matmul_kind_is_the_module_s_arithmetic() -> None:
    """FusedMatmul computes what nn.Linear, GGUFLinear and GGUFSplitLinear compute, bit for
    bit: the same kernels with the same row counts (gguf-int8's integer path up to its row
    limit, the float kernel above)."""
    kernels = cpu_kernels.load()
    gen = torch.Generator().manual_seed(0)
    in_features, rows = 64, 48
    weight = torch.randn(rows, in_features, generator=gen) * 0.1
    bias = torch.randn(rows, generator=gen)
    for b in (None, bias):
        dense = kernels.FusedMatmul([], [], weight, b, in_features, 0)
        # An fp32 model's modules on CPU: DenseRowsLinear (csrc/cpu/dense_rows.h at 1-8 rows,
        # torch's matmul past them), the same function the stack calls.
        module = nn.Linear(in_features, rows, bias=b is not None)
        module.weight.data = weight
        if b is not None:
            module.bias.data = b
        module.__class__ = DenseRowsLinear
        for m in (1, 3, 8, 9, 17):
            x = torch.randn(m, in_features, generator=gen)
            with torch.no_grad():
                assert torch.equal(dense(x), module(x)), m
                if m > DENSE_MAX_ROWS:
                    assert torch.equal(dense(x), F.linear(x, weight, b)), m

    def blocks(ggml_type: T, n: int) -> torch.Tensor:
        w = (torch.randn(n, in_features, generator=gen) * 0.1).numpy()
        return torch.from_numpy(np.ascontiguousarray(quantize(w, ggml_type)))

    parts = [(blocks(T.Q5_0, 16), int(T.Q5_0)), (blocks(T.Q8_0, 32), int(T.Q8_0))]
    for int8 in (False, True):
        split = GGUFSplitLinear(parts, in_features, bias, "gguf-int8" if int8 else "gguf-float")
        single = GGUFLinear(*parts[1], in_features, None, "gguf-int8" if int8 else "gguf-float")
        for module in (split, single):
            module_parts = module.parts if module is split else [(module.qweight, module.ggml_type)]
            fused = kernels.FusedMatmul(
                [p for p, _ in module_parts],
                [t for _, t in module_parts],
                None,
                module.bias,
                in_features,
                module.int8_max_rows if int8 else 0,
            )
            for m in (1, 2, 4, 5, 9):  # gguf-int8 switches to the float kernel after 4 rows
                x = torch.randn(m, in_features, generator=gen)
                assert torch.equal(fused(x), module(x)), (type(module).__name__, int8, m)


@pytest.mark.parametrize("case", ["llama", "mistral-window", "gemma3"])
def test_prefill_steps_go_to_the_modules_and_verify_steps_run_fused(model_path, case) -> None:
    """A step with a prefill chunk is the module path's: run() declines it. A speculative
    verify step (a sequence's last token and its proposals, each a decode row attending up
    to its own position) runs fused, with the module path's hidden states bit for bit,
    sliding-window layers included: contexts well past the window, the blocks before it
    released (-1) as the block manager releases them, metadata per KV cache group."""
    llm = make_llm(model_path(case))
    runner = llm.model_runner
    fused = runner.fused_decode
    gen = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:  # some context already cached
        cache.copy_(torch.randn(cache.shape, generator=gen))

    class State:  # what the metadata builder reads of a request
        def __init__(self, block_ids: list[list[int]]) -> None:
            self.block_ids = block_ids
            self.images = []  # (a vision model's: their tokens see their whole image)

    def step(query_lens: list[int], seq_lens: list[int]):
        states = []
        for i, (q, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
            tables = []
            for g, group in enumerate(runner.kv_groups):
                first = 64 * g + 16 * i  # disjoint: the groups' layers share cache tensors
                table = list(range(first, first + -(-n // BLOCK)))
                if group.sliding_window is not None:  # released before the first row's window
                    first_needed = max(0, n - q + 1 - group.sliding_window) // BLOCK
                    table[:first_needed] = [-1] * first_needed
                tables.append(table)
            states.append(State(tables))
        positions = [np.arange(n - q, n) for q, n in zip(query_lens, seq_lens, strict=True)]
        meta = build_attention_metadata(
            runner.host.layout, states, query_lens, seq_lens, np.concatenate(positions)
        )
        ids = torch.randint(3, 250, (sum(query_lens),), generator=gen)
        return ids, torch.from_numpy(np.concatenate(positions)), meta

    assert runner.num_blocks >= 64 * len(runner.kv_groups)
    ids, positions, meta = step([1, 5], [9, 5])
    assert fused.run(ids, positions, runner.kv_caches, meta) is None
    ids, positions, meta = step([1, 4, 1], [30, 27, 40])
    expected = runner.model(ids, positions, runner.kv_caches, meta)
    hidden = fused.run(ids, positions, runner.kv_caches, meta)
    assert hidden is not None
    assert torch.equal(hidden, expected)


@pytest.mark.parametrize(
    "kwargs, why",
    [
        (dict(enforce_eager=True), "--enforce-eager"),
        (dict(deterministic=True), "deterministic mode"),
        # (the transformers backend's family lacks the capability: its reason)
        (dict(model_impl="transformers"), "transformers' modeling code runs its own modules"),
    ],
)
def test_features_it_does_not_cover_keep_the_module_path(model_path, caplog, kwargs, why) -> None:
    caplog.set_level("INFO", logger="zllm.executor.host.decode_path")
    llm = make_llm(model_path("llama"), **kwargs)
    assert llm.model_runner.fused_decode is None
    assert f"fused CPU path not used: {why}" in caplog.text
    out = llm.generate(prompts_of([5]), SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_bf16_models_steps_of_8_rows_go_to_the_modules_bf16_gemms(tmp_path: Path) -> None:
    """Where BF16 matmuls take bf16 GEMMs from 8 rows (AMX; set here on any CPU and the path
    rebuilt), the fused path declines steps of 8+ rows: the modules' GEMMs serve them, so
    both paths still give a step the same bits. Smaller steps stay fused."""
    path = write_tiny_model(tmp_path / "bf16", dtype=torch.bfloat16)
    llm = make_llm(str(path), max_num_seqs=32)
    runner = llm.model_runner
    for module in runner.model.modules():
        if isinstance(module, GGUFLinear | GGUFSplitLinear):
            module.bf16_gemm_rows = BF16_GEMM_MIN_ROWS
    runner.fused_decode = FusedDecode.build(runner.model)
    assert runner.fused_decode.module_rows == BF16_GEMM_MIN_ROWS == 8
    served = count_fused_steps(llm)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts_of([3] * 7), params, use_tqdm=False)
    assert served and set(served) == {7}, served
    served.clear()
    out = llm.generate(prompts_of([3] * 8, seed=1), params, use_tqdm=False)
    assert served == [] and all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_lora_keeps_the_module_path(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "base")
    llm = make_llm(str(path), enable_lora=True)
    assert llm.model_runner.fused_decode is None


def test_a_model_class_it_does_not_know_is_unsupported() -> None:
    with pytest.raises(Unsupported, match="no fused decode path"):
        FusedDecode.build(torch.nn.Linear(2, 2))


def test_inconsistent_step_inputs_are_refused(model_path) -> None:
    """Positions past the RoPE table, slots or block ids outside the cache: an error naming
    it, nothing written."""
    llm = make_llm(model_path("llama"), max_model_len=64)
    runner = llm.model_runner
    stack = runner.fused_decode.stack
    hidden = llm.config.arch.hidden_size
    layers = len(runner.kv_caches)
    num_slots = runner.kv_caches[0].shape[1] * BLOCK

    def forward(position: int, slot: int, block: int) -> str:
        before = [c.clone() for c in runner.kv_caches]
        with pytest.raises(RuntimeError) as error:
            stack.forward(
                x=torch.zeros(1, hidden),
                positions=torch.tensor([position]),
                kv_caches=runner.kv_caches,
                meta_of_layer=[0] * layers,
                block_tables=[torch.tensor([[block]])],
                slots=[torch.tensor([slot])],
                windows=[0],
                seq_lens=torch.tensor([1]),
            )
        assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
        return str(error.value)

    assert "position beyond the RoPE table" in forward(64, 0, 0)
    assert "slot out of range" in forward(0, num_slots, 0)
    assert "block id out of range" in forward(0, 0, num_slots // BLOCK)
