"""gpt-oss end to end: a tiny random GptOssForCausalLM (sliding and full layers alternating,
window 8, attention sinks, YaRN, 4 experts of which 2 per token, biases drawn away from zero)
run by the real engine against transformers, token for token, from

    its Hugging Face directory          fp32, the layout transformers saves
    an MXFP4 checkpoint of it           experts as *_blocks/*_scales (random codes), held as
                                        GGUF MXFP4 blocks on CPU; transformers runs the same
                                        model with those experts dequantized by its own code
    GGUF files llama.cpp's converter    F32 from the fp32 directory; MXFP4 experts from the
    writes of both                      MXFP4 one (held in their blocks)

with prompts past the window, chunked prefill and the hybrid KV cache on and off; and once
through `zllm serve`, whose harmony parsers gpt-oss selects by itself.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from family_cases import GPT_OSS
from llama_cpp_convert import convert_hf_to_gguf, write_convertible_model
from parity import assert_greedy_parity, hf_greedy, set_bf16_gemm_rows
from tiny_models import draw_sinks_and_expert_biases

from zllm import LLM, SamplingParams
from zllm.executor.layers.moe.experts import ExpertMatrices
from zllm.executor.weights import mxfp4
from zllm.model.arch import read_arch_config
from zllm.model.arch_config import MoEConfig
from zllm.model.family import Trait
from zllm.model.registry import family_of

# The tiny shape is tests/family_cases.py's: layers sliding, full, sliding, full (gpt-oss's
# order); heads of 64 as the real model's.
WINDOW = GPT_OSS["sliding_window"]
BLOCK = 4
NUM_EXPERTS = GPT_OSS["num_local_experts"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Harmony's special tokens (zllm/text/tool_parsers/harmony.py reads them) and a template that writes it.
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def write_mxfp4_pair(
    source: Path,
    mxfp4_dir: Path,
    reference_dir: Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> None:
    """From a gpt-oss directory: its MXFP4 checkpoint (each expert projection random FP4
    codes and E8M0 exponents, as OpenAI's *_blocks/*_scales; the other tensors in `dtype`:
    OpenAI's are bf16) and the same model with those experts dequantized by transformers' own
    MXFP4 code, for transformers to run (MXFP4 values are exact in bf16). The checkpoint gets
    the tokenizer.json zllm reads (transformers' conversion of the SentencePiece model)."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = {n: t.to(dtype) for n, t in load_file(str(source / "model.safetensors")).items()}
    config = json.loads((source / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)
    packed, dense = {}, {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows, width = (2 * inter, hidden) if name.endswith("gate_up_proj") else (hidden, inter)
        shape = (NUM_EXPERTS, rows, width // 32)
        blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 127, shape, generator=gen, dtype=torch.uint8)
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert dense[name].shape == tensors[name].shape
        del tensors[name]
    for directory, experts in ((mxfp4_dir, packed), (reference_dir, dense)):
        shutil.copytree(source, directory)
        save_file({**tensors, **experts}, str(directory / "model.safetensors"))
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router", "lm_head"]}
    (mxfp4_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(mxfp4_dir)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> Path:
    """The served one: byte-level BPE with harmony's tokens, a harmony chat template."""
    from tiny_models import write_tiny_model

    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    write_tiny_model(
        path,
        arch="gpt_oss",
        chat_template=HARMONY_TEMPLATE,
        extra_special=HARMONY_TOKENS,
        **GPT_OSS,
    )
    return draw_sinks_and_expert_biases(path)


@pytest.fixture(scope="module")
def convertible(tmp_path_factory) -> dict[str, Path]:
    """A SentencePiece-vocabulary gpt-oss (what llama.cpp's converter takes here), its MXFP4
    checkpoint and dequantized twin, and the GGUF files the converter writes of the first two."""
    root = tmp_path_factory.mktemp("gpt-oss-convertible")
    dirs = {name: root / name for name in ("float", "mxfp4", "dequantized", "bf16", "bf16-twin")}
    write_convertible_model(dirs["float"], "gpt_oss", **GPT_OSS)
    draw_sinks_and_expert_biases(dirs["float"])
    write_mxfp4_pair(dirs["float"], dirs["mxfp4"], dirs["dequantized"])
    write_mxfp4_pair(dirs["float"], dirs["bf16"], dirs["bf16-twin"], dtype=torch.bfloat16)
    dirs["float.gguf"] = convert_hf_to_gguf(dirs["float"], root / "float.gguf", "f32")
    dirs["mxfp4.gguf"] = convert_hf_to_gguf(dirs["mxfp4"], root / "mxfp4.gguf", "f32")
    return dirs


def hf_model_of(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_llm(path: Path, **kwargs) -> LLM:
    kwargs = {"block_size": BLOCK, "max_num_batched_tokens": 16, **kwargs}
    return LLM(str(path), kv_cache_memory_bytes=8 << 20, **kwargs)


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def check_parity(llm: LLM, hf_model, label: str, vocab: int = 300) -> None:
    """Five prompts, three past the window, prefilled in chunks of 16 tokens, 24 tokens each."""
    prompts = prompts_of([3, 8, 20, 37, 61], vocab)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 3, f"{label}[{i}]: a degenerate output proves little: {ours}"
        theirs = hf_greedy(hf_model, prompt, len(ours))
        assert_greedy_parity(hf_model, prompt, ours, theirs, label=f"{label}[{i}]")


def expert_holdings(llm: LLM) -> list[tuple[str, ...]]:
    """How each expert projection is held: its block types, or ("float",)."""
    names = {mxfp4.MXFP4_GGML_TYPE: "MXFP4"}
    held = []
    for module in llm.model_runner.model.modules():
        if isinstance(module, ExpertMatrices):
            if module.parts is None:
                assert module.weight is not None
                held.append(("float",))
            else:
                assert module.weight is None, "blocks held beside a float copy"
                held.append(tuple(names.get(t, str(t)) for _, t in module.parts))
    return held


def test_arch_from_config_and_gguf(convertible):
    """config.json and the converter's GGUF file describe the same model: alternating layers,
    the window, sinks, YaRN unrounded (gpt-oss's truncate: false, which GGUF drops), experts."""
    hf = read_arch_config(str(convertible["float"]))
    gguf = read_arch_config(str(convertible["float.gguf"]))
    assert (hf.architecture, gguf.architecture) == ("gpt_oss", "gpt-oss")
    for arch in (hf, gguf):
        assert arch.layer_types == ["sliding_attention", "full_attention"] * 2
        assert arch.sliding_window == WINDOW and arch.attention_bias
        assert family_of(arch).has(Trait.ATTENTION_SINKS)
        assert arch.moe == MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        assert (arch.head_dim, arch.num_kv_heads, arch.tie_word_embeddings) == (64, 2, False)
        assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["truncate"] is False
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        assert gguf.rope_scaling[key] == hf.rope_scaling[key]


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("hybrid", [True, False])
def test_greedy_parity_from_the_checkpoint(gpt_oss_dir, monkeypatch, hybrid, kernels):
    """The CPU kernels' backend (sinks in the decode kernel) and torch's (ZLLM_CPU_KERNELS=0),
    with sliding layers on their own KV cache group or every block kept."""
    monkeypatch.setenv("ZLLM_CPU_KERNELS", kernels)
    llm = make_llm(gpt_oss_dir, hybrid_kv_cache=hybrid)
    groups = [g.sliding_window for g in llm.model_runner.kv_groups]
    assert groups == ([None, WINDOW] if hybrid else [None])
    model = llm.model_runner.model
    assert type(model).__name__ == "GptOssForCausalLM"
    assert (model.layers[0].self_attn.attn.decode_kernel is not None) == (kernels == "1")
    check_parity(llm, hf_model_of(gpt_oss_dir), f"gpt-oss hybrid={hybrid} kernels={kernels}")


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_mxfp4_checkpoint_against_its_dequantized_twin(convertible, monkeypatch, kernels):
    """The MXFP4 checkpoint's experts stay MXFP4 blocks where the CPU kernels run the model
    (repacked, never widened), and are dequantized otherwise: both answer as transformers
    does with the experts its own code dequantized."""
    monkeypatch.setenv("ZLLM_CPU_KERNELS", kernels)
    llm = make_llm(convertible["mxfp4"])
    expected = [("MXFP4",)] * 8 if kernels == "1" else [("float",)] * 8
    assert expert_holdings(llm) == expected
    check_parity(llm, hf_model_of(convertible["dequantized"]), f"mxfp4 kernels={kernels}")


def test_bf16_checkpoint_with_mxfp4_experts(convertible):
    """OpenAI's layout: bf16 tensors and MXFP4 experts. On CPU the matrices read their bf16
    rows (the 16-bit path) and the experts their MXFP4 blocks: transformers' answers on the
    same values."""
    llm = make_llm(convertible["bf16"])
    assert llm.model_runner.quantization == "16-bit"
    set_bf16_gemm_rows(llm, 0)  # fp32 sums (with AMX, prefills in bf16 GEMMs: test_sixteen_bit)
    assert expert_holdings(llm) == [("MXFP4",)] * 8
    attn = llm.model_runner.model.layers[0].self_attn
    assert (attn.qkv_proj.ggml_type, attn.o_proj.ggml_type) == (30, 30)  # BF16 rows
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    check_parity(llm, hf_model_of(convertible["bf16-twin"]), "bf16 + mxfp4")


def test_gguf_of_the_checkpoint(convertible):
    """convert_hf_to_gguf.py's F32 file (its experts split into gate and up) against
    transformers on the directory it was converted from."""
    llm = make_llm(convertible["float.gguf"])
    check_parity(llm, hf_model_of(convertible["float"]), "gguf f32")


def test_gguf_with_mxfp4_experts(convertible):
    """The converter's file of the MXFP4 checkpoint: its experts MXFP4 (repacked by
    llama.cpp's code, not ours), held in their blocks, against transformers on the twin."""
    from zllm.model.gguf import read_gguf

    types = {i.ggml_type.name for n, i in read_gguf(str(convertible["mxfp4.gguf"])).tensors.items()}
    assert "MXFP4" in types
    llm = make_llm(convertible["mxfp4.gguf"])
    assert expert_holdings(llm) == [("MXFP4",)] * 8
    check_parity(llm, hf_model_of(convertible["dequantized"]), "gguf mxfp4")


def test_mxfp4_repacking_equals_ggufs_reading():
    """weights/mxfp4.py's GGUF rows dequantize (by gguf-py's MXFP4 reader) to what
    transformers makes of the checkpoint's blocks, and its own dequantize agrees."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 5, 4), generator=gen, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    rows = mxfp4.gguf_rows(blocks, scales)
    assert rows.shape == (3, 5, 4 * 17)
    read = dequantize(rows.numpy(), GGMLQuantizationType.MXFP4).reshape(3, 5, 128)
    assert torch.equal(torch.from_numpy(read), theirs)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.float32), theirs)


def test_transformers_backend_passes_the_sinks(gpt_oss_dir):
    """--model-impl transformers: transformers' gpt-oss modeling hands each layer's sinks
    (s_aux) to zllm's paged attention, which takes them."""
    llm = make_llm(gpt_oss_dir, model_impl="transformers")
    assert type(llm.model_runner.model).__name__ == "TransformersForCausalLM"
    check_parity(llm, hf_model_of(gpt_oss_dir), "transformers backend")


def test_transformers_backend_refuses_gpt_oss_gguf(convertible):
    """transformers' GGUF reader fails on gpt-oss files with a TypeError deep in its loader;
    asked for it, zllm says so and what runs them instead."""
    from zllm.model.impl import choose_model_impl

    path = str(convertible["float.gguf"])
    assert choose_model_impl(path).name == "zllm"
    with pytest.raises(ValueError, match="transformers' GGUF reader cannot read gpt-oss"):
        choose_model_impl(path, "transformers")


def test_harmony_parsers_selected_for_gpt_oss_only():
    import dataclasses

    from zllm.config.serve import ServerArgs
    from zllm.model.registry import family_named
    from zllm.runtime.launch import with_model_parsers

    gpt_oss = family_named("gpt_oss")
    chosen = with_model_parsers(ServerArgs(), gpt_oss)
    assert (chosen.reasoning_parser, chosen.tool_call_parser) == ("openai_gptoss", "openai")
    assert with_model_parsers(ServerArgs(), family_named("llama")).reasoning_parser is None
    named = dataclasses.replace(ServerArgs(), reasoning_parser="qwen3")
    kept = with_model_parsers(named, gpt_oss)
    assert (kept.reasoning_parser, kept.tool_call_parser) == ("qwen3", None)


@pytest.mark.e2e
def test_served_with_harmony_parsers(gpt_oss_dir, engine_pool, tmp_path):
    """`zllm serve` on the tiny gpt-oss, no parser named: a grammar makes it write harmony
    (analysis, then final) and chat answers it as reasoning_content and content, so the
    parsers were chosen; a greedy completion is transformers' greedy text."""
    from zllm.text.tokenizer import load_tokenizer

    with engine_pool.serve(
        str(gpt_oss_dir), tmp_path / "server.log", "--served-model-name", "tiny"
    ) as server:
        tokenizer = load_tokenizer(str(gpt_oss_dir))
        ids = {t: tokenizer.encode(t, add_special_tokens=False)[0] for t in HARMONY_TOKENS}
        grammar = (
            f'start: <[{ids["<|channel|>"]}]> "analysis" <[{ids["<|message|>"]}]> "Think."'
            f' <[{ids["<|end|>"]}]> <[{ids["<|start|>"]}]> "assistant" <[{ids["<|channel|>"]}]>'
            f' "final" <[{ids["<|message|>"]}]> "Sunny." <[{ids["<|return|>"]}]>'
        )
        body = dict(
            model="tiny",
            messages=[{"role": "user", "content": "Weather?"}],
            max_tokens=64,
            # The grammar writes the whole harmony text, headers and all: from the first token
            # (a constraint would otherwise wait for the answer's header).
            structured_outputs={"grammar": grammar, "after_tokens": []},
        )
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Think.", "Sunny.")
        prompt = prompts_of([40], 300, seed=7)[0]
        r = server.post(
            "/v1/completions",
            dict(model="tiny", prompt=prompt, max_tokens=16, temperature=0.0, ignore_eos=True),
        )
        assert r.status_code == 200, r.text
        theirs = hf_greedy(hf_model_of(gpt_oss_dir), prompt, 16)
        assert r.json()["choices"][0]["text"] == tokenizer.decode(theirs)
        assert "openai_gptoss" in server.log_text()
