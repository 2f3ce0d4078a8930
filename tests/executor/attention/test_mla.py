"""DeepSeek-V2's multi-head latent attention (MLA) in zllm's own code, against transformers'
DeepseekV2ForCausalLM token for token (tests/parity.py):

  lite  DeepSeek-V2-Lite's shape: one q_proj, untied logits (a Hugging Face directory)
  v2    DeepSeek-V2's: q_a_proj, its norm and q_b_proj; tied logits (also converted to GGUF)

Both: YaRN RoPE with mscale_all_dim (the softmax scale's correction), kv_lora_rank 96 + rope 16
per latent row, every layer dense.

  moe   the v2 shape with mixture-of-experts layers: one dense layer, then two of 8 routed
        experts (2 per token, picked within the best of 2 groups: group_limited_greedy) and
        one shared expert, routed_scaling_factor 1.5 (a Hugging Face directory, and GGUF)

The pool holds one latent row per token and layer, no V beside it;
prompts run past a KV block, in a batch, chunked, and after cached prefixes (decode rows of a
few tokens and prefill chunks after cached context alike), speculated (ngram) and over two
pipeline stages, in a narrow pool (--kv-cache-dtype bf16 / int8), and with LoRA adapters
against PEFT's; the v2 model as
llama.cpp's own converter writes it (deepseek2, split attn_k_b / attn_v_b) at F32 and Q8_0;
one served model; the options it cannot run with refused.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from family_cases import DEEPSEEK_V2
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from llama_cpp_convert import convert_hf_to_gguf, write_convertible_model
from lora_adapters import make_adapter
from parity import assert_greedy_parity, hf_greedy
from safetensors.torch import load_file
from tiny_models import TINY_CONFIG, arch_config_of, write_tiny_model

from zllm import LLM, LoRARequest, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.config.kv_layout import block_bytes
from zllm.executor.attention.metadata import AttentionMetadata
from zllm.executor.attention.mla import PagedLatentAttention, read_latents, stored_latents
from zllm.executor.layers.linear.gguf import GGUFLinear
from zllm.executor.layers.mlp import GatedMLP as LlamaMLP
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.router import GROUPED_SOFTMAX_TOPK, MoERule, deepseek_rule, route
from zllm.executor.weights.loader import load_weights
from zllm.kv.kv_dtypes import ELEMENT_BYTES, row_width
from zllm.lora import LoRAError, read_adapter
from zllm.model.arch import read_arch_config
from zllm.model.arch_config import MLAConfig
from zllm.model.gguf import read_gguf
from zllm.model.impl import choose_model_impl

# The cases are tests/family_cases.py's (the registry's parity test runs "moe").
CASES = DEEPSEEK_V2
KV_LORA_RANK, ROPE_DIM = CASES["v2"]["kv_lora_rank"], CASES["v2"]["qk_rope_head_dim"]
LAYERS, YARN = CASES["v2"]["num_hidden_layers"], CASES["v2"]["rope_parameters"]
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int, vocab: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def make_llm(path: str | Path, **kwargs) -> LLM:
    return LLM(str(path), kv_cache_memory_bytes=8 << 20, max_num_seqs=8, block_size=BLOCK, **kwargs)


def hf_model(directory: Path, outtype: str = "f32"):
    """transformers' model of the directory, its weights as an `outtype` GGUF file holds them."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(rounded(name, param, outtype))
    return model


def check(hf, prompts: list[list[int]], outputs, label: str) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 2, f"{label}[{i}]: a degenerate output: {ours}"
        assert_greedy_parity(hf, prompt, ours, hf_greedy(hf, prompt, len(ours)), label=label)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """case -> the tiny model's Hugging Face directory, with a tokenizer.json (written once)."""
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            path = tmp_path_factory.mktemp(case) / "hf"
            built[case] = write_tiny_model(path, "deepseek_v2", **CASES[case])
        return built[case]

    return get


