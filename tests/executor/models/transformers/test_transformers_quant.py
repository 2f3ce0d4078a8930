"""Quantized matmuls on the transformers backend (issue 38): transformers' own nn.Linear and
nn.Embedding modules swapped after loading for zllm's block-reading modules
(executor/models/transformers_quant.py).

On a GGUF file the transformers backend must give the tokens zllm's own model code gives with
the same kernel on the same file (log-probabilities within LOGPROB_BOUND: the same kernel
multiplies the same blocks; only the norms, rotary and attention around the matmuls are
transformers' code instead of zllm's), hold the blocks and no fp32 matrix, and keep fp32
modules (logged) for the matrices the kernel cannot read.
"""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_files import MIXED_TYPES, write_llama_gguf
from tiny_models import write_tiny_model
from torch import nn

from zllm import LLM, SamplingParams
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.layers.linear.gguf import GGUFEmbedding, GGUFLinear
from zllm.executor.weights.quantization import SIXTEEN_BIT
from zllm.model.gguf import read_gguf

# |logprob(transformers backend) - logprob(zllm's code)| of each sampled token, both on the
# kernel: measured at most ~2e-6 on these files (fp32 rounding of differently ordered norms,
# rotary and attention), bounded with room.
LOGPROB_BOUND = 1e-4
# With int8 activations, rounding flips between the two codes: measured up to ~0.04 on these
# files.
INT8_BOUND = 0.1
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], [300, 12, 99], list(range(40, 73))]
MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llm(path: str, **kwargs) -> LLM:
    return LLM(path, kv_cache_memory_bytes=16 << 20, max_num_seqs=4, **kwargs)


def generate(llm: LLM) -> list:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def assert_same_outputs(ours: list, reference: list) -> None:
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert a.token_ids == b.token_ids, i
        for token, pa, pb in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
            assert abs(pa[token].logprob - pb[token].logprob) <= LOGPROB_BOUND, (i, token)


def matmuls_of(layer: nn.Module) -> list[nn.Module]:
    """A Llama decoder layer's seven matmuls, in MATMULS order."""
    return [getattr(layer.self_attn if n in MATMULS[:4] else layer.mlp, n) for n in MATMULS]


def assert_close_first_tokens(ours: list, reference: list) -> None:
    """int8 activations: x is rounded to int8 per call (gguf-int8: per block of 32 or 256
    values), so an fp32 difference of one ulp between the
    two model codes can move a rounding, and with it later tokens. Each prompt's first token
    (its prefill) must agree, its log-probability within INT8_BOUND."""
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        token = a.token_ids[0]
        assert token == b.token_ids[0], i
        assert abs(a.logprobs[0][token].logprob - b.logprobs[0][token].logprob) <= INT8_BOUND, i


def hf_model_of(llm: LLM) -> nn.Module:
    model = llm.model_runner.model
    assert hasattr(model, "hf"), "not the transformers backend"
    return model.hf


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the kernel modules' blocks, bytes of fp32 matrices still held)."""
    blocks = {id(m.qweight): m.qweight for m in model.modules() if hasattr(m, "qweight")}
    fp32 = [p for p in model.parameters() if p.dim() >= 2]
    return sum(t.nbytes for t in blocks.values()), sum(p.nbytes for p in fp32)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_gguf_blocks_serve_transformers_matmuls_as_zllm_code_does(tmp_path, ggml_type) -> None:
    path = tmp_path / f"tiny-{ggml_type.name}.gguf"
    write_llama_gguf(path, lambda name: ggml_type)
    reference = generate(tiny_llm(str(path), quantization="gguf-float"))
    llm = tiny_llm(str(path), model_impl="transformers", quantization="gguf-float")
    assert llm.model_runner.quantization == "gguf-float"
    hf = hf_model_of(llm)
    for layer in hf.model.layers:
        modules = matmuls_of(layer)
        assert all(type(m) is GGUFLinear and m.ggml_type == ggml_type for m in modules)
    assert type(hf.lm_head) is GGUFLinear and type(hf.model.embed_tokens) is GGUFEmbedding
    # Resident: the file's matrices' blocks, and no fp32 matrix beside them.
    matrices = [i for i in read_gguf(str(path)).tensors.values() if len(i.shape) == 2]
    file_blocks = sum(i.nbytes for i in matrices)
    assert weight_bytes(hf) == (file_blocks, 0)
    assert file_blocks < 0.3 * sum(4 * i.shape[0] * i.shape[1] for i in matrices)  # fp32's
    assert_same_outputs(generate(llm), reference)


