"""Gemma 3: a tiny random model (sliding and global layers, window 8) against transformers
through the whole engine, and the real Gemma 3 270M GGUF (`zllm serve gemma3`) against
transformers loading the same file."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from parity import (
    TeacherForced,
    assert_greedy_by_teacher_forcing,
    assert_greedy_parity,
    hf_greedy,
    hf_teacher_forced,
)
from servers import start_server, stop_server

from zllm import LLM, SamplingParams

WINDOW = 8
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> str:
    """Layers: sliding, global, sliding. Random norm weights and an embedding scaled down
    (Gemma multiplies it by sqrt(hidden)), so greedy outputs vary instead of repeating."""
    from tiny_models import randomize_norms_and_biases, tiny_gemma3_overrides, write_tiny_model

    path = tmp_path_factory.mktemp("tiny-gemma3")
    write_tiny_model(path, **tiny_gemma3_overrides(WINDOW))
    return str(randomize_norms_and_biases(path))


@pytest.fixture(scope="module")
def hf_tiny(tiny_gemma3):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_gemma3).eval()


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def check(hf_model, prompts, outputs, label):
    for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 3, f"{label}[{i}]: a degenerate output proves little: {ours}"
        theirs = hf_greedy(hf_model, p, len(ours))
        assert_greedy_parity(hf_model, p, ours, theirs, label=f"{label}[{i}]")


def make_llm(path: str, **kwargs) -> LLM:
    kwargs = {"block_size": BLOCK, "max_num_batched_tokens": 16, **kwargs}
    return LLM(path, kv_cache_memory_bytes=8 << 20, **kwargs)


def test_tiny_arch_and_groups(tiny_gemma3):
    llm = make_llm(tiny_gemma3)
    arch = llm.config.arch
    assert arch.architecture == "gemma3" and arch.qk_norm and arch.sliding_window == WINDOW
    fields = arch.family_fields
    assert fields.query_pre_attn_scalar == 16 and fields.rope_local_theta == 10000.0
    assert [g.sliding_window for g in llm.model_runner.kv_groups] == [None, WINDOW, WINDOW]


@pytest.mark.parametrize("hybrid", [True, False])
def test_tiny_greedy_parity_batch_and_chunks(tiny_gemma3, hf_tiny, hybrid):
    llm = make_llm(tiny_gemma3, hybrid_kv_cache=hybrid)
    prompts = prompts_of([3, 8, 20, 37, 61])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    check(hf_tiny, prompts, outputs, f"gemma3 hybrid={hybrid}")


def test_tiny_prefix_hit_and_preemption(tiny_gemma3, hf_tiny):
    llm = make_llm(tiny_gemma3, num_gpu_blocks_override=40)
    shared = prompts_of([36], seed=3)[0]
    prompts = [shared + [5, 6], shared + [7, 8, 9], *prompts_of([30, 44], seed=4)]
    llm.generate({"prompt_token_ids": shared + [1]}, GREEDY, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert outputs[0].num_cached_tokens == 36 and outputs[1].num_cached_tokens == 36
    assert llm.engine.scheduler.num_preemptions > 0
    check(hf_tiny, prompts, outputs, "gemma3 prefix+preempt")


@pytest.mark.e2e
def test_tiny_served_chat_and_stream(tiny_gemma3, engine_pool, tmp_path: Path):
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    offline = make_llm(tiny_gemma3).chat(messages, params, use_tqdm=False)[0]
    with engine_pool.serve(
        tiny_gemma3, tmp_path / "server.log", "--block-size", str(BLOCK)
    ) as server:
        from openai import OpenAI

        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        kwargs = dict(model=tiny_gemma3, messages=messages, temperature=0.0, max_tokens=12)
        extra = {"ignore_eos": True}
        answer = client.chat.completions.create(**kwargs, extra_body=extra)
        assert answer.choices[0].message.content == offline.outputs[0].text
        stream = client.chat.completions.create(**kwargs, extra_body=extra, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == offline.outputs[0].text


# ---- the real Gemma 3 270M (Q4_K_M GGUF, 253 MB) ----------------------------------------------

LONG = " ".join(
    f"Item {i}: the {('red', 'green', 'blue')[i % 3]} box holds {i * 7 % 13} marbles."
    for i in range(60)
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 5, 8, 13,",
    LONG + " Which box holds the most marbles? The",  # ~790 tokens: past the 512 window
    "Paged attention stores keys and values in fixed-size blocks. " * 45 + "In short,",
]


@pytest.fixture(scope="module")
def gemma3_llm(gemma3_path):
    """gguf-float: transformers' arithmetic on the file's weights (the default's own choice,
    integer dots for the K-quants, is tested against transformers below)."""
    return LLM(gemma3_path, quantization="gguf-float")


@pytest.fixture(scope="module")
def gemma3_hf_dir(gemma3_path, tmp_path_factory) -> Path:
    """transformers' fp32 Gemma 3 and tokenizer as read from the GGUF, saved once per machine
    (tests/hf_references.py): reading the file's 262k-entry vocabulary and dequantizing its
    weights in Python costs transformers ~18 s each time."""
    from hf_references import hf_copy_of_gguf

    return hf_copy_of_gguf(gemma3_path, tmp_path_factory.mktemp("gemma3-hf"))


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3_hf_dir, dtype=torch.float32).eval()


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(gemma3_path, gemma3_hf_dir):
    from transformers import AutoTokenizer

    from zllm.text.tokenizer import load_tokenizer

    theirs = AutoTokenizer.from_pretrained(gemma3_hf_dir)  # as transformers read the GGUF
    ours = load_tokenizer(gemma3_path)
    texts = [
        *PROMPTS[:4],
        " leading space",
        "two  spaces\nnewline\n\n\ttab",
        "café naïve 你好 🙂 𝔘 ⁂",
        "<start_of_turn>user\nHi<end_of_turn>\n",
    ]
    for text in texts:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


@pytest.mark.slow
def test_real_registry_entry(gemma3_llm):
    """The short name ships Gemma's chat template and stops on <end_of_turn> as well as <eos>."""
    tok = gemma3_llm.get_tokenizer()
    assert gemma3_llm.config.arch.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
    )
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def gemma3_forced(gemma3_hf, gemma3_llm) -> list[tuple[list[int], list[int], TeacherForced]]:
    """Each prompt's ids, the engine's greedy output under gguf-float (24 tokens), and
    transformers' teacher-forced reading of prompt + output (one forward each): the greedy
    test checks the output's positions, the default arithmetic's test the prompt's."""
    tok = gemma3_llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outputs = gemma3_llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    forced = []
    for p, out in zip(ids, outputs, strict=True):
        ours = list(out.outputs[0].token_ids)
        forced.append((p, ours, hf_teacher_forced(gemma3_hf, p + ours)))
    return forced