# ---------------------------------------------------------------------------------------------
# The architecture and the pool: one latent row per token and layer


def test_config_json_reads_as_latent_attention(hf_dir) -> None:
    arch = read_arch_config(str(hf_dir("v2")))
    assert arch.mla == MLAConfig(
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=32,
        qk_rope_head_dim=ROPE_DIM,
        v_head_dim=64,
        q_lora_rank=64,
    )
    # One KV head whose row is half the latent, on each of the pool's two planes.
    assert (arch.num_kv_heads, arch.head_dim) == (1, (KV_LORA_RANK + ROPE_DIM) // 2)
    assert arch.rope_scaling == {k: v for k, v in YARN.items() if k != "rope_theta"}
    assert choose_model_impl(str(hf_dir("v2"))).name == "zllm"


def test_the_pool_holds_one_latent_row_per_token_and_layer(hf_dir) -> None:
    """KV bytes per token = (kv_lora_rank + rope) x layers x 4 (fp32): the core's block size
    (sized before the executor exists) and the executor's pool agree."""
    llm = make_llm(hf_dir("lite"))
    per_token = (KV_LORA_RANK + ROPE_DIM) * LAYERS * 4
    assert block_bytes(llm.config) == per_token * BLOCK
    kv = llm.model_runner.host.kv
    assert kv.bytes_per_slot() == per_token
    assert kv.num_blocks == (8 << 20) // (per_token * BLOCK)
    assert [tuple(t.shape) for t in kv.tensors] == [
        (2, kv.num_blocks, BLOCK, 1, (KV_LORA_RANK + ROPE_DIM) // 2)
    ] * LAYERS
    # A quarter of what the same heads' own keys (32 + 16) and values (64) would take.
    assert per_token * 4 == 4 * (32 + 16 + 64) * LAYERS * 4


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "int8"])
def test_absorbed_decode_equals_up_projected_attention(stored: str) -> None:
    """Decode rows (W_UK absorbed into the query, W_UV into the output, attending over the
    latents as cached) give what the prefill path's up-projected heads give; with a narrow
    pool (--kv-cache-dtype) both attend over the latents as stored, each half row rounded as
    a KV row of its width is."""
    torch.manual_seed(0)
    heads, nope, v, length = 4, 32, 64, 11
    attn = PagedLatentAttention(heads, KV_LORA_RANK, ROPE_DIM, scale=0.125)
    w_uk = torch.randn(heads, nope, KV_LORA_RANK) * 0.1
    w_uv = torch.randn(heads, v, KV_LORA_RANK) * 0.1
    q_nope, q_pe = torch.randn(length, heads, nope), torch.randn(length, heads, ROPE_DIM)
    latent = torch.randn(length, KV_LORA_RANK + ROPE_DIM)
    width = KV_LORA_RANK + ROPE_DIM
    cache = torch.zeros(2, 8, BLOCK, 1, row_width(width // 2, stored), dtype=getattr(torch, stored))
    table = [5, 2, 7]  # blocks out of order: slots go through the table
    slots = [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(length)]
    prompt = AttentionMetadata.build([length], [length], [table], slots, BLOCK, "cpu")
    whole = attn(q_nope, q_pe, latent, w_uk, w_uv, cache, prompt)
    back = read_latents(cache, torch.tensor(slots), width, torch.float32)
    assert torch.equal(back, stored_latents(latent, cache.dtype))
    # fp32 as written; bf16 within its rounding (2^-8 of |x| <= ~4); int8 within half a step
    # of its groups' scale (absmax / 127).
    bound = {"float32": 0.0, "bfloat16": 0.02, "int8": 0.02}[stored]
    assert (back - latent).abs().max() <= bound
    assert stored == "float32" or not torch.equal(back, latent)
    # The last token again, as a decode row over the cached latents.
    last = slice(length - 1, length)
    step = AttentionMetadata.build([1], [length], [table], slots[last], BLOCK, "cpu")
    assert step.decode is not None and not step.prefills
    decoded = attn(q_nope[last], q_pe[last], latent[last], w_uk, w_uv, cache, step)
    torch.testing.assert_close(decoded, whole[last], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Generating from the Hugging Face directory


@pytest.mark.parametrize("case", ["lite", "v2"])
def test_greedy_tokens_equal_transformers(hf_dir, case) -> None:
    """A batch of prompts up to 16 KV blocks long."""
    prompts = prompts_of([9, 23, 41, 66], seed=1)
    llm = make_llm(hf_dir(case))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    check(hf_model(hf_dir(case)), prompts, outputs, f"{case} batch")


def test_chunked_prefill_and_prefix_hits(hf_dir) -> None:
    """Prompts in chunks of 24 (a chunk after cached context reads it back from the pool), and
    a cached 40-token prefix followed by 3 new tokens (decode rows of several tokens) or by
    25 (a prefill chunk after cached context)."""
    hf = hf_model(hf_dir("lite"))
    llm = make_llm(hf_dir("lite"), max_num_batched_tokens=24)
    prompts = prompts_of([60, 50], seed=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    check(hf, prompts, outputs, "chunked")
    shared = prompts_of([40], seed=3)[0]
    first = llm.generate({"prompt_token_ids": shared + [5]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    hits = [shared + [7, 9, 11], shared + prompts_of([25], seed=4)[0]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in hits], GREEDY, use_tqdm=False)
    assert [out.num_cached_tokens for out in outputs] == [40, 40]  # 10 full blocks of 4
    check(hf, hits, outputs, "prefix hit")


@pytest.mark.parametrize(("kv", "stored"), [("bf16", "bfloat16"), ("int8", "int8")])
def test_a_narrow_latent_pool_holds_more_tokens_and_answers_alike(hf_dir, kv, stored) -> None:
    """--kv-cache-dtype: each half latent row stored as a KV row of its width is (bf16; int8
    bytes and a bf16 scale per 8 values): the core's block bytes and the pool agree, more
    blocks fit, and a prompt answers the same fresh, from a prefix hit and in chunks of 8;
    its first step's log-probabilities near the fp32 pool's."""
    llm = make_llm(hf_dir("lite"), kv_cache_dtype=kv)
    kv_pool, wide = llm.model_runner.host.kv, make_llm(hf_dir("lite"))
    assert {t.dtype for t in kv_pool.tensors} == {getattr(torch, stored)}
    half = (KV_LORA_RANK + ROPE_DIM) // 2
    per_token = 2 * row_width(half, stored) * ELEMENT_BYTES[stored] * LAYERS
    assert kv_pool.bytes_per_slot() == per_token and block_bytes(llm.config) == per_token * BLOCK
    assert kv_pool.num_blocks == (8 << 20) // (per_token * BLOCK)
    assert kv_pool.num_blocks > 1.5 * wide.model_runner.host.kv.num_blocks
    prompts = [{"prompt_token_ids": p} for p in prompts_of([41, 23, 30], seed=6)]
    fresh = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    hits = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in hits)
    assert [o.outputs[0].token_ids for o in hits] == fresh
    chunked = make_llm(
        hf_dir("lite"), kv_cache_dtype=kv, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)] == (
        fresh
    )
    # The first step's log-probabilities as the fp32 pool's, within the rounding (0.03 nats
    # measured): tokens themselves may flip where the random model's top two are near-tied.
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    for ours, exact in zip(
        llm.generate(prompts, first, use_tqdm=False),
        wide.generate(prompts, first, use_tqdm=False),
        strict=True,
    ):
        ours_lp, exact_lp = ours.outputs[0].logprobs[0], exact.outputs[0].logprobs[0]
        shared = set(ours_lp) & set(exact_lp)
        assert len(shared) >= 3
        assert max(abs(ours_lp[t].logprob - exact_lp[t].logprob) for t in shared) < 0.06


@pytest.mark.parametrize(
    ("case", "targets"),
    [
        ("lite", ["q_proj", "kv_a_proj_with_mqa", "o_proj"]),  # the whole query
        ("v2", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]),  # the query's low rank
        ("moe", ["q_a_proj", "kv_a_proj_with_mqa", "o_proj"]),  # experts: attention only
    ],
)
def test_lora_adapters_equal_peft(hf_dir, tmp_path, case, targets) -> None:
    """Adapters on latent attention's projections (PEFT's module names: the query whole or
    its low-rank pair, kv_a_proj_with_mqa, o_proj), mixed in one batch with the base model:
    each prompt's tokens equal transformers' under PEFT."""
    import peft
    import transformers

    adapter = make_adapter(str(hf_dir(case)), tmp_path / "a", seed=3, r=4, lora_alpha=8,
                           target_modules=targets)  # fmt: skip
    llm = make_llm(hf_dir(case), enable_lora=True)
    prompts = prompts_of([9, 23, 30], seed=9)
    lora = LoRARequest("a", 1, str(adapter))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    ours = llm.generate(inputs, GREEDY, lora_request=[lora, None, lora], use_tqdm=False)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir(case))
    adapted = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    for i in (0, 2):
        check(adapted, prompts[i : i + 1], ours[i : i + 1], f"{case} lora")
    with adapted.disable_adapter():
        check(adapted, prompts[1:2], ours[1:2], f"{case} base beside lora")
    assert (
        ours[0].outputs[0].token_ids
        != make_llm(hf_dir(case))
        .generate(inputs[0], GREEDY, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_an_adapter_on_kv_b_proj_is_refused_saying_why(hf_dir, tmp_path) -> None:
    adapter = make_adapter(str(hf_dir("lite")), tmp_path / "kv_b", seed=1, r=2,
                           target_modules=["kv_b_proj"])  # fmt: skip
    arch = read_arch_config(str(hf_dir("lite")))
    with pytest.raises(LoRAError, match="kv_b_proj.*absorbed decode"):
        read_adapter(str(adapter), arch, max_lora_rank=8)


def test_ngram_speculation_keeps_the_greedy_tokens(hf_dir) -> None:
    """Verifying proposals attends as decode rows of several tokens each."""
    rng = random.Random(5)
    bodies = [[rng.randrange(3, 400) for _ in range(n)] for n in (12, 20, 31)]
    prompts = [{"prompt_token_ids": b + b[:4]} for b in bodies]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = make_llm(hf_dir("lite")).generate(prompts, params, use_tqdm=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    spec = make_llm(hf_dir("lite"), speculative_config=ngram)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in plain
    ]
    assert spec.engine.heartbeat().spec.num_draft_tokens > 0


def test_two_pipeline_stages_answer_as_one_rank(hf_dir) -> None:
    """Each stage keeps its layer's latent pool (one row per token) and its part of the model."""
    prompts = [{"prompt_token_ids": p} for p in prompts_of([13, 29], seed=8)]
    one = make_llm(hf_dir("lite")).generate(prompts, GREEDY, use_tqdm=False)
    staged = make_llm(hf_dir("lite"), pipeline_parallel_size=2)
    assert staged.model_runner.host.kv.bytes_per_slot() == (KV_LORA_RANK + ROPE_DIM) * 4
    two = staged.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


# ---------------------------------------------------------------------------------------------
# GGUF: the file llama.cpp's converter writes (deepseek2)


def rounded(name: str, weight: torch.Tensor, outtype: str) -> torch.Tensor:
    """What the converter stores of a checkpoint tensor, read back as fp32: vectors in F32,
    matrices in the file's type, kv_b_proj as its split halves (attn_k_b: W_UK transposed,
    so rounded along its nope values; attn_v_b: W_UV)."""
    if weight.dim() != 2 or outtype == "f32":
        return weight
    if not name.endswith("kv_b_proj.weight"):
        return _q8_0(weight)
    per_head = weight.view(-1, 32 + 64, KV_LORA_RANK)
    w_uk = _q8_0(per_head[:, :32].transpose(1, 2)).transpose(1, 2)
    return torch.cat((w_uk, _q8_0(per_head[:, 32:])), dim=1).reshape(weight.shape)


def _q8_0(weight: torch.Tensor) -> torch.Tensor:
    values = weight.contiguous().numpy()
    blocks = quantize(values, GGMLQuantizationType.Q8_0)
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(values.shape))


@pytest.fixture(scope="module")
def convertible_dir(tmp_path_factory) -> Path:
    """The v2 model with a SentencePiece tokenizer, as the converter takes it."""
    return write_convertible_model(
        tmp_path_factory.mktemp("v2-spm") / "hf", "deepseek_v2", **CASES["v2"]
    )


@pytest.fixture(scope="module")
def gguf_file(convertible_dir):
    built: dict[str, str] = {}

    def get(outtype: str) -> str:
        if outtype not in built:
            out = convertible_dir.parent / f"v2-{outtype}.gguf"
            built[outtype] = str(convert_hf_to_gguf(convertible_dir, out, outtype))
        return built[outtype]

    return get


def test_the_file_reads_as_its_checkpoint(gguf_file, convertible_dir) -> None:
    path = gguf_file("f32")
    gguf = read_gguf(path)
    assert gguf.metadata["general.architecture"] == "deepseek2"
    assert {"blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= gguf.tensors.keys()
    assert "blk.0.attn_kv_b.weight" not in gguf.tensors  # split by this converter
    impl = choose_model_impl(path)
    assert (impl.name, impl.architecture) == ("zllm", "deepseek2")
    ours, checkpoint = read_arch_config(path), read_arch_config(str(convertible_dir))
    # The file keeps the epsilon and YaRN's log multiplier (0.1 x mscale_all_dim) as float32.
    assert np.float32(ours.rms_norm_eps) == np.float32(checkpoint.rms_norm_eps)
    assert ours.rope_scaling is not None and checkpoint.rope_scaling is not None
    for key in ("mscale", "mscale_all_dim"):
        assert ours.rope_scaling[key] == pytest.approx(checkpoint.rope_scaling[key], rel=1e-6)
    same = dict(
        architecture=checkpoint.architecture,
        rms_norm_eps=checkpoint.rms_norm_eps,
        rope_scaling=checkpoint.rope_scaling,
    )
    assert dataclasses.replace(ours, **same) == checkpoint


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_loaded_weights_are_the_checkpoints_as_stored(gguf_file, convertible_dir, outtype) -> None:
    """Bit for bit, kv_b_proj joined back from attn_k_b and attn_v_b."""
    path = gguf_file(outtype)
    ours = dict(load_weights(path, read_arch_config(path)))
    checkpoint = load_file(str(convertible_dir / "model.safetensors"))
    assert ours.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        expected = rounded(name, tensor, outtype)
        assert torch.equal(ours[name].view(torch.int32), expected.view(torch.int32)), name


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_gguf_greedy_tokens_equal_transformers(gguf_file, convertible_dir, outtype) -> None:
    """Q8_0: every projection but kv_b_proj (split per head in decode: dequantized) reads the
    file's blocks, so do the embedding and the logits."""
    llm = make_llm(gguf_file(outtype))
    model = llm.model_runner.model
    if outtype == "f32":
        assert llm.model_runner.quantization == "none"
    else:
        assert llm.model_runner.quantization == "gguf"
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            matmuls = (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj)
            matmuls += (mlp.gate_up_proj, mlp.down_proj)
            assert all(isinstance(m, GGUFLinear) for m in matmuls), matmuls
        assert model.logits_proj is not None and model.embed_rows is not None
    prompts = prompts_of([9, 30, 47], seed=6)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    check(hf_model(convertible_dir, outtype), prompts, outputs, f"gguf-{outtype}")


def test_an_older_converters_whole_kv_b_reads_the_same(gguf_file, tmp_path) -> None:
    """Files from converters before the split: attn_kv_b whole, and the per-head sizes as
    attention.key_length / value_length (no *_mla keys). The same architecture and weights."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    new = gguf_file("f32")
    reader = GGUFReader(new)
    old = tmp_path / "old.gguf"
    writer = GGUFWriter(str(old), "deepseek2")
    per_head = {
        "deepseek2.attention.key_length": 32 + ROPE_DIM,
        "deepseek2.attention.value_length": 64,
    }
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.endswith("_mla"):
            continue
        array = field.types[0] == GGUFValueType.ARRAY
        value = per_head.get(key, field.contents())
        writer.add_key_value(key, value, field.types[0], field.types[-1] if array else None)
    halves = {}
    for tensor in reader.tensors:
        layer, _, kind = tensor.name.rpartition(".attn_")
        if kind in ("k_b.weight", "v_b.weight"):
            halves[layer, kind] = np.array(tensor.data)
            if len([k for k in halves if k[0] == layer]) == 2:
                w_uk = halves[layer, "k_b.weight"].transpose(0, 2, 1)  # [heads, nope, rank]
                kv_b = np.concatenate((w_uk, halves[layer, "v_b.weight"]), axis=1)
                writer.add_tensor(f"{layer}.attn_kv_b.weight", kv_b.reshape(-1, KV_LORA_RANK))
            continue
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "blk.0.attn_kv_b.weight" in read_gguf(str(old)).tensors
    assert read_arch_config(str(old)) == read_arch_config(new)
    theirs = dict(load_weights(new, read_arch_config(new)))
    ours = dict(load_weights(str(old), read_arch_config(str(old))))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


# ---------------------------------------------------------------------------------------------
# Mixture of experts: DeepSeek-V2's router and its MoE layers


def reference_route(logits: torch.Tensor, top_k: int, groups: int, used: int, norm: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """DeepSeek-V2's router token by token in float64: softmax; the `used` groups of the
    highest best score (ties: the lower group); the top k of their experts (ties: the lower
    id); renormalised if asked; times scale."""
    weights, experts = [], []
    for row in logits.double():
        scores = torch.softmax(row, dim=-1).tolist()
        size = len(scores) // groups
        best = sorted(range(groups), key=lambda g: (-max(scores[g * size : (g + 1) * size]), g))
        allowed = [e for e in range(len(scores)) if e // size in best[:used]]
        chosen = sorted(allowed, key=lambda e: (-scores[e], e))[:top_k]
        w = [scores[e] for e in chosen]
        total = sum(w) if norm else 1.0
        weights.append([x / total * scale for x in w])
        experts.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(experts)


@pytest.mark.parametrize(
    ("groups", "used", "norm"), [(1, 1, False), (2, 1, False), (4, 2, True), (4, 4, True)]
)
def test_deepseek_router_matches_a_float64_reference(groups, used, norm) -> None:
    """Group-limited top-k, with ties: rows of repeated logits pick the lower group and id."""
    torch.manual_seed(groups * 10 + used)
    logits = torch.randn(64, 8) * 3
    logits[:8] = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0, 2.0, 1.0, 0.0])  # tied groups and experts
    rule = MoERule(router=GROUPED_SOFTMAX_TOPK, norm_topk_prob=norm, group_count=groups,
                   groups_used=used, routed_scaling=1.5, shared_expert_gated=False)  # fmt: skip
    weights, experts = route(logits, 3, rule)
    want_weights, want_experts = reference_route(logits, 3, groups, used, norm, 1.5)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-6, atol=1e-7)
    assert experts[0].tolist() == ([1, 2, 4] if used == groups else [1, 2, 0])
    if groups > used:  # the limit changed some token's choice
        ungrouped = route(logits, 3, dataclasses.replace(rule, group_count=1, groups_used=1))[1]
        assert not torch.equal(experts, ungrouped)


def test_deepseek_router_matches_transformers_router() -> None:
    """transformers' DeepseekV2TopkRouter on the same weights (its top-k is unsorted: compared
    as sets, weights by expert)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(**{**TINY_CONFIG, **CASES["moe"], "num_key_value_heads": 4})
    router = DeepseekV2TopkRouter(config)
    torch.manual_seed(3)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(32, config.hidden_size)
    _, their_weights, their_experts = router(x)
    arch = arch_config_of(config)
    weights, experts = route(F.linear(x, router.weight), 2, deepseek_rule(arch))
    order = torch.argsort(their_experts, dim=-1)
    assert torch.equal(experts.sort(dim=-1).values, their_experts.gather(-1, order))
    by_expert = torch.argsort(experts, dim=-1)
    torch.testing.assert_close(weights.gather(-1, by_expert), their_weights.gather(-1, order))


def test_moe_config_reads_as_deepseek_moe_layers(hf_dir) -> None:
    arch = read_arch_config(str(hf_dir("moe")))
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 32)
    assert (moe.expert_group_count, moe.expert_groups_used) == (2, 1)
    assert moe.shared_expert_intermediate_size == 32 and moe.routed_scaling_factor == 1.5
    assert moe.dense_mlp_layers == (0,) and not moe.norm_topk_prob
    rule = deepseek_rule(arch)
    assert (rule.router, rule.shared_expert_gated) == (GROUPED_SOFTMAX_TOPK, False)


def moe_rounded(name: str, weight: torch.Tensor, outtype: str) -> torch.Tensor:
    """As rounded(); the router stays F32 in every file (llama.cpp keeps ffn_gate_inp so)."""
    return weight if name.endswith("mlp.gate.weight") else rounded(name, weight, outtype)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """outtype -> the moe model converted by llama.cpp's converter (one directory)."""
    root = tmp_path_factory.mktemp("moe-spm")
    source = write_convertible_model(root / "hf", "deepseek_v2", **CASES["moe"])
    built: dict[str, str] = {}

    def get(outtype: str) -> str:
        if outtype not in built:
            built[outtype] = str(convert_hf_to_gguf(source, root / f"moe-{outtype}.gguf", outtype))
        return built[outtype]

    get.source = source  # type: ignore[attr-defined]
    return get


def test_the_moe_file_reads_as_its_checkpoint(moe_gguf) -> None:
    path = moe_gguf("f32")
    gguf = read_gguf(path)
    assert {"blk.1.ffn_gate_exps.weight", "blk.2.ffn_down_shexp.weight"} <= gguf.tensors.keys()
    ours, checkpoint = read_arch_config(path), read_arch_config(str(moe_gguf.source))
    assert ours.moe is not None and ours.moe == checkpoint.moe  # every expert field
    loaded = dict(load_weights(path, ours))
    stored = load_file(str(moe_gguf.source / "model.safetensors"))
    stacked = loaded["model.layers.1.mlp.experts.up_proj.weight"]
    assert stacked.shape == (8, 32, 64)
    assert torch.equal(stacked[5], stored["model.layers.1.mlp.experts.5.up_proj.weight"])
    for name in ("mlp.gate.weight", "mlp.shared_experts.down_proj.weight"):
        assert torch.equal(loaded[f"model.layers.2.{name}"], stored[f"model.layers.2.{name}"])


def test_moe_greedy_tokens_equal_transformers(hf_dir) -> None:
    """The moe case from its directory, a batch. The routing is not degenerate: the first MoE
    layer picks several pairs of experts, and the group limit changes some token's pair."""
    prompts = prompts_of([9, 23, 41], seed=2)
    llm = make_llm(hf_dir("moe"))
    model = llm.model_runner.model
    assert isinstance(model.layers[0].mlp, LlamaMLP)
    assert all(isinstance(layer.mlp, MoEBlock) for layer in model.layers[1:])
    first = model.layers[1].mlp
    logits: list[torch.Tensor] = []
    hook = first.gate.register_forward_hook(lambda _m, _i, out: logits.append(out.clone()))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    hook.remove()
    router_logits = torch.cat(logits)
    experts = route(router_logits, 2, first.rule)[1]
    assert len({tuple(sorted(row)) for row in experts.tolist()}) > 3
    ungrouped = dataclasses.replace(first.rule, group_count=1, groups_used=1)
    assert not torch.equal(experts, route(router_logits, 2, ungrouped)[1])
    check(hf_model(hf_dir("moe")), prompts, outputs, "moe")


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_moe_gguf_greedy_tokens_equal_transformers(moe_gguf, outtype) -> None:
    """Q8_0: the routed experts read the file's stacked blocks, the shared experts too."""
    llm = make_llm(moe_gguf(outtype))
    model = llm.model_runner.model
    if outtype == "q8_0":
        for layer in model.layers[1:]:
            mlp = layer.mlp
            assert mlp.experts_gate_up.parts is not None and mlp.experts_down.parts is not None
            shared = mlp.shared_expert
            assert isinstance(shared.gate_up_proj, GGUFLinear), shared
            assert isinstance(shared.down_proj, GGUFLinear), shared
    prompts = prompts_of([9, 30, 47], seed=6)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_gguf.source).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(moe_rounded(name, param, outtype))
    check(hf, prompts, outputs, f"moe-gguf-{outtype}")


