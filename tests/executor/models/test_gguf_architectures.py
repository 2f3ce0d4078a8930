"""Qwen 3, Phi-3 and Mistral GGUF files as llama.cpp's own converter writes them
(tests/llama_cpp_convert.py), run by zllm's native decoder:

  qwen3    per-head q/k norms (blk.N.attn_q_norm, attn_k_norm), tied embeddings, q/k rows in
           Hugging Face's order
  phi3     fused attn_qkv and ffn_up (gate and up), LongRoPE (rope_factors_long/short,
           phi3.rope.scaling.*) over 3/4 of each head, a window of 8 on every layer
  mistral  a "llama" file (q/k rows permuted for llama.cpp's rope), heads of 32 beside
           hidden 64 / 4 heads, untied logits

Each tiny random model is converted at F32, F16 and Q8_0. zllm reads each file's architecture
as the checkpoint's config.json says it, and loads the checkpoint's weights bit for bit from the
F32 file, and from the others exactly what gguf-py's rounding of them to the file's type gives.
Greedy tokens equal transformers' on the Hugging Face directory (F32), or on it with those
rounded weights (F16, Q8_0, where zllm's matmuls read the file's blocks), token for token
(tests/parity.py). One model is served by `zllm serve`. GGUF architectures that neither zllm nor
transformers runs are refused, naming what runs.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from family_cases import PHI3, PHI3_CONTEXT
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from llama_cpp_convert import OUTTYPES, convert_hf_to_gguf, write_convertible_model
from parity import assert_greedy_parity, hf_greedy
from safetensors.torch import load_file

from zllm import LLM, SamplingParams
from zllm.executor.layers.linear.gguf import GGUFLinear
from zllm.executor.weights.loader import load_weights
from zllm.model.arch import read_arch_config
from zllm.model.gguf import read_gguf
from zllm.model.impl import choose_model_impl
from zllm.model.registry import native_gguf_architectures
from zllm.text.incremental_detokenizer import IncrementalDetokenizer
from zllm.text.tokenizer import load_tokenizer

# Phi-3's shape is tests/family_cases.py's: LongRoPE over 3/4 of each head, a window on every
# layer. Its pretraining context: the prompts run past it (LongRoPE's long factors).
WINDOW = PHI3["sliding_window"]
ORIGINAL_CONTEXT = PHI3_CONTEXT
LONGROPE = PHI3["rope_parameters"]
# write_convertible_model overrides per architecture (tiny_models.TINY_CONFIG otherwise).
CASES: dict[str, dict] = {
    "qwen3": dict(),
    "phi3": PHI3,
    "mistral": dict(head_dim=32, tie_word_embeddings=False, sliding_window=None),
}
# What the converter names each architecture, and a tensor only its files have.
GGUF_ARCH = {"qwen3": "qwen3", "phi3": "phi3", "mistral": "llama"}
MARK_TENSOR = {
    "qwen3": "blk.1.attn_k_norm.weight",
    "phi3": "rope_factors_long.weight",
    "mistral": "output.weight",
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT_LENGTHS = [40, 45, 52]  # past ORIGINAL_CONTEXT and WINDOW


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """case -> the tiny model's Hugging Face directory (written once)."""
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            path = tmp_path_factory.mktemp(case) / "hf"
            built[case] = write_convertible_model(path, case, **CASES[case])
        return built[case]

    return get


@pytest.fixture(scope="module")
def gguf_file(model_dir) -> Callable[[str, str], str]:
    """(case, outtype) -> the GGUF file convert_hf_to_gguf.py writes (converted once)."""
    built: dict[tuple[str, str], str] = {}

    def get(case: str, outtype: str) -> str:
        if (case, outtype) not in built:
            directory = model_dir(case)
            out = directory.parent / f"{case}-{outtype}.gguf"
            built[case, outtype] = str(convert_hf_to_gguf(directory, out, outtype))
        return built[case, outtype]

    return get


def rounded(weight: torch.Tensor, outtype: str) -> torch.Tensor:
    """What the converter stores of a checkpoint tensor, read back as fp32: matrices in the
    file's type (gguf-py's own rounding), vectors (norms, biases) in F32."""
    if weight.dim() != 2 or outtype == "f32":
        return weight
    if outtype == "f16":
        return weight.half().float()
    blocks = quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(weight.shape))