def test_gguf_is_the_default_for_a_gguf_file_on_the_transformers_backend(tmp_path) -> None:
    path = tmp_path / "q8.gguf"
    write_llama_gguf(path, lambda name: T.Q8_0)
    llm = tiny_llm(str(path), model_impl="transformers")
    assert llm.model_runner.quantization == "gguf"
    assert type(hf_model_of(llm).model.layers[0].mlp.down_proj) is GGUFLinear


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_gguf_int8_on_the_transformers_backend_decodes_with_integer_dots(
    tmp_path, ggml_type
) -> None:
    path = tmp_path / f"{ggml_type.name}.gguf"
    write_llama_gguf(path, lambda name: ggml_type)
    reference = generate(tiny_llm(str(path), quantization="gguf-int8"))
    llm = tiny_llm(str(path), model_impl="transformers", quantization="gguf-int8")
    q_proj = hf_model_of(llm).model.layers[0].self_attn.q_proj
    assert type(q_proj) is GGUFLinear and q_proj.int8_activations
    x = torch.randn(1, q_proj.in_features)  # one row: the integer path
    expected = cpu_kernels.gguf_linear_int8(x, q_proj.qweight, q_proj.ggml_type)
    assert torch.equal(q_proj(x), expected)
    assert_close_first_tokens(generate(llm), reference)


def test_matrices_the_kernel_cannot_read_keep_fp32_modules_logged(tmp_path, caplog) -> None:
    """F32 matrices: transformers' fp32 modules, the rest blocks."""
    caplog.set_level(logging.INFO, logger="zllm.executor.models.transformers.quant")
    path = tmp_path / "mixed.gguf"
    write_llama_gguf(path, lambda name: MIXED_TYPES[name.removesuffix(".weight")])
    llm = tiny_llm(str(path), model_impl="transformers")
    assert llm.model_runner.quantization == "gguf"
    hf = hf_model_of(llm)
    layer0, layer1 = hf.model.layers
    assert type(layer0.self_attn.o_proj) is nn.Linear  # F32
    assert type(layer0.mlp.down_proj) is nn.Linear  # F32
    assert type(hf.lm_head) is nn.Linear  # F32
    assert type(layer0.self_attn.q_proj) is GGUFLinear and type(layer1.mlp.down_proj) is GGUFLinear
    assert type(hf.model.embed_tokens) is GGUFEmbedding  # IQ4_XS
    assert (
        "transformers backend: 13 of 16 matmuls and embeddings read GGUF blocks; kept fp32: "
        "model.layers.0.self_attn.o_proj (tensor 'blk.0.attn_output.weight' is F32"
    ) in caplog.text
    # The default's arithmetic per matmul: zllm's code fuses q/k/v (Q4_K, Q8_0 parts: one
    # path for the call) where transformers' modules are separate, so near-ties may differ.
    assert_close_first_tokens(generate(llm), generate(tiny_llm(str(path))))


def test_a_16_bit_checkpoint_keeps_its_rows_on_the_transformers_backend(tmp_path) -> None:
    """bf16 safetensors: the same 16-bit rows zllm's code reads, widened in the kernel."""
    path = str(write_tiny_model(tmp_path / "bf16", dtype=torch.bfloat16))
    reference = generate(tiny_llm(path))
    llm = tiny_llm(path, model_impl="transformers")
    assert llm.model_runner.quantization == SIXTEEN_BIT
    hf = hf_model_of(llm)
    down = hf.model.layers[0].mlp.down_proj
    assert type(down) is GGUFLinear and down.ggml_type == 30  # BF16 rows
    blocks, fp32 = weight_bytes(hf)
    assert fp32 == 0 and blocks == sum(2 * p.numel() for p in hf_matrices_of(path))
    assert_same_outputs(generate(llm), reference)


def hf_matrices_of(path: str) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [
        t for f in Path(path).glob("*.safetensors") for t in load_file(f).values() if t.dim() == 2
    ]


