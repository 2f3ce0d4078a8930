"""Llama 4's text model in zllm's own code (executor/models/llama4.py): its NoPE layers' query
temperature and the rotating layers' head norm switched as config.json says, chunked attention
(each rotating layer's query sees its own chunk) through both CPU backends, chunked prefill and
prefix hits, the context capped at one chunk on a GPU, the multimodal checkpoint refused naming
it, and served. Parity of the registry row's model (HF directory and GGUF, the
default temperature floor and chunk) is tests/executor/models/test_families.py's `llama4`."""

from __future__ import annotations

import json
import random

import pytest
from family_cases import CASES, LLAMA4, convertible
from llama_cpp_convert import SPM_VOCAB_SIZE, convert_hf_to_gguf
from parity import assert_greedy_parity, hf_greedy

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.model.arch import read_arch_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
_rng = random.Random(4)
PROMPTS = [[_rng.randrange(3, SPM_VOCAB_SIZE) for _ in range(n)] for n in (7, 30, 61)]


def check_parity(directory, prompts, outputs, label: str) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    for i, (prompt, ours) in enumerate(zip(prompts, outputs, strict=True)):
        assert len(set(ours)) > 2, f"{label}[{i}]: a degenerate output: {ours}"
        theirs = hf_greedy(hf, prompt, len(ours))
        assert_greedy_parity(hf, prompt, ours, theirs, label=f"{label}[{i}]")


def generate(path, prompts=PROMPTS) -> list[list[int]]:
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    "change",
    [
        # positions from 3 on scale the NoPE layer's queries (floor((p + 1) / 4) >= 1)
        dict(floor_scale=4, attn_scale=0.5),
        dict(use_qk_norm=False, attn_temperature_tuning=False),
    ],
    ids=["temperature", "no-qk-norm-no-temperature"],
)
def test_config_switches_answer_as_transformers(tmp_path, change) -> None:
    directory = convertible("llama4_text", **LLAMA4, **change)(tmp_path / "llama4")
    fields = read_arch_config(str(directory)).family_fields
    assert fields.temperature_tuning == change.get("attn_temperature_tuning", True)
    assert fields.qk_norm == change.get("use_qk_norm", True)
    check_parity(directory, PROMPTS, generate(directory), str(change))


# Prompts of 1 to 4 chunks of 16 and answers crossing a chunk's end (13 + 10 > 16 ...).
CHUNKED_PROMPTS = [[_rng.randrange(3, SPM_VOCAB_SIZE) for _ in range(n)] for n in (13, 30, 61)]


@pytest.mark.parametrize(
    "chunk, engine",
    [
        (16, {}),
        (16, {"max_num_batched_tokens": 12}),  # prompts in pieces that straddle the chunks
        (10, {"block_size": 4}),  # chunks starting inside a block
    ],
    ids=["whole-prompts", "chunked-prefill", "unaligned-chunk"],
)
@pytest.mark.parametrize("kernels", ["1", "0"], ids=["cpu-kernels", "torch"])
def test_chunked_attention_answers_as_transformers(tmp_path, monkeypatch, chunk, engine, kernels):
    """The rotating layers attend within their chunk (the NoPE layer over everything), as
    transformers' chunked masks: greedy tokens equal its, decode rows across chunk ends
    included, by the decode kernel and by torch's gather + SDPA; a second pass over the same
    prompts starts from cached prefix blocks and answers the same."""
    monkeypatch.setenv("ZLLM_CPU_KERNELS", kernels)
    directory = convertible("llama4_text", **LLAMA4, attention_chunk_size=chunk)(tmp_path / "c")
    arch = read_arch_config(str(directory))
    assert arch.attention_chunk == chunk and arch.chunked_layers == (0, 1, 2)
    assert arch.nope_layers == (3,) and arch.max_position_embeddings > chunk
    options = dict(kv_cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=16) | engine
    llm = LLM(str(directory), **options)
    assert llm.model_runner.host.layout.attention.name == (
        "cpu-kernels" if kernels == "1" else "torch"
    )
    prompts = [{"prompt_token_ids": p} for p in CHUNKED_PROMPTS]
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    check_parity(directory, CHUNKED_PROMPTS, first, f"chunk {chunk}")
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again[1:])  # (13 tokens: no whole block)
    assert [list(o.outputs[0].token_ids) for o in again] == first


def test_on_a_gpu_the_context_stops_at_one_chunk(tmp_path) -> None:
    """Where the chunk does not run (the CUDA kernels take a window), the context is one
    chunk, within which the attention is plain causal; a longer one is refused saying why."""
    directory = convertible("llama4_text", **LLAMA4, attention_chunk_size=64)(tmp_path / "c")
    arch = read_arch_config(str(directory))
    arch.within_one_chunk()
    assert arch.max_position_embeddings == 64 and "CUDA kernels take" in arch.context_cap
    assert arch.chunked_layers == ()
    # On the CPU the whole context is served.
    config = EngineArgs(model=str(directory), max_model_len=100, device="cpu")
    assert config.create_engine_config().scheduler.max_model_len == 100


def test_the_multimodal_checkpoint_is_refused_naming_it(tmp_path) -> None:
    directory = tmp_path / "mm"
    directory.mkdir()
    config = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
              "text_config": {"model_type": "llama4_text"}, "vision_config": {}}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Llama 4's multimodal checkpoint"):
        read_arch_config(str(directory))


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_qkv_read_their_blocks_with_the_heads_rows_moved(tmp_path, outtype) -> None:
    """A GGUF file's q/k/v are served from their blocks, each q/k head's rows of blocks moved
    from pairs to halves as the fp32 rows are (Llama4ForCausalLM.block_rows): the float
    kernel over the blocks (gguf-float) gives the greedy tokens of the file's weights as fp32
    rows (--quantization none)."""
    from zllm.executor.layers.linear.gguf import GGUFLinear, GGUFSplitLinear

    directory = convertible("llama4_text", **LLAMA4)(tmp_path / "llama4")
    path = convert_hf_to_gguf(directory, tmp_path / f"llama4-{outtype}.gguf", outtype)
    blocks, rows = (
        LLM(str(path), kv_cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=4,
            quantization=quantization)
        for quantization in ("gguf-float", "none")
    )  # fmt: skip
    kinds = (GGUFLinear, GGUFSplitLinear)
    assert isinstance(blocks.model_runner.model.layers[0].self_attn.qkv_proj, kinds)
    assert not isinstance(rows.model_runner.model.layers[0].self_attn.qkv_proj, kinds)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ours = [o.outputs[0].token_ids for o in blocks.generate(prompts, GREEDY, use_tqdm=False)]
    assert ours == [o.outputs[0].token_ids for o in rows.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.e2e
def test_served_answers_as_transformers(engine_pool, tmp_path) -> None:
    """Token-id prompts through `zllm serve`: transformers' greedy tokens."""
    directory = CASES["llama4"].write(tmp_path / "llama4")
    with engine_pool.serve(str(directory), tmp_path / "server.log", "--block-size", "4") as server:
        model = server.get("/v1/models").json()["data"][0]["id"]
        body = dict(model=model, max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
        body |= dict(return_tokens_as_token_ids=True, prompt=PROMPTS[:2])
        answer = server.post("/v1/completions", body).json()
    assert "choices" in answer, answer
    outputs = [
        [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        for choice in sorted(answer["choices"], key=lambda c: c["index"])
    ]
    check_parity(directory, PROMPTS[:2], outputs, "served")