# ---------------------------------------------------------------------------------------------
# Refused: what the latent attention does not run yet


def test_v3s_router_method_with_v2s_scores_is_refused(tmp_path) -> None:
    """noaux_tc is DeepSeek-V3's rule over sigmoid scores; a V2 config asking it over softmax
    scores (its default) names both (tests/executor/models/test_deepseek_v3.py runs V3)."""
    path = write_tiny_model(tmp_path / "v3-router", "deepseek_v2", weights=False,
                            **dict(CASES["moe"], topk_method="noaux_tc"))  # fmt: skip
    with pytest.raises(ValueError, match=r"scoring_func 'softmax' with topk_method 'noaux_tc'"):
        read_arch_config(str(path))


@pytest.mark.parametrize(
    ("option", "reason"),
    [
        (dict(tensor_parallel_size=2), "--tensor-parallel-size 2: the latent attention's heads"),
        (dict(model_impl="transformers"), "--model-impl transformers: transformers' MLA"),
        (dict(deterministic=True), "--deterministic"),
    ],
)
def test_options_it_cannot_run_with_are_refused(hf_dir, option, reason) -> None:
    args = EngineArgs(model=str(hf_dir("lite")), **option)
    with pytest.raises(ValueError) as refused:
        args.create_engine_config()
    message = str(refused.value)
    assert message.startswith("deepseek_v2 cannot run with ")
    assert reason in message
    assert "(the DeepSeek-V2/V3 family (deepseek_v2) has no " in message


# ---------------------------------------------------------------------------------------------
# Served


@pytest.mark.e2e
def test_served_answers_as_transformers(hf_dir, engine_pool, tmp_path) -> None:
    """Token-id prompts through `zllm serve`: transformers' greedy tokens."""
    prompts = prompts_of([14, 37], seed=7)
    with engine_pool.serve(
        str(hf_dir("lite")), tmp_path / "server.log", "--block-size", "4"
    ) as server:
        model = server.get("/v1/models").json()["data"][0]["id"]
        body = dict(model=model, max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
        body |= dict(return_tokens_as_token_ids=True, prompt=prompts)
        answer = server.post("/v1/completions", body).json()
    assert "choices" in answer, answer
    hf = hf_model(hf_dir("lite"))
    for i, choice in enumerate(sorted(answer["choices"], key=lambda c: c["index"])):
        ours = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        theirs = hf_greedy(hf, prompts[i], len(ours))
        assert_greedy_parity(hf, prompts[i], ours, theirs, label=f"served[{i}]")
