"""Llama-family architectures beyond Llama, Mistral and Qwen2, end to end against transformers.

  qwen3           q/k RMSNorms before RoPE, head_dim 32 beside hidden 64 / 4 heads
  phi3-longrope   fused qkv_proj / gate_up_proj tensors, LongRoPE's long factors, RoPE over
                  half of each head (partial_rotary_factor 0.5)
  phi3-window     LongRoPE's short factors and a 16-token window on every layer (Phi-3-*-4k)
  mistral-window  a 16-token window on every layer, prompts far longer than it
  llama3-gguf     a Llama 3.1-style GGUF: RoPE scaling stored as rope_freqs.weight

Each runs through zllm.LLM with 4-token blocks: one prompt, a batch, chunked prefill, a
prefix-cache hit and preemption, greedy token for token against transformers (tests/parity.py);
then one chat completion through a real `zllm serve`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_files import LLAMA3_ROPE, llama3_rope_factors, write_llama3_gguf
from parity import assert_greedy_parity, hf_greedy
from tiny_models import arch_config_of, tiny_hf_config, write_tiny_model

from zllm import LLM, SamplingParams
from zllm.executor.layers.rope import rope_inv_freq
from zllm.model.arch import read_arch_config
from zllm.model.arch_config import ModelArchConfig

WINDOW = 16
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

# Phi-3's LongRoPE over rotary_dim / 2 frequencies: factors far apart, so using the wrong set
# (or none) changes the outputs.
SHORT_FACTORS = [1.0, 1.3, 1.9, 2.5]
LONG_FACTORS = [1.0, 2.0, 5.0, 11.0]
LONGROPE = dict(rope_type="longrope", short_factor=SHORT_FACTORS, long_factor=LONG_FACTORS)
SHORT_CONTEXT = 8  # original_max_position_embeddings of phi3-longrope; every prompt is longer

# write_tiny_model overrides per model directory (the GGUF is written from an HF model).
MODEL_DIRS: dict[str, dict[str, Any]] = {
    "qwen3": dict(arch="qwen3", head_dim=32),
    "phi3-longrope": dict(
        arch="phi3",
        original_max_position_embeddings=SHORT_CONTEXT,
        partial_rotary_factor=0.5,
        rope_parameters=dict(LONGROPE),
    ),
    "phi3-window": dict(
        arch="phi3",
        original_max_position_embeddings=512,
        partial_rotary_factor=0.5,
        rope_parameters=dict(LONGROPE),
        sliding_window=WINDOW,
    ),
    "mistral-window": dict(arch="mistral", sliding_window=WINDOW),
}
CASES = [*MODEL_DIRS, "llama3-gguf"]


@dataclass(frozen=True)
class Model:
    path: str  # what zllm loads: a model directory or a .gguf file
    hf: Any  # the transformers model it must agree with


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Callable[[str], Model]:
    """Every case's model, built on first use."""
    built: dict[str, Model] = {}

    def get(case: str) -> Model:
        if case not in built:
            directory = tmp_path_factory.mktemp(case)
            if case == "llama3-gguf":
                path = directory / "tiny-llama3.gguf"
                built[case] = Model(str(path), write_llama3_gguf(path))
            else:
                built[case] = load_model_dir(write_tiny_model(directory, **MODEL_DIRS[case]))
        return built[case]

    return get


def load_model_dir(path: Path) -> Model:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return Model(str(path), hf)


def make_llm(model: Model, **kwargs) -> LLM:
    kwargs = {"block_size": BLOCK, "kv_cache_memory_bytes": 8 << 20, **kwargs}
    return LLM(model.path, **kwargs)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def check(model: Model, prompts: list[list[int]], outputs, label: str) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ours = out.outputs[0].token_ids
        theirs = hf_greedy(model.hf, prompt, len(ours))
        assert_greedy_parity(model.hf, prompt, ours, theirs, label=f"{label}[{i}]")


# ---------------------------------------------------------------------------------------------
# What zllm reads from each model


def test_each_model_reads_as_transformers_runs_it(models) -> None:
    qwen3 = read_arch_config(models("qwen3").path)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.attention_bias) == (True, 32, False)
    assert qwen3.layer_types is None
    mistral = read_arch_config(models("mistral-window").path)
    assert mistral.layer_types == ["sliding_attention"] * 2 and mistral.sliding_window == WINDOW
    phi3 = read_arch_config(models("phi3-window").path)
    assert phi3.layer_types == ["sliding_attention"] * 2 and phi3.sliding_window == WINDOW
    assert phi3.rope_scaling["partial_rotary_factor"] == 0.5
    gguf = read_arch_config(models("llama3-gguf").path)
    assert gguf.rope_freq_factors == llama3_rope_factors(16, 10000.0, LLAMA3_ROPE).tolist()


def test_gguf_rope_freqs_give_transformers_llama3_frequencies(models) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = models("llama3-gguf")
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](model.hf.config, "cpu")
    ours, scale = rope_inv_freq(read_arch_config(model.path))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert scale == 1.0
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert (ours != plain).sum() == 7  # the test would notice factors left unapplied


