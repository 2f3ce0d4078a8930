"""Attention sinks (gpt-oss) in csrc's CUDA kernels on a real GPU, against float64, and a tiny
gpt-oss on the GPU against transformers; part of the GPU run (`pytest tests/test_cuda*.py`).
The same kernels run under the CPU emulator in tests/test_attention_sinks.py."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch
from paged_reference import (
    TOLERANCE,
    decode_reference,
    packed_prefills,
    poison_released_blocks,
    prefill_reference,
    random_tables,
)

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install zllm[cuda]", allow_module_level=True)

from zllm.executor.attention import cuda_prefill as cp  # noqa: E402
from zllm.executor.kernels import cuda as ck  # noqa: E402

DEVICE = torch.device("cuda")


def sinks_for(heads: int, gen: torch.Generator) -> torch.Tensor:
    """Sink logits around the scores' scale, one far above (that head's output shrinks) and
    one far below."""
    sinks = torch.randn(heads, generator=gen) * 2
    sinks[0], sinks[-1] = 9.0, -9.0
    return sinks.to(DEVICE)


@pytest.mark.parametrize("window", [0, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_with_sinks(dtype, window):
    """Single partitions (the sink in the block's softmax) and split contexts (in the
    reduce), with and without a window."""
    gen = torch.Generator().manual_seed(window)
    lens = [1, 36, 511, 512, 513, 601, 2000, 4096]
    num_blocks, tables = random_tables(lens, 16, gen)
    kv_cache = torch.randn(2, num_blocks, 16, 2, 64, generator=gen).to(DEVICE, dtype)
    if window:
        released = [max(0, n - window) for n in lens]
        kv_cache = poison_released_blocks(kv_cache, tables, released, 16)
    q = torch.randn(len(lens), 8, 64, generator=gen).to(DEVICE, dtype)
    sinks = sinks_for(8, gen)
    seq_lens, tables = torch.tensor(lens, device=DEVICE), tables.to(DEVICE)
    out = ck.paged_decode_attention(q, kv_cache, tables, seq_lens, window=window, sinks=sinks)
    expected = decode_reference(q, kv_cache, tables, lens, 16, window, sinks)
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("window", [0, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_kernel_with_sinks(dtype, window):
    """csrc/paged_prefill.cu (the implementation every layer with sinks takes) over whole
    prompts and chunks after cached context."""
    pairs = [(2, 2), (17, 17), (300, 300), (64, 1000), (33, 700)]
    gen = torch.Generator().manual_seed(window + 1)
    num_blocks, tables = random_tables([n for _, n in pairs], 16, gen)
    kv_cache = torch.randn(2, num_blocks, 16, 8, 64, generator=gen).to(DEVICE, dtype)
    if window:
        released = [max(0, n - q - window + 1) for q, n in pairs]
        kv_cache = poison_released_blocks(kv_cache, tables, released, 16)
    seqs, total = packed_prefills(pairs)
    q = torch.randn(total, 64, 64, generator=gen).to(DEVICE, dtype)
    sinks = sinks_for(64, gen)
    out = torch.zeros_like(q)
    starts, q_lens, lens = (np.array(c) for c in zip(*seqs, strict=True))
    batch = cp.PrefillBatch.build(
        starts, q_lens, lens, list(tables.numpy()), 16, DEVICE, window, "auto"
    )
    cp.paged_prefill_attention(q, kv_cache, batch, 64**-0.5, out, sinks=sinks)
    expected = prefill_reference(q, kv_cache, tables.to(DEVICE), seqs, 16, window, sinks)
    rows = torch.cat([torch.arange(f, f + n) for f, n, _ in seqs]).to(DEVICE)
    got, want = out[rows].double(), expected[rows]
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def test_tiny_gpt_oss_on_gpu_equals_transformers(tmp_path):
    """A tiny gpt-oss (sinks, window 48 on alternate layers, 4 experts) in fp32 on the CUDA
    backend: prompts past the window, chunked prefill, greedy tokens as transformers'."""
    import transformers
    from parity import assert_greedy_parity, hf_greedy
    from tiny_models import write_tiny_model

    from zllm import LLM, SamplingParams

    path = write_tiny_model(
        tmp_path / "gpt-oss", arch="gpt_oss", num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=64, sliding_window=48, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    hf.save_pretrained(path)
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_num_batched_tokens=64)  # fmt: skip
    assert llm.model_runner.host.layout.attention.name == "cuda"
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 30, 49, 100, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ours = out.outputs[0].token_ids
        theirs = hf_greedy(hf, prompt, len(ours))
        assert_greedy_parity(hf, prompt, ours, theirs, label=f"gpt-oss cuda[{i}]")
