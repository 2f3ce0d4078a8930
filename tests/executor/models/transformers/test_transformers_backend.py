"""The transformers backend: architectures zllm has no code for, run by transformers' own
modeling code under zllm's scheduler and paged KV cache (--model-impl transformers / auto).

  gpt_neox     multi-head attention, partial rotary (25% of each head), parallel residual
  olmo         OLMo 1: LayerNorms without weights, q/k/v clipped
  phi          Phi-2: LayerNorm, partial rotary, biases, dense output projection
  starcoder2   a 16-token window on every layer, prompts far longer than it
  gpt2         learned absolute positions, fused c_attn (no rotary)
  granite      logits divided by logits_scaling, scaled embeddings and residuals
  olmoe        mixture of experts: 4 experts, 2 per token
  mixtral      mixture of experts: 4 local experts, 2 per token
  qwen3_moe    mixture of experts with q/k norms
  qwen2_moe    mixture of experts beside a gated shared expert, q/k/v biases

Each is a tiny random model from transformers' config class; zllm's greedy tokens must equal
transformers' `generate`, token for token (tests/parity.py), through the offline API, with 32
requests at once, chunked prefill, a prefix-cache hit and preemption, and through `zllm serve` (five of them).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFWriter
from parity import assert_greedy_parity, hf_greedy, hf_logprobs_at
from tiny_models import write_tiny_model

from zllm import LLM, SamplingParams
from zllm.model.arch import read_model_arch
from zllm.model.impl import choose_model_impl

WINDOW = 16
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

# write_tiny_model overrides per architecture: TINY_CONFIG's grouped-query num_key_value_heads
# is dropped (None) for the families whose configs have no such field.
CASES: dict[str, dict[str, Any]] = {
    "gpt_neox": dict(num_key_value_heads=None, tie_word_embeddings=False),
    "olmo": dict(clip_qkv=8.0),
    "phi": dict(),
    "starcoder2": dict(sliding_window=WINDOW),
    "gpt2": dict(num_key_value_heads=None),
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, head_dim=16, moe_intermediate_size=64),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
}
MOE = "olmoe"  # the cases the engine-composition tests run: one mixture of experts,
DENSE = "starcoder2"  # one dense model with a sliding window


@dataclass(frozen=True)
class Model:
    path: str
    hf: Any  # the transformers model zllm must agree with


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Callable[[str], Model]:
    built: dict[str, Model] = {}

    def get(case: str) -> Model:
        if case not in built:
            import transformers

            path = write_tiny_model(tmp_path_factory.mktemp(case), arch=case, **CASES[case])
            hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            built[case] = Model(str(path), hf)
        return built[case]

    return get


def make_llm(model: Model, **kwargs) -> LLM:
    kwargs = {"block_size": BLOCK, "kv_cache_memory_bytes": 8 << 20, **kwargs}
    return LLM(model.path, **kwargs)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def check(model: Model, prompts: list[list[int]], outputs, label: str) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ours = out.outputs[0].token_ids
        theirs = hf_greedy(model.hf, prompt, len(ours))
        assert_greedy_parity(model.hf, prompt, ours, theirs, label=f"{label}[{i}]")


# ---------------------------------------------------------------------------------------------
# Which code serves a model


def test_auto_picks_native_code_when_zllm_has_it(tmp_path: Path) -> None:
    llama = write_tiny_model(tmp_path / "llama")
    assert choose_model_impl(str(llama)).name == "zllm"
    assert choose_model_impl(str(llama), "transformers").name == "transformers"
    neox = write_tiny_model(tmp_path / "neox", arch="gpt_neox", num_key_value_heads=None)
    impl = choose_model_impl(str(neox))
    assert (impl.name, impl.architecture) == ("transformers", "gpt_neox")
    assert "no native code for 'gpt_neox'" in impl.reason
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'.*--model-impl"):
        LLM(str(neox), model_impl="zllm")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        LLM(str(neox), model_impl="vllm")


def test_without_transformers_installed_the_fallback_says_what_to_install(
    tmp_path: Path, monkeypatch
) -> None:
    import importlib.util

    neox = write_tiny_model(tmp_path / "neox", arch="gpt_neox", num_key_value_heads=None)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else find_spec(name, *a),
    )
    with pytest.raises(ValueError, match=r"no native code for 'gpt_neox'.*zllm\[transformers\]"):
        choose_model_impl(str(neox))
    assert choose_model_impl(str(write_tiny_model(tmp_path / "llama"))).name == "zllm"


def test_kv_layout_is_read_from_config_json(models) -> None:
    """What the core sizes the cache from, without importing transformers' modeling code."""
    neox = read_model_arch(models("gpt_neox").path, choose_model_impl(models("gpt_neox").path))
    assert (neox.num_layers, neox.num_heads, neox.num_kv_heads, neox.head_dim) == (2, 4, 4, 16)
    star = read_model_arch(models("starcoder2").path, choose_model_impl(models("starcoder2").path))
    assert (star.num_kv_heads, star.sliding_window) == (2, WINDOW)
    assert star.layer_types == ["sliding_attention"] * 2
    gpt2 = read_model_arch(models("gpt2").path, choose_model_impl(models("gpt2").path))
    assert (gpt2.num_layers, gpt2.num_kv_heads, gpt2.max_position_embeddings) == (2, 4, 512)