def hf_model_as_stored(directory: Path, outtype: str):
    """transformers' model of the directory, its weights as the `outtype` file holds them."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        for param in model.parameters():  # a tied embedding once: it is one tensor
            param.copy_(rounded(param, outtype))
    return model


# ---------------------------------------------------------------------------------------------
# The files: zllm's own code, the checkpoint's architecture, the checkpoint's weights


@pytest.mark.parametrize("case", CASES)
def test_the_file_reads_as_its_checkpoint(gguf_file, model_dir, case) -> None:
    path = gguf_file(case, "f32")
    gguf = read_gguf(path)
    assert gguf.metadata["general.architecture"] == GGUF_ARCH[case]
    assert MARK_TENSOR[case] in gguf.tensors
    impl = choose_model_impl(path)
    assert (impl.name, impl.architecture) == ("zllm", GGUF_ARCH[case])
    ours, checkpoint = read_arch_config(path), read_arch_config(str(model_dir(case)))
    # The file keeps the norm epsilon as float32, and Mistral's name as "llama".
    assert np.float32(ours.rms_norm_eps) == np.float32(checkpoint.rms_norm_eps)
    same = dict(architecture=checkpoint.architecture, rms_norm_eps=checkpoint.rms_norm_eps)
    assert dataclasses.replace(ours, **same) == checkpoint


def test_phi3_reads_longrope_partial_rotation_and_window(gguf_file) -> None:
    arch = read_arch_config(gguf_file("phi3", "f32"))
    assert arch.rope_scaling == {
        "rope_type": "longrope",
        "long_factor": LONGROPE["long_factor"],
        "short_factor": LONGROPE["short_factor"],
        "original_max_position_embeddings": ORIGINAL_CONTEXT,
        "partial_rotary_factor": 0.75,
    }
    assert (arch.layer_types, arch.sliding_window) == (["sliding_attention"] * 2, WINDOW)


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("case", CASES)
def test_loaded_weights_are_the_checkpoints_as_stored(gguf_file, model_dir, case, outtype) -> None:
    """Bit for bit: each HF tensor (Phi-3's fused ones whole, Mistral's q/k rows back in HF's
    order) as the file's type rounds it."""
    path = gguf_file(case, outtype)
    ours = dict(load_weights(path, read_arch_config(path)))
    checkpoint = load_file(str(model_dir(case) / "model.safetensors"))
    assert ours.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        expected = rounded(tensor, outtype)
        assert torch.equal(ours[name].view(torch.int32), expected.view(torch.int32)), name


# ---------------------------------------------------------------------------------------------
# Generating: transformers' greedy tokens


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers(gguf_file, model_dir, case, outtype) -> None:
    path = gguf_file(case, outtype)
    llm = LLM(path, kv_cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=4)
    model = llm.model_runner.model
    if outtype == "f32":
        assert llm.model_runner.quantization == "none"
    else:  # every matmul reads the file's blocks, Phi-3's fused ones included
        assert llm.model_runner.quantization == "gguf"
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            matmuls = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            assert all(isinstance(m, GGUFLinear) for m in matmuls), matmuls
        assert model.logits_proj is not None and model.embed_rows is not None
    hf = hf_model_as_stored(model_dir(case), outtype)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts(), outputs, strict=True)):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 2, f"{case}-{outtype}[{i}]: a degenerate output: {ours}"
        theirs = hf_greedy(hf, prompt, len(ours))
        assert_greedy_parity(hf, prompt, ours, theirs, label=f"{case}-{outtype}[{i}]")


