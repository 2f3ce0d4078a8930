"""Llama 4's text model in zllm's own code (executor/models/llama4.py): its NoPE layers' query
temperature and the rotating layers' head norm switched as config.json says, the context capped
at one attention chunk (chunked attention is not implemented) and the multimodal checkpoint
refused naming it, and served. Parity of the registry row's model (HF directory and GGUF, the
default temperature floor and chunk) is tests/executor/models/test_families.py's `llama4`."""

from __future__ import annotations

import json
import random

import pytest
from family_cases import CASES, LLAMA4, convertible
from llama_cpp_convert import SPM_VOCAB_SIZE
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


def test_the_context_stops_at_one_attention_chunk(tmp_path) -> None:
    directory = convertible("llama4_text", **LLAMA4, attention_chunk_size=64)(tmp_path / "c")
    arch = read_arch_config(str(directory))
    assert arch.max_position_embeddings == 64 and arch.nope_layers == (3,)
    with pytest.raises(ValueError, match=r"\[2, 64\] \(Llama 4's chunked attention is not"):
        EngineArgs(model=str(directory), max_model_len=100).create_engine_config()
    assert EngineArgs(model=str(directory)).create_engine_config().scheduler.max_model_len == 64


def test_the_multimodal_checkpoint_is_refused_naming_it(tmp_path) -> None:
    directory = tmp_path / "mm"
    directory.mkdir()
    config = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
              "text_config": {"model_type": "llama4_text"}, "vision_config": {}}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Llama 4's multimodal checkpoint"):
        read_arch_config(str(directory))


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