@pytest.mark.slow
def test_real_greedy_parity_with_transformers(gemma3_llm, gemma3_forced):
    """Six prompts, two longer than the 512-token window, 24 tokens each; both sides run the
    same dequantized weights, ours read from the file's Q5_0 / Q8_0 / Q4_K / Q6_K blocks by
    the CPU kernel. Checked by teacher forcing (tests/parity.py): every output token is
    transformers' argmax after the same prefix, or a near tie (reported)."""

    from zllm.executor.layers.linear.gguf import GGUFLinear, GGUFSplitLinear

    model = gemma3_llm.model_runner.model
    assert gemma3_llm.model_runner.quantization == "gguf-float"
    for layer in model.layers:  # q/k Q5_0 beside v Q8_0 (some layers): one call per type
        attn, mlp = layer.self_attn, layer.mlp
        matmuls = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        assert all(isinstance(m, GGUFLinear | GGUFSplitLinear) for m in matmuls)
    assert model.embed_rows is not None and model.logits_proj is not None

    assert sum(len(p) > 512 for p, _, _ in gemma3_forced) == 2
    for i, (p, ours, forced) in enumerate(gemma3_forced):
        assert len(ours) == GREEDY.max_tokens
        assert_greedy_by_teacher_forcing(forced, len(p), ours, label=f"gemma3-270m[{i}]")