@pytest.mark.parametrize("case", CASES)
def test_the_transformers_backend_reads_the_file_as_transformers_does(
    gguf_file, model_dir, case
) -> None:
    """`--model-impl transformers` on the converter's file: transformers' own GGUF reader
    builds the model (Qwen3's key_length, which it skips, taken from zllm's reading) and the
    greedy tokens are transformers' on the checkpoint. Phi-3's window and LongRoPE factors,
    which that reader drops, are refused naming them."""
    path = gguf_file(case, "f32")
    if case == "phi3":
        with pytest.raises(ValueError, match="drops this Phi-3 file's sliding window"):
            LLM(path, model_impl="transformers")
        return
    llm = LLM(path, model_impl="transformers", kv_cache_memory_bytes=8 << 20, block_size=4)
    hf = hf_model_as_stored(model_dir(case), "f32")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts(), outputs, strict=True)):
        ours = out.outputs[0].token_ids
        theirs = hf_greedy(hf, prompt, len(ours))
        assert_greedy_parity(hf, prompt, ours, theirs, label=f"transformers-{case}[{i}]")


def test_byte_fallback_pieces_never_break_streamed_text(gguf_file) -> None:
    """The file's SentencePiece tokenizer turns a run of byte tokens that is not UTF-8 into
    U+FFFD, text already streamed included; random outputs hit it within a few tokens, and
    the detokenizer goes on (tokenizers' DecodeStream alone raises)."""
    tokenizer = load_tokenizer(gguf_file("qwen3", "f32"))
    rng = random.Random(0)
    streams = [[rng.randrange(400) for _ in range(12)] for _ in range(200)]
    for ids in streams:
        detok = IncrementalDetokenizer(tokenizer, [5, 6, 7])
        assert detok.update(ids) is None
        detok.take_delta(finished=True)
    prime, valid = [5, 6, 7], tokenizer.encode("Paged attention stores keys in blocks.")
    detok = IncrementalDetokenizer(tokenizer, prime)
    detok.update(valid)
    head = tokenizer.decode(prime)
    assert head + detok.take_delta(finished=True) == tokenizer.decode(prime + valid)


# ---------------------------------------------------------------------------------------------
# Served


@pytest.mark.e2e
def test_served_phi3_q8_0_tokenizes_and_answers_as_transformers(
    gguf_file, model_dir, engine_pool, tmp_path
) -> None:
    """The file's SentencePiece tokenizer splits text as sentencepiece does; greedy tokens of
    text and token-id prompts equal transformers' on the Q8_0-rounded checkpoint."""
    import sentencepiece

    path = gguf_file("phi3", "q8_0")
    spm = sentencepiece.SentencePieceProcessor(
        model_file=str(model_dir("phi3") / "tokenizer.model")
    )
    text = " ".join(["Continuous batching lets requests join and leave every step."] * 4)
    hf = hf_model_as_stored(model_dir("phi3"), "q8_0")
    with engine_pool.serve(path, tmp_path / "server.log", "--block-size", "4") as server:
        tokenized = server.post("/tokenize", {"prompt": text}).json()
        assert tokenized["tokens"] == spm.encode(text)
        body = dict(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
        body |= dict(return_tokens_as_token_ids=True)
        body["model"] = server.get("/v1/models").json()["data"][0]["id"]
        choices = []
        for asked in (text, prompts(1)):  # text, then token ids (one kind per request)
            answer = server.post("/v1/completions", {**body, "prompt": asked}).json()
            assert "choices" in answer, answer
            choices += sorted(answer["choices"], key=lambda c: c["index"])
    assert len(choices) == 1 + len(PROMPT_LENGTHS)
    for i, (prompt, choice) in enumerate(
        zip([spm.encode(text), *prompts(1)], choices, strict=True)
    ):
        ours = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        theirs = hf_greedy(hf, prompt, len(ours))
        assert_greedy_parity(hf, prompt, ours, theirs, label=f"served-phi3[{i}]")


# ---------------------------------------------------------------------------------------------
# Refused: an architecture nothing here runs


def test_a_gguf_architecture_nothing_runs_is_refused_naming_what_does(tmp_path: Path) -> None:
    path = tmp_path / "rwkv7.gguf"
    writer = GGUFWriter(str(path), "rwkv7")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for model_impl in ("auto", "zllm", "transformers"):
        with pytest.raises(ValueError) as refused:
            LLM(str(path), model_impl=model_impl)
        message = str(refused.value)
        assert "GGUF architecture 'rwkv7' runs neither in zllm's own code" in message
        assert f"(GGUF files of {', '.join(native_gguf_architectures())})" in message
        assert "nor through transformers' GGUF reader (" in message and "stablelm" in message
