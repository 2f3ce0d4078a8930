"""--quantization int8: the opt-in int8 path runs end to end and stays close to fp32."""

import torch

from zllm import LLM, SamplingParams
from zllm.executor.weights.quantization import Int8DynamicLinear


def test_int8_linear_close_to_fp32():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    q = Int8DynamicLinear(linear.weight, linear.bias)
    x = torch.randn(5, 64)
    ref, out = linear(x), q(x)
    assert out.shape == ref.shape
    rel = (out - ref).norm() / ref.norm()
    assert rel < 0.05, rel


def test_int8_engine_generates_and_tracks_fp32(tiny_llama_dir):
    fp32 = LLM(tiny_llama_dir)
    int8 = LLM(tiny_llama_dir, quantization="int8")
    assert isinstance(int8.model_runner.model.layers[0].mlp.gate_up_proj, Int8DynamicLinear)
    prompt = {"prompt_token_ids": list(range(10, 40))}
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    a = fp32.generate(prompt, score, use_tqdm=False)[0].prompt_logprobs
    b = int8.generate(prompt, score, use_tqdm=False)[0].prompt_logprobs
    tokens = prompt["prompt_token_ids"]
    drift = [abs(a[i][t].logprob - b[i][t].logprob) for i, t in enumerate(tokens) if i > 0]
    assert max(drift) < 1.0 and sum(drift) / len(drift) < 0.3
    out = int8.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