@pytest.mark.slow
def test_real_default_arithmetic_agrees_with_transformers(gemma3_path, gemma3_forced):
    """The default (`gguf`): integer dots for the file's K-quant matmuls where this CPU runs
    them faster (executor/weights/gguf_arithmetic.py), llama.cpp's arithmetic. Scored by
    teacher forcing on the six prompts (two past the 512-token window), every position scored
    with the arithmetic decode gives it (the matmuls that take integer dots at one row take
    them at every size, as `zllm bench accuracy` scores): at each position the engine's top
    token against transformers' argmax on the same dequantized weights, and the drift of the
    log-probability of the prompt's next token. Measured on the dev VM: 1,408 of 1,418
    positions agree, mean drift 0.018 nats (max 0.75), the same with AVX-512 VNNI and AVX2
    (integer sums are exact); the bounds leave room."""
    from zllm.executor.kernels.gguf_arithmetic import ALL_ROWS
    from zllm.executor.weights.quantization import set_int8_max_rows

    llm = LLM(gemma3_path)
    assert llm.model_runner.quantization == "gguf"
    assert set_int8_max_rows(llm.model_runner.model, ALL_ROWS) > 0  # the K-quants' matmuls
    llm.model_runner.fused_decode = None  # (it copied the row limits at load)
    ids = [p for p, _, _ in gemma3_forced]
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], scored, use_tqdm=False)
    agree = positions = 0
    drifts = []
    for (p, _, theirs), out in zip(gemma3_forced, outputs, strict=True):
        for pos in range(1, len(p)):  # (theirs[pos - 1]: after p[:pos], p[pos] next)
            ours = out.prompt_logprobs[pos]
            top = next(t for t, lp in ours.items() if lp.rank == 1)
            agree += int(top == int(theirs.top5_ids[pos - 1, 0]))
            positions += 1
            drifts.append(abs(ours[p[pos]].logprob - float(theirs.next_logprob[pos - 1])))
    print(
        f"default arithmetic: argmax agreement {agree}/{positions}, mean drift "
        f"{sum(drifts) / len(drifts):.4f}, max {max(drifts):.4f} nats"
    )
    assert agree >= 0.97 * positions
    assert sum(drifts) / len(drifts) < 0.05


@pytest.mark.slow
def test_real_weights_take_the_file_size_in_memory(gemma3_path):
    """The executor grows by at most the file + the KV pool + 100 MiB at load: no fp32 copy
    of any matrix (the 262,144-row Q8_0 embedding alone would be 671 MB in fp32). At 8,192
    positions: the two RoPE tables (cos | sin, head_dim 256) take 32 MB each at the model's
    full 32K context, which leaves that run 3 MB under the bound (BENCHMARKS.md)."""
    from resident_memory import resident_after_load

    bound = os.path.getsize(gemma3_path) + (64 << 20) + (100 << 20)
    grown = resident_after_load(gemma3_path, "gguf", "--max-model-len", "8192")
    print(f"resident growth at load: {grown['after'] - grown['before']}, bound {bound}")
    assert grown["after"] - grown["before"] <= bound


@pytest.mark.slow
@pytest.mark.e2e
def test_real_zllm_serve_gemma3(gemma3_llm, tmp_path: Path):
    """`zllm serve gemma3`: chat and streamed chat give the offline engine's greedy text."""
    from openai import OpenAI

    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    offline = gemma3_llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False
    )[0].outputs[0]
    server = start_server("gemma3", tmp_path / "server.log")
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        answer = client.chat.completions.create(
            model="gemma3", messages=messages, temperature=0.0, max_tokens=16
        )
        assert answer.choices[0].message.content == offline.text
        assert answer.choices[0].finish_reason == offline.finish_reason
        stream = client.chat.completions.create(
            model="gemma3", messages=messages, temperature=0.0, max_tokens=16, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == offline.text
    finally:
        stop_server(server)