def test_model_impl_reading_imports_no_torch() -> None:
    code = "import sys, zllm.model.impl; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split() == ["False"], result.stderr


def test_gguf_of_an_architecture_without_native_code_reads_generically(tmp_path: Path) -> None:
    path = tmp_path / "stablelm.gguf"
    writer = GGUFWriter(str(path), "stablelm")
    writer.add_block_count(3)
    writer.add_context_length(256)
    writer.add_embedding_length(96)
    writer.add_head_count(6)
    writer.add_head_count_kv(2)
    writer.add_token_list([b"a", b"b", b"c"])
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    impl = choose_model_impl(str(path))
    assert (impl.name, impl.architecture) == ("transformers", "stablelm")
    arch = read_model_arch(str(path), impl)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (3, 6, 2, 16)
    assert (arch.vocab_size, arch.eos_token_ids, arch.layer_types) == (3, [2], None)


# ---------------------------------------------------------------------------------------------
# Refused, with the architecture and the reason


def write_config(path: Path, **cfg) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (dict(model_type="t5", is_encoder_decoder=True), "t5 is an encoder-decoder model"),
        (dict(model_type="mamba", state_size=16), "mamba has state-space or recurrent layers"),
        (
            # (Qwen3-Next's layers, under a name no family of zllm's claims)
            dict(model_type="kimi_linear", layer_types=["linear_attention", "full_attention"]),
            r"kimi_linear has state-space or recurrent layers \(linear_attention\)",
        ),
        (
            dict(model_type="llava_next", text_config={}),
            "llava_next is a multimodal checkpoint; .* and llava through transformers",
        ),
    ],
)
def test_unservable_configs_are_refused_before_loading(tmp_path: Path, cfg, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(write_config(tmp_path, **cfg))


def test_gemma4s_layers_of_other_shapes_are_refused_in_both_forms(tmp_path: Path) -> None:
    """Gemma 4's text model (transformers' config class: wider heads on its global layers,
    per-layer inputs) and llama.cpp's GGUF of it: refused naming what the paged cache cannot
    hold, before transformers' loader (which raised from deep inside) runs."""
    from family_cases import convertible
    from llama_cpp_convert import convert_hf_to_gguf

    directory = convertible("gemma4_text", pad_token_id=None, head_dim=16, global_head_dim=32,
                            vocab_size_per_layer_input=400, hidden_size_per_layer_input=16)(
        tmp_path / "gemma4"
    )  # fmt: skip
    gguf = convert_hf_to_gguf(directory, tmp_path / "gemma4.gguf", "f32")
    for path, message in (
        (directory, r"gemma4_text has layers of different shapes \(head sizes 16, 32; per-layer"),
        (gguf, r"gemma4 has layers of different shapes \(attention.key_length 16 beside 32"),
    ):
        with pytest.raises(ValueError, match=message):
            LLM(str(path), kv_cache_memory_bytes=8 << 20)


def test_models_without_attention_backend_support_are_refused(tmp_path: Path) -> None:
    """transformers' Falcon and StableLM classes attend in their own code, past the registry."""
    path = write_tiny_model(tmp_path / "falcon", arch="falcon", num_key_value_heads=None)
    with pytest.raises(ValueError, match="falcon: transformers' FalconForCausalLM does not route"):
        LLM(str(path), kv_cache_memory_bytes=8 << 20)


def test_a_layout_the_model_does_not_have_is_refused_at_load(tmp_path: Path) -> None:
    """config.json says 2 KV heads, but GPT-NeoX has none of its own: its layers use 4."""
    path = write_tiny_model(tmp_path / "neox", arch="gpt_neox", num_key_value_heads=2)
    with pytest.raises(ValueError, match="layer 0: 4 KV heads of size 16, but config.json"):
        LLM(str(path), kv_cache_memory_bytes=8 << 20)


_LOAD_AND_MEASURE = """
import sys, torch
import transformers.models.gpt_neox.modeling_gpt_neox  # imported before the baseline
from zllm.executor.attention.backend import TORCH_ATTENTION
from zllm.executor.models.transformers.backend import TransformersForCausalLM
from zllm.model.arch import read_model_arch
from zllm.model.impl import choose_model_impl

def peak_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024

path = sys.argv[1]
arch = read_model_arch(path, choose_model_impl(path))
before = peak_mib()
model = TransformersForCausalLM.load(path, arch, torch.float32, torch.device("cpu"), TORCH_ATTENTION)
params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(params, peak_mib() - before)
"""


def test_safetensors_weights_are_loaded_once(tmp_path: Path) -> None:
    """Built on the meta device, each tensor read straight into place: the peak memory grows
    by the weights once (a randomly initialised model filled by copy would need two)."""
    path = write_tiny_model(
        tmp_path / "wide",
        arch="gpt_neox",
        num_key_value_heads=None,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=6,
        num_attention_heads=12,
    )
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_MEASURE, str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    params_mib, growth_mib = map(float, result.stdout.split())
    assert params_mib > 150
    assert growth_mib < 1.25 * params_mib, (params_mib, growth_mib)


# ---------------------------------------------------------------------------------------------
# Greedy parity with transformers


@pytest.mark.parametrize("case", CASES)
def test_greedy_parity(models, case) -> None:
    """A batch of lengths around and past the window, through transformers' code (which
    `auto` picks for all but Mixtral and the Qwen MoEs: zllm runs those, tests/test_moe.py)."""
    model = models(case)
    llm = make_llm(model, model_impl="transformers")
    assert llm.config.model_impl == "transformers"
    native = ("mixtral", "qwen2_moe", "qwen3_moe")
    assert choose_model_impl(model.path).name == ("zllm" if case in native else "transformers")
    prompts = prompts_of([3, 9, 17, 40, 64], seed=1)
    check(model, prompts, generate(llm, prompts), f"{case} batch")


@pytest.mark.parametrize("case", ["granite", "gpt2", MOE])
def test_logprobs_match_transformers(models, case) -> None:
    """Greedy tokens cannot see a logits scale (Granite divides by logits_scaling); the
    log-probabilities of each sampled token can."""
    model = models(case)
    prompt = prompts_of([21], seed=7)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    out = generate(make_llm(model), [prompt], params)[0].outputs[0]
    for j, (token, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        theirs = hf_logprobs_at(model.hf, prompt + out.token_ids[:j])
        assert position[token].logprob == pytest.approx(theirs[token].item(), abs=1e-4), j


@pytest.mark.parametrize("case", [MOE, DENSE])
def test_32_concurrent_requests_equal_their_solo_outputs(models, case) -> None:
    model = models(case)
    prompts = prompts_of([random.Random(i).randrange(2, 60) for i in range(32)], seed=2)
    llm = make_llm(model)
    together = generate(llm, prompts)
    for i in (0, 7, 19, 31):
        solo = generate(llm, [prompts[i]])[0]
        assert together[i].outputs[0].token_ids == solo.outputs[0].token_ids, i
    check(model, prompts[:4], together[:4], f"{case} concurrent")


@pytest.mark.parametrize("case", [MOE, DENSE])
def test_chunked_prefill(models, case) -> None:
    model = models(case)
    prompts = prompts_of([40, 55, 23], seed=3)
    llm = make_llm(model, max_num_batched_tokens=16, enable_prefix_caching=False)
    check(model, prompts, generate(llm, prompts), f"{case} chunked")


@pytest.mark.parametrize("case", [MOE, DENSE])
def test_prefix_cache_hit(models, case) -> None:
    model = models(case)
    llm = make_llm(model)
    shared = prompts_of([40], seed=4)[0]
    first = generate(llm, [shared + [5]])[0]
    assert first.num_cached_tokens == 0
    prompt = shared + [7, 9, 11]
    second = generate(llm, [prompt])[0]
    assert second.num_cached_tokens == 40  # 10 full blocks of 4
    check(model, [prompt], [second], f"{case} prefix")


@pytest.mark.parametrize("case", [MOE, DENSE])
def test_preemption_recomputes(models, case) -> None:
    model = models(case)
    llm = make_llm(model, num_gpu_blocks_override=24, max_num_batched_tokens=16)
    prompts = prompts_of([40, 50, 30, 60, 45, 20, 55, 35], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    check(model, prompts, outputs, f"{case} preempted")
    assert llm.engine.block_manager.num_referenced_blocks() == 0


# ---------------------------------------------------------------------------------------------
# Served


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["gpt_neox", "olmo", "phi", "starcoder2", MOE])
def test_served(models, case, engine_pool, tmp_path: Path) -> None:
    """`zllm serve` on a model only transformers' code runs: its greedy completions are the
    offline engine's text, whose tokens are transformers'; the log says which code serves it."""
    model = models(case)
    prompts = prompts_of([12, 33], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    offline = generate(make_llm(model), prompts, params)
    check(model, prompts, offline, f"{case} offline")
    log_path = tmp_path / "server.log"
    with engine_pool.serve(model.path, log_path, "--block-size", str(BLOCK)) as server:
        for prompt, expected in zip(prompts, offline, strict=True):
            body = {"prompt": prompt, "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
            response = server.post("/v1/completions", body)
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["usage"]["completion_tokens"] == 12
            assert answer["choices"][0]["text"] == expected.outputs[0].text
        log = server.log_text()
    assert f"no native code for '{case}'" in log
    assert "Model code: transformers'" in log
