"""Mamba-2 hybrids in the engine: Granite 4.0-H (Mamba-2 state layers beside attention, experts
beside a shared MLP) and Nemotron-H (Mamba-2, attention and MLP-only layers). The state slots
keep each sequence apart through batching, chunked prefill and preemption, forks and prefix
hits, on the CPU kernels and on the torch path alike; a Q8_0 file's blocks serve every
projection; what the families cannot run is refused naming it. Parity per family (HF
directory and GGUF file) is tests/executor/models/test_families.py's; the state bookkeeping,
shared with Gated DeltaNet, is tested at length in test_hybrid.py. This runs the tiny models
of the families' rows."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest
import torch
from family_cases import CASES
from llama_cpp_convert import SPM_VOCAB_SIZE, convert_many, rounded_as_stored
from parity import assert_greedy_parity, hf_greedy

from zllm import LLM, SamplingParams
from zllm.executor.layers.mamba2 import Mamba2Mixer

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# One token, a few, several blocks, and past the scan's 64-token chunks.
LENGTHS = [1, 6, 19, 70, 133]
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, SPM_VOCAB_SIZE) for _ in range(n)] for n in LENGTHS]


FAMILIES = ["granite_hybrid", "nemotron_h"]


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory) -> str:
    family = request.param
    return str(CASES[family].write(tmp_path_factory.mktemp("mamba2") / family))


@pytest.fixture(scope="module")
def alone(model_dir) -> list[list[int]]:
    """Each prompt's greedy answer, run by itself without prefix caching."""
    plain = LLM(model_dir, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
    return [batch(plain, [p])[0] for p in PROMPTS]


def batch(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_alone_it_answers_as_transformers(model_dir, alone) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for prompt, ours in zip(PROMPTS, alone, strict=True):
        assert_greedy_parity(hf, prompt, ours, hf_greedy(hf, prompt, len(ours)), label=str(len(prompt)))  # fmt: skip


def test_a_batch_with_chunks_and_preemption_answers_as_each_alone(model_dir, alone) -> None:
    """Five sequences' prefills and decodes side by side, 16 tokens a step (long prompts cut
    into chunks, the conv window and the scan's state carried across each cut), and a pool
    small enough to preempt (recomputed from position 0)."""
    tight = LLM(
        model_dir, num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=5
    )  # fmt: skip
    assert batch(tight, PROMPTS) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.state_slots.num_free == 5


def test_the_torch_path_answers_as_the_kernels(model_dir, alone, monkeypatch) -> None:
    """Without csrc/cpu/state_layers.cpp the conv and the scan run in torch: the same answers,
    in steps mixing chunks and decodes."""
    from zllm.executor.kernels import cpu_state_ops

    monkeypatch.setattr(cpu_state_ops, "usable", lambda x: False)
    engine = LLM(model_dir, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=16)
    assert batch(engine, PROMPTS) == alone


def test_prefix_hits_and_forks_reuse_the_state(model_dir, alone) -> None:
    """The prompts twice: the second time each hits its prefix up to its last full block
    before its last token, the state there restored from its snapshot; then n = 2 forks
    after a prompt, both samples continuing its state."""
    llm = LLM(model_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=8, block_size=4)
    bm = llm.engine.block_manager
    assert batch(llm, PROMPTS) == alone
    assert batch(llm, PROMPTS) == alone
    assert bm.prefix_cache_hits == sum((n - 1) // 4 * 4 for n in LENGTHS)
    two = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[3]}, two, use_tqdm=False)
    assert [list(c.token_ids) for c in out.outputs] == [alone[3], alone[3]]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_q8_0_file_reads_its_blocks_and_answers_as_its_rounded_checkpoint(
    family: str, tmp_path
) -> None:
    """llama.cpp's converter at Q8_0: the Mamba-2 layers' in_proj and out_proj, attention's
    and the MLPs' (Granite's experts too) read the file's blocks; under gguf-float greedy
    tokens equal transformers' on the checkpoint rounded as the file stores it."""
    import transformers

    from zllm.executor.layers.linear.gguf import GGUFLinear

    directory = CASES[family].write(tmp_path / family)
    (path,) = convert_many([(directory, tmp_path / f"{family}-q8_0.gguf", "q8_0")])
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, max_num_seqs=4, quantization="gguf-float")
    mixers = [m for m in llm.executor.runner.model.modules() if isinstance(m, Mamba2Mixer)]
    assert mixers and all(
        isinstance(m.in_proj, GGUFLinear) and isinstance(m.out_proj, GGUFLinear) for m in mixers
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(rounded_as_stored(name, param))
    for prompt in PROMPTS[1:4]:
        (ours,) = batch(llm, [prompt])
        assert_greedy_parity(hf, prompt, ours, hf_greedy(hf, prompt, len(ours)), label=family)


def rewritten(directory: str, tmp_path, **changes) -> str:
    """A copy of the model directory with config.json changed."""
    import shutil

    copy = tmp_path / "changed"
    shutil.copytree(directory, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **changes}))
    return str(copy)


def test_what_the_families_cannot_run_is_refused_naming_it(tmp_path) -> None:
    """Experts behind a latent projection (Nemotron 3 Super's), a clamped time step, an
    unknown layer kind, no attention layer at all, another Mamba activation: each a clear
    error at load, naming what."""
    directory = str(CASES["nemotron_h"].write(tmp_path / "nemotron_h"))
    cases = [
        ({"moe_latent_size": 16}, "latent projection (moe_latent_size"),
        ({"time_step_limit": [0.001, 0.1]}, "time_step_limit [0.001, 0.1]"),
        ({"hybrid_override_pattern": "M*-M-Q"}, "layer kinds Q"),
        ({"hybrid_override_pattern": "M-MEMM"}, "state layers alone (no attention layer)"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act 'gelu'"),
    ]
    for i, (changes, said) in enumerate(cases):
        with pytest.raises(ValueError, match=re.escape(said)):
            LLM(rewritten(directory, tmp_path / str(i), **changes))


@pytest.mark.e2e
def test_served_requests_answer_as_offline(engine_pool, tmp_path) -> None:
    """Granite 4.0-H through `zllm serve` (its multipliers cross to the executor's process in
    the engine's config): five concurrent completions equal the offline answers."""
    from openai import AsyncOpenAI

    directory = str(CASES["granite_hybrid"].write(tmp_path / "granite_hybrid"))
    offline = batch(LLM(directory, kv_cache_memory_bytes=16 << 20), PROMPTS)
    with engine_pool.serve(directory, tmp_path / "server.log") as server:

        async def ask_all():
            client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            model = (await client.models.list()).data[0].id
            extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
            asks = [
                client.completions.create(
                    model=model,
                    prompt=p,
                    max_tokens=10,
                    temperature=0.0,
                    logprobs=0,
                    extra_body=extra,
                )  # fmt: skip
                for p in PROMPTS
            ]
            return await asyncio.gather(*asks)

        answers = asyncio.run(ask_all())
        served = [
            [int(t.removeprefix("token_id:")) for t in a.choices[0].logprobs.tokens]
            for a in answers
        ]
        assert served == offline
        assert "state: " in server.log_text()