@pytest.mark.parametrize("ranks", [1, 2])
def test_int8_quantizes_the_projections_zllm_code_does(tmp_path, ranks) -> None:
    """Q8_0 blocks made at load for q/k/v, o, gate/up and down; the logits stay fp32 (found
    by their role in gguf-py's name map), as on zllm's code. Over two ranks each quantizes its
    part (o_proj's and down_proj's input columns, inside the row-parallel matmul)."""
    from zllm.executor.layers.linear.parallel import RowParallelLinear

    path = str(write_tiny_model(tmp_path / "llama"))
    reference = generate(tiny_llm(path, quantization="int8", tensor_parallel_size=ranks))
    llm = tiny_llm(path, model_impl="transformers", quantization="int8", tensor_parallel_size=ranks)
    hf = hf_model_of(llm)
    for layer in hf.model.layers:
        matmuls = matmuls_of(layer)
        if ranks > 1:
            assert type(matmuls[3]) is RowParallelLinear and type(matmuls[6]) is RowParallelLinear
            matmuls = [m.local if type(m) is RowParallelLinear else m for m in matmuls]
        kinds = [type(m) for m in matmuls]
        assert kinds == [GGUFLinear] * 7
        assert all(m.ggml_type == int(T.Q8_0) for m in matmuls)
    assert type(hf.lm_head) is nn.Linear
    assert_close_first_tokens(generate(llm), reference)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_tensor_parallel_ranks_read_their_part_of_the_blocks(tmp_path, ggml_type) -> None:
    """Two ranks on the transformers backend, cut by transformers' plan, each matmul then
    swapped for its rank's part of the file's blocks: colwise q/k/v and gate/up their output
    rows, rowwise o/down their input columns where those fall on block boundaries (Q4_K's
    256-value blocks do not split o_proj's 256 columns in two: it keeps its fp32 part, as
    zllm's own ranks do). The tokens zllm's code gives on two ranks with the same kernel."""
    from zllm.executor.layers.linear.parallel import RowParallelLinear

    path = tmp_path / f"tiny-{ggml_type.name}.gguf"
    write_llama_gguf(path, lambda name: ggml_type)
    reference = generate(tiny_llm(str(path), tensor_parallel_size=2, quantization="gguf-float"))
    llm = tiny_llm(
        str(path), model_impl="transformers", tensor_parallel_size=2, quantization="gguf-float"
    )
    hf = hf_model_of(llm)
    for layer in hf.model.layers:
        q, k, v, o, gate, up, down = matmuls_of(layer)
        assert type(o) is RowParallelLinear and type(down) is RowParallelLinear
        assert all(type(m) is GGUFLinear for m in (q, k, v, gate, up, down.local))
        assert q.qweight.shape[0] == 128 and gate.qweight.shape[0] == 256  # half the rows
        assert down.local.in_features == 256  # half the columns, 512 / 2
        assert type(o.local) is (GGUFLinear if ggml_type == T.Q8_0 else nn.Linear)
    assert_same_outputs(generate(llm), reference)


def test_the_fp32_weights_a_swap_replaces_are_freed(tmp_path) -> None:
    """No reference to a replaced fp32 matrix outlives the swap (the blocks alone stay)."""
    from transformers import AutoModelForCausalLM

    from zllm.executor.models.transformers.quant import TransformersQuantization

    path = tmp_path / "q8.gguf"
    write_llama_gguf(path, lambda name: T.Q8_0)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name)
    replaced = [weakref.ref(p) for p in hf.parameters() if p.dim() == 2]
    TransformersQuantization(hf, str(path), "gguf").apply(hf)
    gc.collect()
    assert len(replaced) == 2 * 7 + 2 and all(ref() is None for ref in replaced)


def test_a_scaled_embedding_reads_blocks_and_scales_them_as_its_forward_does() -> None:
    """Gemma 3's Gemma3TextScaledWordEmbedding (rows times embed_scale) over Q8_0 blocks; an
    embedding subclass whose forward does something else keeps its fp32 module."""
    from gguf.quants import dequantize, quantize
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from zllm.executor.models.transformers.quant import GGUFScaledEmbedding, _embedding_of

    rows = quantize(torch.randn(300, 64).numpy() * 0.1, T.Q8_0)
    scaled = Gemma3TextScaledWordEmbedding(300, 64, padding_idx=0, embed_scale=8.0)
    scaled.weight.data = torch.from_numpy(dequantize(rows, T.Q8_0).reshape(300, 64))
    blocks = (int(T.Q8_0), torch.from_numpy(rows))
    new = _embedding_of(blocks, scaled)
    assert isinstance(new, GGUFScaledEmbedding)
    ids = torch.tensor([[0, 7, 299, 150]])
    assert torch.equal(new(ids), scaled(ids))

    class Shifted(nn.Embedding):
        embed_scale = torch.tensor(8.0)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids) * self.embed_scale + 1.0

    shifted = Shifted(300, 64)
    shifted.weight.data = scaled.weight.data
    assert _embedding_of(blocks, shifted) == "Shifted does more than scale the rows it looks up"


@pytest.mark.parametrize("ranks", [1, 2], ids=["pp2", "pp2-tp2"])
def test_pipeline_stages_of_the_transformers_backend_read_their_layers_blocks(
    tmp_path, ranks
) -> None:
    """Pipeline stages on the transformers backend (transformers_pp.py) with the kernel: each
    stage (each of its tensor-parallel ranks) swaps the matmuls of the layers it keeps for
    block-reading modules, and two stages give one stage's tokens."""
    path = tmp_path / "q8.gguf"
    write_llama_gguf(path, lambda name: T.Q8_0)
    reference = generate(tiny_llm(str(path), model_impl="transformers"))
    staged = tiny_llm(
        str(path), model_impl="transformers", pipeline_parallel_size=2, tensor_parallel_size=ranks
    )
    assert staged.model_runner.quantization == "gguf"
    assert_same_outputs(generate(staged), reference)
