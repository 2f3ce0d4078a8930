"""DeepSeek-V2's multi-head latent attention (MLA) in zllm's own code, against transformers'
DeepseekV2ForCausalLM token for token (tests/parity.py):

  lite  DeepSeek-V2-Lite's shape: one q_proj, untied logits (a Hugging Face directory)
  v2    DeepSeek-V2's: q_a_proj, its norm and q_b_proj; tied logits (also converted to GGUF)

Both: YaRN RoPE with mscale_all_dim (the softmax scale's correction), kv_lora_rank 96 + rope 16
per latent row, every layer dense (the MoE layers are refused until executor/models/moe.py
serves DeepSeek's experts). The pool holds one latent row per token and layer, no V beside it;
prompts run past a KV block, in a batch, chunked, and after cached prefixes (decode rows of a
few tokens and prefill chunks after cached context alike), speculated (ngram) and over two
pipeline stages; the v2 model as llama.cpp's own converter writes it (deepseek2, split
attn_k_b / attn_v_b) at F32 and Q8_0; one served model; the options it cannot run with refused.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from llama_cpp_convert import convert_hf_to_gguf, write_convertible_model
from parity import assert_greedy_parity, hf_greedy
from safetensors.torch import load_file
from servers import start_server, stop_server
from tiny_models import write_tiny_model

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.config.kv_layout import block_bytes
from zllm.executor.attention.metadata import AttentionMetadata
from zllm.executor.attention.mla import PagedLatentAttention, read_latents
from zllm.executor.weights.gguf_modules import GGUFLinear
from zllm.executor.weights.loader import load_weights
from zllm.model.arch import read_arch_config
from zllm.model.arch_config import MLAConfig
from zllm.model.gguf import read_gguf
from zllm.model.impl import choose_model_impl

KV_LORA_RANK, ROPE_DIM, LAYERS = 96, 16, 2
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,  # max_position_embeddings 512 over 128
    "original_max_position_embeddings": 128,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
LATENT: dict = dict(
    num_key_value_heads=None,  # (the config class makes it num_attention_heads)
    kv_lora_rank=KV_LORA_RANK,
    qk_nope_head_dim=32,
    qk_rope_head_dim=ROPE_DIM,
    v_head_dim=64,
    first_k_dense_replace=LAYERS,  # every layer dense
    num_hidden_layers=LAYERS,
    rope_parameters=YARN,
)
CASES = {
    "lite": dict(LATENT, q_lora_rank=None, tie_word_embeddings=False),
    "v2": dict(LATENT, q_lora_rank=64, tie_word_embeddings=True),
}
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


def test_absorbed_decode_equals_up_projected_attention() -> None:
    """Decode rows (W_UK absorbed into the query, W_UV into the output, attending over the
    latents as cached) give what the prefill path's up-projected heads give."""
    torch.manual_seed(0)
    heads, nope, v, length = 4, 32, 64, 11
    attn = PagedLatentAttention(heads, KV_LORA_RANK, ROPE_DIM, scale=0.125)
    w_uk = torch.randn(heads, nope, KV_LORA_RANK) * 0.1
    w_uv = torch.randn(heads, v, KV_LORA_RANK) * 0.1
    q_nope, q_pe = torch.randn(length, heads, nope), torch.randn(length, heads, ROPE_DIM)
    latent = torch.randn(length, KV_LORA_RANK + ROPE_DIM)
    cache = torch.zeros(2, 8, BLOCK, 1, (KV_LORA_RANK + ROPE_DIM) // 2)
    table = [5, 2, 7]  # blocks out of order: slots go through the table
    slots = [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(length)]
    prompt = AttentionMetadata.build([length], [length], [table], slots, BLOCK, "cpu")
    whole = attn(q_nope, q_pe, latent, w_uk, w_uv, cache, prompt)
    assert torch.equal(read_latents(cache, torch.tensor(slots)), latent)
    # The last token again, as a decode row over the cached latents.
    last = slice(length - 1, length)
    step = AttentionMetadata.build([1], [length], [table], slots[last], BLOCK, "cpu")
    assert step.decode is not None and not step.prefills
    decoded = attn(q_nope[last], q_pe[last], latent[last], w_uk, w_uv, cache, step)
    torch.testing.assert_close(decoded, whole[last], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Generating from the Hugging Face directory


@pytest.mark.parametrize("case", CASES)
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
# Refused: what the latent attention does not run yet


def test_mixture_of_experts_layers_are_refused(tmp_path) -> None:
    path = write_tiny_model(tmp_path / "moe", "deepseek_v2", weights=False,
                            **dict(LATENT, first_k_dense_replace=1))  # fmt: skip
    with pytest.raises(ValueError, match=r"routed experts in layers 1\.\.1: .*not yet"):
        read_arch_config(str(path))


@pytest.mark.parametrize(
    ("option", "reason"),
    [
        (dict(tensor_parallel_size=2), "--tensor-parallel-size 2: the latent attention's heads"),
        (dict(kv_cache_dtype="int8"), "--kv-cache-dtype int8: the latent pool is kept"),
        (dict(model_impl="transformers"), "--model-impl transformers: transformers' MLA"),
        (dict(enable_lora=True), "--enable-lora"),
        (dict(quantization="int8"), "--quantization int8"),
        (dict(deterministic=True), "--deterministic"),
    ],
)
def test_options_it_cannot_run_with_are_refused(hf_dir, option, reason) -> None:
    args = EngineArgs(model=str(hf_dir("lite")), **option)
    with pytest.raises(ValueError) as refused:
        args.create_engine_config()
    message = str(refused.value)
    assert message.startswith("deepseek_v2 (multi-head latent attention) cannot run with ")
    assert reason in message


# ---------------------------------------------------------------------------------------------
# Served


@pytest.mark.e2e
def test_served_answers_as_transformers(hf_dir, tmp_path) -> None:
    """Token-id prompts through `zllm serve`: transformers' greedy tokens."""
    prompts = prompts_of([14, 37], seed=7)
    server = start_server(str(hf_dir("lite")), tmp_path / "server.log", "--block-size", "4")
    try:
        model = server.get("/v1/models").json()["data"][0]["id"]
        body = dict(model=model, max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
        body |= dict(return_tokens_as_token_ids=True, prompt=prompts)
        answer = server.post("/v1/completions", body).json()
    finally:
        stop_server(server)
    assert "choices" in answer, answer
    hf = hf_model(hf_dir("lite"))
    for i, choice in enumerate(sorted(answer["choices"], key=lambda c: c["index"])):
        ours = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        theirs = hf_greedy(hf, prompts[i], len(ours))
        assert_greedy_parity(hf, prompts[i], ours, theirs, label=f"served[{i}]")
