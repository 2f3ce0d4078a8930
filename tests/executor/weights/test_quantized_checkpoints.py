"""Quantized Hugging Face checkpoints served on CPU (issue 59): compressed-tensors, GPTQ and
AWQ checkpoints as their libraries write them (tests/quant_checkpoints.py), read into the CPU
kernel's blocks (executor/weights/quantized/), against transformers loading the same
checkpoint where it can on CPU (compressed-tensors' weight-only schemes) and against the
dequantized weights elsewhere (GPTQ and AWQ need GPU libraries; the activation schemes'
references keep activations fp32, as zllm's CPU arithmetic does: the logprob difference that
transformers' own activation rounding makes is stated in BENCHMARKS.md).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from parity import assert_greedy_parity, hf_greedy
from quant_checkpoints import CHECKPOINTS, reference_model, reference_of

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.executor.host.layout import RankLayout
from zllm.executor.host.model_weights import ModelWeights
from zllm.executor.layers.linear.act_order import ActOrderLinear, ActOrderParts
from zllm.executor.layers.linear.gguf import GGUFLinear
from zllm.executor.weights.quantized.to_blocks import BF16, F16, FP8_E4M3, Q4_0, Q4_1, Q8_0

_spec = importlib.util.spec_from_file_location(
    "logits_parity", Path(__file__).resolve().parents[3] / "benchmarks" / "logits_parity.py"
)
logits_parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(logits_parity)

PROMPTS = [[5, 17, 200, 33, 61, 90], [300, 2, 2, 48, 111, 7, 8, 9, 250, 13], [401, 66]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
POOL = 16 << 20
EXACT, ROUNDED = 1e-3, 0.15  # the largest |logit difference| allowed (logits span ~+-8)
# name -> (the block type its projections become, the logits' tolerance): exact weights leave
# only the order of fp32 sums; Q4_1's zero term, int8 with zero points (F16 rows) and fp32
# scales are rounded to fp16 at load (2^-11 of a weight; BENCHMARKS.md gives each case's
# measured difference and KL).
CASES: dict[str, tuple[int, float]] = {
    "ct-w4a16": (Q4_0, EXACT),
    "ct-w4a16-g32": (Q4_0, EXACT),
    "ct-w4a16-asym": (Q4_1, ROUNDED),
    "ct-w4a16-act-order-weight": (Q4_0, EXACT),
    "ct-w4a16-g-idx": (Q4_0, EXACT),
    "ct-w8a16": (Q8_0, EXACT),
    "ct-w8a8": (Q8_0, EXACT),
    "ct-fp8-dynamic": (FP8_E4M3, EXACT),
    "ct-fp8-static": (FP8_E4M3, EXACT),
    "gptq-4bit-g128": (Q4_0, EXACT),
    "gptq-4bit-g32-asym": (Q4_1, ROUNDED),
    "gptq-8bit-g64": (Q8_0, EXACT),
    "gptq-8bit-asym": (F16, ROUNDED),
    "gptq-4bit-channel": (Q4_0, EXACT),
    "gptq-4bit-act-order": (Q4_0, EXACT),
    "gptq-4bit-act-order-per-matrix": (Q4_0, EXACT),
    "awq-g128": (Q4_1, ROUNDED),
    "awq-g64": (Q4_1, ROUNDED),
    "fp8-block": (FP8_E4M3, ROUNDED),  # fp32 block scales rounded to fp16
}
assert CASES.keys() == CHECKPOINTS.keys()


def checkpoint(tmp_path_factory, case: str) -> Path:
    return CHECKPOINTS[case](tmp_path_factory.mktemp(case))


def _leaves(module) -> list[GGUFLinear]:
    """The block matmuls a model matmul runs (through act-order's column gathers)."""
    if isinstance(module, ActOrderParts):
        return [leaf for part in module.parts for leaf in _leaves(part)]
    if isinstance(module, ActOrderLinear):
        return _leaves(module.inner)
    return [module]


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_answers_as_its_reference(tmp_path_factory, case):
    """Greedy tokens equal the reference's (near-tie rule); the logits over each prompt and
    its continuation within the case's tolerance; every projection read as the expected
    blocks, the embedding as 16-bit rows (no fp32 matrix)."""
    path = checkpoint(tmp_path_factory, case)
    block_type, tolerance = CASES[case]
    ref = reference_of(case, path)
    llm = LLM(str(path), kv_cache_memory_bytes=POOL)
    outs = llm.generate(_inputs(), GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ours = list(out.outputs[0].token_ids)
        theirs = hf_greedy(ref, prompt, GREEDY.max_tokens)
        assert_greedy_parity(ref, prompt, ours, theirs, label=case)
        sequence = prompt + ours
        with torch.inference_mode():
            expected = ref(torch.tensor([sequence])).logits[0].float()
        got = logits_parity.zllm_logits(llm, sequence)
        assert float((got - expected).abs().max()) < tolerance
    del llm

    model = ModelWeights(RankLayout.of(_config(path))).model
    layer = model.layers[0]
    matmuls = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj]  # fmt: skip
    for leaf in (leaf for module in matmuls for leaf in _leaves(module)):
        assert isinstance(leaf, GGUFLinear) and leaf.ggml_type == block_type
    assert isinstance(layer.mlp.gate_up_proj, ActOrderLinear) == (case == "gptq-4bit-act-order")
    # (each ct-w4a16-g-idx matrix has its own order, so its fused matmuls run part by part)
    per_part = case.endswith("per-matrix") or case == "ct-w4a16-g-idx"
    assert isinstance(layer.mlp.gate_up_proj, ActOrderParts) == per_part
    assert model.embed_tokens.numel() == 0  # the embedding and tied logits read 16-bit rows


def _config(path: Path, **options):
    return EngineArgs(model=str(path), kv_cache_memory_bytes=POOL, **options).create_engine_config()


def test_the_blocks_take_about_the_checkpoints_bytes(tmp_path_factory):
    """int4 groups of 128 become Q4_0: 18 bytes per 32 weights against the checkpoint's 16
    plus a 2-byte scale per 128 (4.5 bits against 4.125), the embedding its bf16 rows."""
    path = checkpoint(tmp_path_factory, "ct-w4a16")
    model = ModelWeights(RankLayout.of(_config(path))).model
    projections = [
        m for layer in model.layers for m in layer.modules() if isinstance(m, GGUFLinear)
    ]
    held = sum(m.qweight.numel() for m in projections)
    weights = sum(m.out_features * m.in_features for m in projections)
    assert held == weights * 18 // 32
    assert model.embed_rows.qweight.dtype == torch.uint8
    assert model.embed_rows.ggml_type == BF16


def test_a_checkpoint_missing_a_scale_is_refused_naming_it(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    path = checkpoint(tmp_path_factory, "gptq-4bit-g128")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.scales is missing"):
        ModelWeights(RankLayout.of(_config(path)))


_UP = "model.layers.1.mlp.up_proj"
# (case, tensor, how it is cut, what the refusal must say): tensors whose shapes do not fit
# each other or the model, as a truncated download or a hand-edited checkpoint has them.
MALFORMED = [
    ("gptq-4bit-g32-asym", "scales", lambda t: t[:, :-8], r"scales cover 248 rows of 256"),
    ("gptq-4bit-g32-asym", "qzeros", lambda t: t[:, :-1], r"zero points \[248, 4\] beside"),
    ("gptq-4bit-act-order", "g_idx", lambda t: t[:-4], r"g_idx has shape \[124\] for 128"),
    ("awq-g64", "qweight", lambda t: t[:-32], r"96 columns in groups of 64"),
    ("ct-w4a16", "weight_packed", lambda t: t[:-1], r"weight_packed \[255, 16\] does not hold"),
    ("ct-w4a16", "weight_scale", lambda t: t[:, :0], r"weight_scale \[256, 0\].*do not fit"),
    ("ct-w8a8", "weight", lambda t: t[:-1], r"weight \[255, 128\], weight_scale \[256, 1\]"),
    ("ct-fp8-dynamic", "weight_scale", lambda t: t[:-1], r"scale has shape \[255, 1\]"),
    ("fp8-block", "weight_scale_inv", lambda t: t[:1], r"where \[2, 1\] \(blocks of 128x128\)"),
]


@pytest.mark.parametrize(
    ("case", "suffix", "cut", "says"), MALFORMED, ids=[f"{m[0]}-{m[1]}" for m in MALFORMED]
)
def test_malformed_tensors_are_refused_naming_them(tmp_path_factory, case, suffix, cut, says):
    """Never a torch error, never wrong values: the module and its tensors' shapes named."""
    from safetensors.torch import load_file, save_file

    path = checkpoint(tmp_path_factory, case)
    tensors = load_file(path / "model.safetensors")
    tensors[f"{_UP}.{suffix}"] = cut(tensors[f"{_UP}.{suffix}"]).contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{_UP}.*{says}"):
        ModelWeights(RankLayout.of(_config(path)))


def test_a_checkpoint_of_another_shape_is_refused_naming_the_matrix(tmp_path_factory):
    """Tensors that fit each other but not the model the config describes."""
    import json

    path = checkpoint(tmp_path_factory, "gptq-4bit-g128")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 224
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gate_proj.weight: .*256 rows.*matrix is \[448, 128\]"):
        ModelWeights(RankLayout.of(_config(path)))


def test_a_quantized_mixture_of_experts_answers_as_its_reference(tmp_path_factory):
    """A GPTQ Qwen3-MoE (each expert's projections packed, as GPTQModel packs them): the
    experts read their Q4_1 blocks, greedy tokens equal transformers' over the dequantized
    weights. Act-order experts are refused naming the tensor."""
    from quant_checkpoints import reference_model_from_files, write_gptq

    from zllm.executor.layers.moe.block import MoEBlock

    path = write_gptq(tmp_path_factory.mktemp("moe"), 4, 32, sym=False, arch="qwen3_moe")
    ref = reference_model_from_files(path, tmp_path_factory.mktemp("moe-ref") / "ref")
    llm = LLM(str(path), kv_cache_memory_bytes=POOL)
    model = llm.model_runner.model
    blocks = [m.mlp for m in model.layers if isinstance(m.mlp, MoEBlock)]
    assert blocks and all(b.experts_gate_up.weight is None for b in blocks)  # blocks only
    outs = llm.generate(_inputs(), GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        theirs = hf_greedy(ref, prompt, GREEDY.max_tokens)
        assert_greedy_parity(ref, prompt, list(out.outputs[0].token_ids), theirs, label="moe")
    del llm

    act_order = write_gptq(
        tmp_path_factory.mktemp("moe-act"), 4, 32, desc_act=True, arch="qwen3_moe"
    )
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight: act-order"):
        ModelWeights(RankLayout.of(_config(act_order)))


def test_tensor_parallel_ranks_cut_the_blocks_on_block_boundaries(tmp_path_factory):
    """Two tensor-parallel ranks (o/down cut by input columns, 64 of 128 each: two Q4_0
    blocks) and two pipeline stages (each reading its own layers' tensors) give one rank's
    greedy tokens."""
    path = checkpoint(tmp_path_factory, "ct-w4a16-g32")
    one = LLM(str(path), kv_cache_memory_bytes=POOL)
    expected = [o.outputs[0].token_ids for o in one.generate(_inputs(), GREEDY, use_tqdm=False)]
    del one
    for ranks in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        two = LLM(str(path), kv_cache_memory_bytes=POOL, **ranks)
        got = [o.outputs[0].token_ids for o in two.generate(_inputs(), GREEDY, use_tqdm=False)]
        del two
        assert got == expected, ranks


def _inputs() -> list[dict]:
    return [{"prompt_token_ids": p} for p in PROMPTS]


def test_a_quantized_base_composes_with_lora_speculation_sleep_and_a_narrow_cache(
    tmp_path_factory, tmp_path
):
    """An act-order GPTQ base: an adapter's greedy tokens equal PEFT's over the dequantized
    reference; ngram speculation, an int8 KV cache and waking from sleep level 2 (the blocks
    made again from the checkpoint) give the plain engine's tokens."""
    import peft
    from lora_adapters import ALL_TARGETS, make_adapter

    from zllm import LoRARequest

    path = checkpoint(tmp_path_factory, "gptq-4bit-act-order")
    reference_dir = tmp_path / "reference"
    ref = reference_model(path)
    ref.save_pretrained(reference_dir)
    for tokenizer_file in path.glob("tokenizer*"):
        shutil.copy(tokenizer_file, reference_dir)
    adapter = make_adapter(str(reference_dir), tmp_path / "adapter", seed=3, r=4,
                           lora_alpha=8, target_modules=ALL_TARGETS)  # fmt: skip
    with_adapter = peft.PeftModel.from_pretrained(ref, str(adapter)).eval()

    plain = LLM(str(path), kv_cache_memory_bytes=POOL)
    expected = _greedy(plain)
    del plain

    llm = LLM(str(path), kv_cache_memory_bytes=POOL, enable_lora=True, enable_sleep_mode=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    lora = LoRARequest("a", 1, str(adapter))
    for prompt, ours in zip(PROMPTS, _greedy(llm, lora), strict=True):
        theirs = hf_greedy(with_adapter, prompt, GREEDY.max_tokens)
        assert_greedy_parity(with_adapter, prompt, ours, theirs, label="gptq base + lora")
    assert _greedy(llm) == expected
    llm.sleep(level=2)
    llm.wake_up()
    assert _greedy(llm) == expected
    del llm

    # An int8 cache rounds K and V as it does for the same weights unquantized.
    narrow = {}
    for model in (path, reference_dir):
        llm = LLM(str(model), kv_cache_memory_bytes=POOL, kv_cache_dtype="int8")
        narrow[model] = _greedy(llm)
        del llm
    for prompt, ours, theirs in zip(PROMPTS, narrow[path], narrow[reference_dir], strict=True):
        assert_greedy_parity(ref, prompt, ours, theirs, label="gptq base + int8 kv")


def _greedy(llm: LLM, lora=None) -> list[list[int]]:
    outs = llm.generate(_inputs(), GREEDY, use_tqdm=False, lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.e2e
def test_served_checkpoints_answer_as_offline(tmp_path_factory, tmp_path):
    """`zllm serve` on an AWQ and a compressed-tensors W8A8 checkpoint (the method found in
    config.json, no flag): /v1/completions' greedy tokens equal the offline API's, and
    /v1/models lists the model."""
    from servers import start_server, stop_server

    for case in ("awq-g128", "ct-w8a8"):
        path = checkpoint(tmp_path_factory, case)
        llm = LLM(str(path), kv_cache_memory_bytes=POOL)
        expected = _greedy(llm)
        del llm
        server = start_server(str(path), tmp_path / f"{case}.log")
        try:
            assert server.get("/v1/models").json()["data"][0]["id"]
            for prompt, tokens in zip(PROMPTS, expected, strict=True):
                body = {"prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                        "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
                choice = server.post("/v1/completions", body).json()["choices"][0]
                served = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
                assert served == tokens, case
        finally:
            stop_server(server)


def test_fp8_blocks_widen_every_e4m3_value_exactly():
    """zllm's FP8_E4M3 blocks hold every finite e4m3 byte (subnormals, both zeros) and widen
    to value x scale exactly, in the dequantizer, the few-rows path (1 row) and the prefill
    panels (64 rows)."""
    from zllm.executor.kernels import cpu as cpu_kernels
    from zllm.executor.weights.quantized.to_blocks import FloatWeight, float_blocks

    finite = [b for b in range(256) if b & 0x7F != 0x7F]  # 0x7F / 0xFF are NaN
    codes = torch.tensor(finite * 2, dtype=torch.uint8)[: 7 * 64].view(7, 64)
    values = codes.view(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5], [2.0**-10], [3.0], [1.0], [0.125], [7.0], [2.0**-14]])
    ggml_type, rows = float_blocks(FloatWeight(values, scale))
    assert ggml_type == FP8_E4M3 and rows.shape == (7, 2 * 34)
    expected = values.float() * scale
    assert torch.equal(cpu_kernels.gguf_dequantize(rows, ggml_type, 64), expected)
    for n in (1, 64):
        x = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
        got = cpu_kernels.gguf_linear(x, rows, ggml_type)
        torch.testing.assert_close(got, x @ expected.T, rtol=1e-5, atol=1e-5)
