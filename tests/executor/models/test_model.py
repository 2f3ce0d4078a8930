"""LlamaForCausalLM against Hugging Face transformers on tiny random models (CPU, fp32)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from model_cases import BASE, LINEAR_ROPE, LLAMA3_ROPE, MODELS, PROMPTS, YARN_ROPE
from paged_runner import PagedRunner, Sequence
from tiny_models import arch_config_of, tiny_hf_config, tiny_hf_model

from zllm.executor.layers.rope import rope_inv_freq
from zllm.executor.models import model_class_of
from zllm.executor.models.llama import LlamaForCausalLM


def build_hf(name: str, seed: int = 0):
    architecture, overrides = MODELS[name]
    config = tiny_hf_config(architecture, **{**BASE, **overrides})
    model = tiny_hf_model(config, seed).eval()
    # A wide init (std 0.15, not HF's 0.02) so logits are far from tied and greedy is stable;
    # norms and biases are randomised too, so loading them into the wrong place would show.
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return config, model


def build_pair(name: str, seed: int = 0):
    config, hf = build_hf(name, seed)
    arch = arch_config_of(config)
    ours = model_class_of(arch)(arch).eval()
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    # Observed: ~7e-7 of the logit scale (fp32 reordering in fused GEMMs and SDPA).
    torch.testing.assert_close(ours, ref, atol=2e-5 * scale, rtol=0)


def assert_not_near_tied(logits: torch.Tensor) -> None:
    """The test's premise: greedy choices are separated by far more than fp32 noise (~1e-6 of
    the logit scale), so exact token parity is a fair demand. Observed minimum: ~1.2e-4."""
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).min().item()
    assert gap > 5e-5 * logits.abs().max().item(), f"top-1/top-2 logit gap only {gap}"


@pytest.mark.parametrize("name", list(MODELS))
def test_flat_prefill_matches_hf(name):
    hf, ours = build_pair(name)
    runner = PagedRunner(ours)
    seqs = [Sequence(list(p)) for p in PROMPTS]
    logits = runner.step([(s, len(s.tokens)) for s in seqs])
    start = 0
    for prompt in PROMPTS:
        ref = hf_logits(hf, prompt)
        assert_logits_close(logits[start : start + len(prompt)], ref)
        start += len(prompt)
    assert start == logits.shape[0]


@pytest.mark.parametrize("name", ["llama", "llama-tied", "llama3-rope", "qwen2", "qwen2-tied"])
def test_chunked_prefill_then_decode_matches_hf_generate(name):
    hf, ours = build_pair(name)
    num_new = 12
    refs = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        refs.append(out.sequences[0].tolist())
        assert_not_near_tied(torch.stack(out.logits))

    runner = PagedRunner(ours)
    a, b, c, d = (Sequence(list(p)) for p in PROMPTS)
    # Sequences join at different steps so prefill chunks, whole prompts and decodes share steps.
    runner.step_and_sample([(a, 6), (b, 2)])  # first chunks of a and b
    runner.step_and_sample([(a, 7), (b, 1), (c, 1)])  # a and b finish their prompts, c whole
    runner.step_and_sample([(a, 1), (b, 1), (c, 1), (d, 9)])  # decodes beside d's first chunk
    runner.step_and_sample([(d, 5), (a, 1), (c, 1), (b, 1)])  # a chunk in front of decodes
    runner.step_and_sample([(a, 1), (b, 1), (c, 1), (d, 7)])
    while any(len(s.tokens) < len(p) + num_new for s, p in zip((a, b, c, d), PROMPTS, strict=True)):
        live = [
            s
            for s, p in zip((a, b, c, d), PROMPTS, strict=True)
            if len(s.tokens) < len(p) + num_new
        ]
        runner.step_and_sample([(s, 1) for s in live])  # all-decode steps
    assert [a.tokens, b.tokens, c.tokens, d.tokens] == refs


def test_decode_logits_match_hf_at_every_step():
    hf, ours = build_pair("llama3-rope")
    runner = PagedRunner(ours, block_size=1, num_blocks=128)
    seqs = [Sequence(list(p)) for p in PROMPTS]
    runner.step_and_sample([(s, len(s.tokens)) for s in seqs])
    for _ in range(5):
        logits = runner.step([(s, 1) for s in seqs])
        for seq, row in zip(seqs, logits, strict=True):
            assert_logits_close(row, hf_logits(hf, seq.tokens)[-1])
            seq.tokens.append(int(row.argmax()))


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, LINEAR_ROPE, YARN_ROPE])
def test_rope_inv_freq_matches_hf(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_hf_config("llama", **BASE, rope_parameters=dict(rope))
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    freq, scale = rope_inv_freq(arch_config_of(config))
    assert torch.equal(freq, ref_freq)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_unsupported_rope_type_is_rejected():
    arch = arch_config_of(tiny_hf_config("llama", **BASE))
    arch.rope_scaling = {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="dynamic"):
        LlamaForCausalLM(arch)


def test_fused_weights_are_loaded_in_order():
    hf, ours = build_pair("qwen2")
    sd = hf.state_dict()
    attn, mlp = ours.layers[1].self_attn, ours.layers[1].mlp
    qkv = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, qkv)
    bias = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.bias, bias)
    gate_up = torch.cat([sd[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, gate_up)


def test_load_weights_rejects_bad_checkpoints():
    config, hf = build_hf("llama")
    arch = arch_config_of(config)
    sd = hf.state_dict()
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="missing 1 weights: model.layers.1.mlp.up_proj.weight"):
        LlamaForCausalLM(arch).load_weights(missing.items())
    bad_shape = {**sd, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}
    with pytest.raises(ValueError, match="k_proj.weight.*shape"):
        LlamaForCausalLM(arch).load_weights(bad_shape.items())
    extra = {**sd, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="unexpected weight"):
        LlamaForCausalLM(arch).load_weights(extra.items())


def test_tied_embeddings_serve_as_lm_head():
    hf, ours = build_pair("llama-tied")  # HF's state_dict lists lm_head.weight even when tied
    assert "lm_head.weight" in hf.state_dict() and ours.lm_head is None
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(ours.compute_logits(hidden), hidden @ ours.embed_tokens.T)


def test_registry():
    """A record's class is its family's: Llama's code serves the Llama, Mistral and Qwen2
    families; a family name the registry lacks is refused, naming it."""
    for family in ("llama", "qwen2", "phi3"):
        arch = dataclasses.replace(arch_config_of(tiny_hf_config("llama")), family=family)
        assert model_class_of(arch) is LlamaForCausalLM
    with pytest.raises(ValueError, match="no model family 'gpt2'"):
        model_class_of(dataclasses.replace(arch_config_of(tiny_hf_config("llama")), family="gpt2"))


def test_logits_are_float32_for_bfloat16_models():
    config, hf = build_hf("llama")
    ours = LlamaForCausalLM(arch_config_of(config), dtype=torch.bfloat16)
    ours.load_weights(hf.state_dict().items())
    assert ours.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    runner = PagedRunner(ours)
    runner.kv_caches = [c.bfloat16() for c in runner.kv_caches]
    seq = Sequence(list(PROMPTS[0]))
    logits = runner.step([(seq, len(seq.tokens))])
    assert logits.dtype == torch.float32
    ref = hf_logits(hf, PROMPTS[0])
    cos = torch.nn.functional.cosine_similarity(logits, ref, dim=-1)
    assert cos.min() > 0.99, math.acos(min(cos.min().item(), 1.0))


@pytest.mark.parametrize("row_ops", [False, True], ids=["torch", "cpu-row-ops"])
def test_rms_norm_matches_hf_formula(monkeypatch, row_ops):
    """torch's fused rms_norm is bit-identical to HF's lines; the CPU row op
    (csrc/cpu/row_ops.h, which the module uses on CPU fp32) sums in its own order, so it
    agrees to rounding. The residual stream is exact either way."""
    from zllm.executor.kernels import cpu_layer_ops
    from zllm.executor.layers.norms import RMSNorm

    if not row_ops:
        monkeypatch.setattr(cpu_layer_ops, "usable", lambda x: False)
    elif not cpu_layer_ops.usable(torch.zeros(1)):
        pytest.skip("CPU kernels unavailable")
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5, torch.float32)
    norm.weight.data = torch.randn(96)
    for rows in (1, 7, 64):
        x, residual = torch.randn(rows, 96) * 3, torch.randn(rows, 96)
        out, stream = norm(x, residual)
        h = x + residual
        ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(stream, h)
        if row_ops:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(out, ref)


def test_rope_table_stops_at_max_model_len(tiny_llama_dir):
    """The executor keeps cos/sin for the positions a request can reach (max_model_len), not
    the model's whole context; outputs are those of the full table (same rows)."""
    from zllm import LLM, SamplingParams

    short = LLM(tiny_llama_dir, max_model_len=96, kv_cache_memory_bytes=8 << 20)
    full = LLM(tiny_llama_dir, kv_cache_memory_bytes=8 << 20)
    table = short.model_runner.model.rotary.cos_sin_cache
    assert table.shape[0] == 96
    assert (
        full.model_runner.model.rotary.cos_sin_cache.shape[0]
        == full.config.arch.max_position_embeddings
    )
    assert torch.equal(table, full.model_runner.model.rotary.cos_sin_cache[:96])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 80))}  # positions up to 94
    a = short.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    b = full.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