@pytest.mark.parametrize("original", [SHORT_CONTEXT, 512])
def test_longrope_frequencies_are_transformers_for_the_longest_context(original) -> None:
    """Long factors when max_position_embeddings (512) exceeds the original context, else the
    short ones: transformers' choice for a sequence of max_position_embeddings tokens."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_hf_config(
        "phi3",
        original_max_position_embeddings=original,
        partial_rotary_factor=0.5,
        rope_parameters=dict(LONGROPE),
    )
    theirs, their_scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=512)
    ours, scale = rope_inv_freq(arch_config_of(config))
    assert torch.equal(ours, theirs)
    assert scale == pytest.approx(their_scale, rel=1e-12)
    assert (scale > 1) == (original < 512)


def hf_dir_arch(arch: str, **fields) -> ModelArchConfig:
    return arch_config_of(tiny_hf_config(arch, num_hidden_layers=4, **fields))


def test_sliding_windows_follow_transformers() -> None:
    # Qwen2/Qwen3: only with use_sliding_window, from max_window_layers on.
    for arch in ("qwen2", "qwen3"):
        off = hf_dir_arch(arch, sliding_window=WINDOW, max_window_layers=1)
        assert (off.layer_types, off.sliding_window) == (None, None)
        on = hf_dir_arch(arch, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        assert on.layer_types == ["full_attention"] + ["sliding_attention"] * 3
        assert on.sliding_window == WINDOW
    # A window no shorter than the context (Mistral's default 4096, Phi-3.5's 262144) never
    # drops a key: full attention.
    assert hf_dir_arch("mistral").layer_types is None
    assert hf_dir_arch("phi3", sliding_window=512).layer_types is None
    assert hf_dir_arch("llama").layer_types is None


def test_old_phi3_rope_spellings_and_partial_rotary_elsewhere(tmp_path: Path) -> None:
    """Phi-3's early "su" is LongRoPE, with the top-level original context; a partial rotary
    factor outside Phi-3 is refused (transformers rotates whole heads there)."""
    config = tiny_hf_config("phi3", original_max_position_embeddings=64).to_dict()
    config.pop("rope_parameters")
    config["rope_scaling"] = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_arch_config(str(tmp_path)).rope_scaling == {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64,
    }
    llama = tiny_hf_config("llama").to_dict() | {"partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(
        ValueError, match="partial_rotary_factor=0.5: transformers rotates whole heads"
    ):
        read_arch_config(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Generating: the same greedy tokens as transformers


@pytest.mark.parametrize("case", CASES)
def test_one_prompt(models, case) -> None:
    model = models(case)
    prompt = prompts_of([40], seed=1)
    outputs = make_llm(model).generate({"prompt_token_ids": prompt[0]}, GREEDY, use_tqdm=False)
    check(model, prompt, outputs, f"{case} one")


@pytest.mark.parametrize("case", CASES)
def test_batch_of_mixed_lengths(models, case) -> None:
    """Lengths around the window (16) and past phi3-longrope's original context (8)."""
    model = models(case)
    prompts = prompts_of([9, 15, 17, 33, 64, 12], seed=2)
    llm = make_llm(model)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    check(model, prompts, outputs, f"{case} batch")


@pytest.mark.parametrize("case", CASES)
def test_chunked_prefill(models, case) -> None:
    model = models(case)
    prompts = prompts_of([40, 55, 23], seed=3)
    llm = make_llm(model, max_num_batched_tokens=16, enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    check(model, prompts, outputs, f"{case} chunked")


@pytest.mark.parametrize("case", CASES)
def test_prefix_cache_hit(models, case) -> None:
    model = models(case)
    llm = make_llm(model)
    shared = prompts_of([40], seed=4)[0]
    first = llm.generate({"prompt_token_ids": shared + [5]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    prompt = shared + [7, 9, 11]
    second = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 40  # 10 full blocks of 4
    check(model, [prompt], [second], f"{case} prefix")


@pytest.mark.parametrize("case", CASES)
def test_preemption(models, case) -> None:
    """24 blocks of 4 tokens for 8 requests growing to ~90 tokens: requests are preempted
    (all-sliding models too, whose requests hold about a window each) and recomputed."""
    model = models(case)
    llm = make_llm(model, num_gpu_blocks_override=24, max_num_batched_tokens=16)
    prompts = prompts_of([40, 50, 30, 60, 45, 20, 55, 35], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    check(model, prompts, outputs, f"{case} preempted")
    assert llm.engine.block_manager.num_referenced_blocks() == 0


# ---------------------------------------------------------------------------------------------
# Served


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES)
def test_served_chat_completion(models, case, engine_pool, tmp_path: Path) -> None:
    """One greedy chat completion from `zllm serve`: the offline engine's text, whose tokens
    are transformers' greedy ones."""
    model = models(case)
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    offline = make_llm(model).chat(messages, params, use_tqdm=False)[0]
    check(model, [offline.prompt_token_ids], [offline], f"{case} chat")
    with engine_pool.serve(
        model.path, tmp_path / "server.log", "--block-size", str(BLOCK)
    ) as server:
        body = {"messages": messages, "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
        response = server.post("/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["usage"]["completion_tokens"] == 12
        assert answer["choices"][0]["message"]["content"] == offline.outputs[0].text
