"""The CUDA path on a real GPU: csrc kernels, CudaPagedAttention and CUDA-graph replay.

Skipped (with the reason) without a CUDA device or without CuPy. The same kernels run
under emulation on CPU machines in test_csrc_compile.py; this file checks them for real. The
varlen prefill's and the decode window's kernel tests are in test_cuda_prefill.py: a GPU run
is `pytest tests/test_cuda.py tests/test_cuda_prefill.py`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from chat_prompts import SMOLLM2_PROMPTS
from gpu_parity import assert_same_greedy, counting_replays, free_llm
from paged_reference import (
    TOLERANCE,
    decode_reference,
    random_tables,
)

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed: pip install zllm[cuda]", allow_module_level=True)

from zllm.executor.attention.cuda import (  # noqa: E402
    CUDA_ATTENTION,
    CudaAttentionMetadata,
    CudaPagedAttention,
)
from zllm.executor.attention.paged import AttentionMetadata, PagedAttention  # noqa: E402
from zllm.executor.graphs.decode import CudaGraphRunner  # noqa: E402
from zllm.executor.kernels import cuda as ck  # noqa: E402

DEVICE = torch.device("cuda")


def ragged_lens(gen, count, max_len=4096):
    """Edge lengths (1, partition boundaries, max) plus random ones."""
    edges = [1, 2, 511, 512, 513, 1024, 1025, max_len]
    rand = torch.randint(1, max_len + 1, (max(0, count - len(edges)),), generator=gen).tolist()
    return (edges + rand)[:count]


SHAPES = [(9, 3, 64), (32, 8, 128), (8, 8, 128), (16, 1, 64), (12, 4, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_paged_decode_matches_reference(dtype, block_size, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 1000 + block_size * 10 + head_dim)
    lens = ragged_lens(gen, 12)
    table_dtype = torch.int64 if block_size == 16 else torch.int32
    num_blocks, tables = random_tables(lens, block_size, gen, table_dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(DEVICE, dtype)
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = qk[:, :heads]  # a strided view, as the model passes it
    tables = tables.to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE, dtype=torch.int32)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)

    ck.paged_decode_attention(q, kv_cache, tables, seq_lens, head_dim**-0.5, out)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "some output row was never written"
    expected = decode_reference(q, kv_cache, tables, lens, block_size)
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_max_seq_len_and_empty_rows(dtype):
    """A tight max_seq_len gives the same result as the table-width bound; seq_len 0 -> 0."""
    gen = torch.Generator().manual_seed(7)
    lens = [0, 3, 700, 1500, 1]
    num_blocks, tables = random_tables(lens, 16, gen)
    kv_cache = torch.randn(2, num_blocks, 16, 2, 128, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(lens), 8, 128, generator=gen).to(DEVICE, dtype)
    tables = torch.cat([tables, torch.zeros(len(lens), 40, dtype=tables.dtype)], 1).to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    wide = ck.paged_decode_attention(q, kv_cache, tables, seq_lens)
    tight = ck.paged_decode_attention(q, kv_cache, tables, seq_lens, max_seq_len=max(lens))
    torch.testing.assert_close(wide, tight, atol=0, rtol=0)
    assert torch.equal(wide[0], torch.zeros_like(wide[0]))
    expected = decode_reference(q, kv_cache, tables, lens, 16)
    err = ((wide.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("aligned", [True, False])
def test_write_kv_cache_lands_in_slots_and_skips_padding(dtype, aligned):
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, kv_heads, head_dim, heads, t = 64, 16, 8, 128, 32, 300
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(DEVICE, dtype)
    before = kv_cache.clone()
    offset = 0 if aligned else 1  # odd element offset: the scalar path
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim + offset, generator=gen).to(
        DEVICE, dtype
    )
    k = qkv[:, offset + heads * head_dim : offset + (heads + kv_heads) * head_dim]
    v = qkv[:, offset + (heads + kv_heads) * head_dim :]
    k, v = k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[::7] = -1
    ck.write_kv_cache(k, v, kv_cache, slots.to(DEVICE))
    expected = before.clone()
    keep = slots >= 0
    flat = expected.view(2, -1, kv_heads, head_dim)
    flat[0, slots[keep].to(DEVICE)] = k[keep.to(DEVICE)]
    flat[1, slots[keep].to(DEVICE)] = v[keep.to(DEVICE)]
    assert torch.equal(kv_cache, expected)


BATCHES = {
    "decode": [(1, 1), (1, 7), (1, 33), (1, 16), (1, 2), (1, 1500)],
    "prefill": [(5, 5), (1, 1), (17, 17), (3, 3), (600, 600)],
    "chunked": [(4, 20), (16, 16), (7, 9), (256, 1100)],
    "mixed": [(1, 12), (6, 6), (1, 40), (9, 25), (1, 3), (2, 2), (5, 37), (1, 800)],
}


@pytest.mark.parametrize("window", [None, 24], ids=["full", "window24"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", BATCHES)
def test_cuda_attention_matches_reference_attention(dtype, batch, window):
    heads, kv_heads, head_dim, block_size = 12, 4, 64, 16
    pairs = BATCHES[batch]
    q_lens, lens = [q for q, _ in pairs], [n for _, n in pairs]
    gen = torch.Generator().manual_seed(5)
    num_blocks, tables = random_tables(lens, block_size, gen)
    table_lists = [row[: -(-n // block_size)].tolist() for row, n in zip(tables, lens, strict=True)]
    slot_mapping = [
        tbl[p // block_size] * block_size + p % block_size
        for tbl, q, n in zip(table_lists, q_lens, lens, strict=True)
        for p in range(n - q, n)
    ]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    cache = cache.to(DEVICE, dtype)
    t = sum(q_lens)
    query, key, value = (
        torch.randn(t, h, head_dim, generator=gen).to(DEVICE, dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    ref_cache = cache.clone()
    args = (q_lens, lens, table_lists, slot_mapping, block_size, DEVICE)
    ref_meta = AttentionMetadata.build(*args, sliding_window=window)
    ref_attn = PagedAttention(heads, kv_heads, head_dim)
    expected = ref_attn(query.double(), key.double(), value.double(), ref_cache.double(), ref_meta)
    meta = CudaAttentionMetadata.build(*args, sliding_window=window)
    out = CudaPagedAttention(heads, kv_heads, head_dim)(query, key, value, cache, meta)
    flat_ref = ref_cache.view(2, -1, kv_heads, head_dim)
    flat_ref[0, slot_mapping], flat_ref[1, slot_mapping] = key, value
    assert torch.equal(cache, ref_cache)
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    # SDPA's kernels round like ours: a bf16 output is within a few bf16 ulps.
    assert err < {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype], f"relative error {err:.2e}"


# ---- fused layer ops (csrc/layer_ops.cu) ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_ops_match_torch_on_the_gpu(dtype):
    """RMSNorm (+ residual), RoPE and SiLU-and-mul fused, against models/llama.py's torch ops
    run on the same GPU tensors: RoPE bit-identical, the others within one rounding."""
    from zllm.executor.kernels import cuda_layer_ops as lo
    from zllm.executor.layers.norms import RMSNorm
    from zllm.executor.layers.rope import apply_rope

    gen = torch.Generator().manual_seed(31)
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    tokens, hidden = 37, 576
    x = torch.randn(tokens, hidden + 64, generator=gen).to(DEVICE, dtype)[:, 64:]
    residual = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    norm = RMSNorm(hidden, 1e-5, dtype).to(DEVICE)
    norm.weight.data = torch.randn(hidden, generator=gen).to(DEVICE, dtype)
    lo.ENABLED = False
    try:
        expected, expected_sum = norm(x, residual)
    finally:
        lo.ENABLED = True
    out, summed = lo.rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(out, expected, rtol=ulp, atol=ulp)

    qkv = torch.randn(tokens, 15 * 64, generator=gen).to(DEVICE, dtype)
    qk = qkv[:, : 12 * 64].view(tokens, 12, 64)
    table = torch.randn(4096, 64, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    cos, sin = table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    expected = apply_rope(qk.clone(), cos, sin)
    assert lo.rope_(qk, cos, sin) is qk
    assert torch.equal(qk, expected)

    gate_up = torch.randn(tokens, 2 * 1536, generator=gen).mul(4).to(DEVICE, dtype)
    gate, up = gate_up.split(1536, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(lo.silu_mul(gate_up), expected, rtol=ulp, atol=1e-6)


# ---- CUDA graphs on a tiny random Llama -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gpu_llama_dir(tmp_path_factory):
    from conftest import write_tiny_model

    return str(
        write_tiny_model(
            tmp_path_factory.mktemp("tiny-llama-gpu"),
            hidden_size=256,  # head_dim 64: a size the decode kernel is built for
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        )
    )


def load_model(path: str, dtype: torch.dtype):
    from zllm.executor.models.llama import LlamaForCausalLM
    from zllm.executor.weights.loader import load_weights
    from zllm.model.arch import read_arch_config

    arch = read_arch_config(path)
    model = LlamaForCausalLM(arch, dtype=dtype, attention=CUDA_ATTENTION)
    model.load_weights(load_weights(path, arch))
    model.to(DEVICE).eval()
    assert all(isinstance(layer.self_attn.attn, CudaPagedAttention) for layer in model.layers)
    return model, arch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_cuda_graph_replay_equals_eager(tiny_gpu_llama_dir, dtype):
    model, arch = load_model(tiny_gpu_llama_dir, dtype)
    block_size, max_blocks, num_seqs = 16, 64, 13
    gen = torch.Generator().manual_seed(11)
    lens = torch.randint(1, 900, (num_seqs,), generator=gen).tolist()
    num_blocks, tables = random_tables([n + 1 for n in lens], block_size, gen, spare=8)
    caches = [
        torch.zeros(2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim, dtype=dtype,
                    device=DEVICE)
        for _ in range(arch.num_layers)
    ]  # fmt: skip
    tables = [
        row[: -(-(n + 1) // block_size)].tolist() for row, n in zip(tables, lens, strict=True)
    ]

    def slot(i: int, p: int) -> int:
        return tables[i][p // block_size] * block_size + p % block_size

    # Prefill every sequence eagerly, one batch.
    ids = torch.randint(0, arch.vocab_size, (sum(lens),), generator=gen).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    slots = [slot(i, p) for i, n in enumerate(lens) for p in range(n)]
    meta = CudaAttentionMetadata.build(lens, lens, tables, slots, block_size, DEVICE)
    model(ids, positions, caches, meta)

    runner = CudaGraphRunner(
        model, caches, max_num_seqs=16, max_blocks_per_seq=max_blocks, block_size=block_size,
        num_heads=arch.num_heads, head_dim=arch.head_dim, capture_sizes=(1, 2, 4, 8, 16),
    )  # fmt: skip
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16]
    assert runner.run(ids, positions, meta) is None  # a prefill batch runs eagerly

    for n in (1, 3, 8, 13):
        new_ids = torch.randint(0, arch.vocab_size, (n,), generator=gen).to(DEVICE)
        pos = torch.tensor(lens[:n], device=DEVICE)
        dec_slots = [slot(i, lens[i]) for i in range(n)]
        dec_lens = [x + 1 for x in lens[:n]]
        meta = CudaAttentionMetadata.build(
            [1] * n, dec_lens, tables[:n], dec_slots, block_size, DEVICE
        )
        assert meta.is_decode_only
        eager = model(new_ids, pos, caches, meta).clone()
        cache_after_eager = [c.clone() for c in caches]
        replayed = runner.run(new_ids, pos, meta)
        assert replayed is not None and replayed.shape == eager.shape
        # The replay wrote the same K/V to the same slots, and nothing else (padding: -1).
        for c, c_eager in zip(caches, cache_after_eager, strict=True):
            torch.testing.assert_close(c, c_eager, atol=1e-2, rtol=1e-2)
        rel = ((replayed.float() - eager.float()).norm() / eager.float().norm()).item()
        assert rel < (1e-5 if dtype == torch.float32 else 1e-2), f"batch {n}: {rel:.2e}"

    # Bigger than the largest graph, or graphs disabled: eager.
    big = CudaAttentionMetadata.build(
        [1] * 17, [2] * 17, [tables[0]] * 17, [slot(0, 1)] * 17, block_size, DEVICE
    )
    ids17 = torch.zeros(17, dtype=torch.int64, device=DEVICE)
    assert runner.run(ids17, ids17, big) is None
    runner.enabled = False
    assert runner.run(new_ids, pos, meta) is None


# ---- the engine on the GPU: the offline LLM and `zllm serve`, against the CPU engine ----------
def make_llm(path: str, device: str, **kw):
    from zllm import LLM

    kw.setdefault("kv_cache_memory_bytes", 256 << 20)
    return LLM(path, device=device, dtype=kw.pop("dtype", "float32"), **kw)


def engine_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in lengths]


@pytest.fixture(scope="module")
def cpu_reference(tiny_gpu_llama_dir):
    """The CPU engine's greedy outputs (top-5 logprobs) for a batch of mixed lengths, with
    chunked prefill (128-token steps) and a repeated prompt (a prefix-cache hit)."""
    from zllm import SamplingParams

    llm = make_llm(tiny_gpu_llama_dir, "cpu", max_num_batched_tokens=128)
    prompts = engine_prompts(llm.config.arch.vocab_size, [1, 3, 17, 40, 100, 300, 700, 64])
    prompts.append(prompts[6])  # 700 tokens again: a prefix hit
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    return prompts, params, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_engine_greedy_on_gpu_equals_cpu(tiny_gpu_llama_dir, cpu_reference, enforce_eager):
    prompts, params, cpu_out = cpu_reference
    llm = make_llm(
        tiny_gpu_llama_dir, "cuda", max_num_batched_tokens=128, enforce_eager=enforce_eager
    )
    assert (llm.model_runner.graph_runner.graphs != {}) is (not enforce_eager)
    gpu_out = llm.generate(prompts, params, use_tqdm=False)
    assert gpu_out[-1].num_cached_tokens >= 688  # the repeated prompt hit the prefix cache
    assert_same_greedy(gpu_out, cpu_out, f"tiny fp32 eager={enforce_eager}")
    free_llm(llm)


WINDOWED_MODELS = {
    "mistral-all-sliding": dict(arch="mistral", sliding_window=48),
    "gemma3-hybrid": dict(
        arch="gemma3_text", num_hidden_layers=3, head_dim=64, query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=48,
    ),
}  # fmt: skip


@pytest.mark.parametrize("model", WINDOWED_MODELS)
def test_sliding_window_models_on_gpu_equal_cpu(model, tmp_path):
    """Sliding-window layers on the CUDA kernels (decode, replayed from CUDA graphs with a
    metadata set per (group, window), and the varlen prefill both window): prompts longer
    than the window, chunked prefill, a prefix hit; fp32 against the CPU."""
    from conftest import write_tiny_model

    from zllm import SamplingParams

    path = str(write_tiny_model(tmp_path / model, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2,
                                **WINDOWED_MODELS[model]))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = make_llm(path, device, max_num_batched_tokens=64)
        prompts = engine_prompts(llm.config.arch.vocab_size, [3, 30, 47, 49, 100, 200], seed=1)
        prompts.append(prompts[5])  # a prefix hit
        if device == "cuda":  # the CUDA kernels, decode replayed from graphs
            assert llm.model_runner.host.layout.attention.name == "cuda"
            assert llm.model_runner.graph_runner.graphs
        outs[device] = llm.generate(prompts, params, use_tqdm=False)
        free_llm(llm)
    assert outs["cuda"][-1].num_cached_tokens > 0
    assert_same_greedy(outs["cuda"], outs["cpu"], f"{model} fp32")


def test_graph_replay_equals_eager_in_the_engine(tiny_gpu_llama_dir):
    """Decode steps replayed from graphs give the eager engine's tokens (same device, same
    kernels): bf16, a batch of 40 (padded to the 64-graph) and one of 3."""
    from zllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = make_llm(tiny_gpu_llama_dir, "cuda", dtype="bfloat16", enforce_eager=eager)
        vocab = llm.config.arch.vocab_size
        outs[eager] = [
            [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
            for batch in (engine_prompts(vocab, [5 + i for i in range(40)], 1),
                          engine_prompts(vocab, [9, 90, 900], 2))
        ]  # fmt: skip
        free_llm(llm)
    assert outs[False] == outs[True]


def test_lora_steps_replay_cuda_graphs(tiny_gpu_llama_dir, tmp_path):
    """LoRA with CUDA graphs (adapters in fixed slot buffers, executor/lora/slots.py):
    decode steps replay their graphs and prefill/mixed steps their pieces, three adapters
    and the base share two slots, and the greedy tokens equal the eager engine's (its
    segmented updates: the same sums in other GEMM shapes, so near ties may flip)."""
    from tiny_models import write_lora_adapter

    from zllm import LoRARequest, SamplingParams

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = [
        LoRARequest(f"a{i}", i, str(write_lora_adapter(tmp_path / f"a{i}", tiny_gpu_llama_dir,
                                                       rank=4 * i, targets=targets, seed=i)))
        for i in (1, 2)
    ] + [LoRARequest("a3", 3, str(write_lora_adapter(tmp_path / "a3", tiny_gpu_llama_dir,
                                                     rank=8, targets=["q_proj"], seed=3)))]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    outs, replays = {}, {}
    for mode in ("graphs", "eager"):
        llm = make_llm(tiny_gpu_llama_dir, "cuda", enable_lora=True, max_loras=2,
                       max_lora_rank=8, max_num_batched_tokens=64,
                       enforce_eager=mode == "eager",
                       cudagraph_mode="full_and_piecewise")  # fmt: skip
        host = llm.executor.runner.host
        assert (host.weights.lora.slots is not None) == (mode == "graphs")
        graphs = counting_replays(host.decode.graph_runner) if host.decode.graph_runner else [0]
        prompts = engine_prompts(llm.config.arch.vocab_size, [3, 40, 150, 7, 61, 30, 12, 90], 5)
        loras = [[*adapters, None][i % 4] for i in range(len(prompts))]
        outs[mode] = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        pieces = host.decode.piecewise_runner.steps_replayed if host.decode.piecewise_runner else 0
        replays[mode] = (graphs[0], pieces)
        free_llm(llm)
    assert replays["eager"] == (0, 0)
    assert replays["graphs"][0] >= 10 and replays["graphs"][1] >= 4, replays["graphs"]
    assert assert_same_greedy(outs["graphs"], outs["eager"], "lora graphs") <= 1


@pytest.mark.parametrize("async_executor", ["on", "off"])
def test_piecewise_graphs_equal_eager_in_the_engine(tiny_gpu_llama_dir, async_executor):
    """--cudagraph-mode full_and_piecewise: prefill and mixed steps (prompts chunked by a
    64-token budget beside running decodes) replay their pieces, and every token equals the
    eager engine's (fp32, same device)."""
    from zllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs, replayed = {}, {}
    for mode in ("piecewise", "eager"):
        llm = make_llm(tiny_gpu_llama_dir, "cuda", max_num_batched_tokens=64,
                       async_executor=async_executor, enforce_eager=mode == "eager",
                       cudagraph_mode="full_and_piecewise")  # fmt: skip
        prompts = engine_prompts(llm.config.arch.vocab_size, [3, 40, 150, 7, 61, 300, 12], 4)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]  # fmt: skip
        runner = llm.executor.runner.host.decode.piecewise_runner
        replayed[mode] = runner.steps_replayed if runner is not None else 0
        free_llm(llm)
    assert outs["piecewise"] == outs["eager"]
    assert replayed["eager"] == 0 and replayed["piecewise"] >= 8


def test_seeded_sampling_reproducible_on_cuda(tiny_gpu_llama_dir):
    """A seed gives the same samples on every run on the GPU, whatever shares the batch;
    n > 1 samples differ from each other; every sampling option runs on device tensors."""
    from zllm import SamplingParams

    llm = make_llm(tiny_gpu_llama_dir, "cuda")
    vocab = llm.config.arch.vocab_size
    seeded = SamplingParams(
        temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=1234, n=3, max_tokens=20,
        presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True,
    )  # fmt: skip
    prompt = engine_prompts(vocab, [30], 3)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0]
    others = engine_prompts(vocab, [7, 70, 200], 4)
    unseeded = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm.generate(others + prompt, [unseeded] * 3 + [seeded], use_tqdm=False)[-1]
    samples = [c.token_ids for c in alone.outputs]
    assert samples == [c.token_ids for c in batch.outputs]
    assert len({tuple(s) for s in samples}) == 3, "the n samples should differ"
    free_llm(llm)


def test_sampling_options_on_cuda_equal_cpu(tiny_gpu_llama_dir):
    """Greedy under logit_bias, penalties, min_tokens and stop tokens, with logprobs and
    prompt logprobs: the same tokens as the CPU engine and logprobs within fp32 noise."""
    from zllm import SamplingParams

    results = {}
    for device in ("cpu", "cuda"):
        llm = make_llm(tiny_gpu_llama_dir, device)
        vocab = llm.config.arch.vocab_size
        prompts = engine_prompts(vocab, [12, 50, 130], 5)
        params = [
            SamplingParams(temperature=0.0, max_tokens=16, logit_bias={7: 5.0, 9: -100.0},
                           logprobs=3, prompt_logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=1.0,
                           frequency_penalty=0.5, repetition_penalty=1.3, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4, stop_token_ids=[11]),
        ]  # fmt: skip
        results[device] = llm.generate(prompts, params, use_tqdm=False)
        if device == "cuda":
            free_llm(llm)
    for cpu, gpu in zip(results["cpu"], results["cuda"], strict=True):
        assert gpu.outputs[0].token_ids == cpu.outputs[0].token_ids
    cpu, gpu = results["cpu"][0], results["cuda"][0]
    for c_pos, g_pos in zip(cpu.outputs[0].logprobs, gpu.outputs[0].logprobs, strict=True):
        assert c_pos.keys() == g_pos.keys()
        for t in c_pos:
            assert abs(c_pos[t].logprob - g_pos[t].logprob) < 1e-3
    for c_pos, g_pos in zip(cpu.prompt_logprobs[1:], gpu.prompt_logprobs[1:], strict=True):
        for t in c_pos:
            assert abs(c_pos[t].logprob - g_pos[t].logprob) < 1e-3


def test_structured_output_and_speculation_on_cuda(tiny_gpu_llama_dir):
    """A regex-constrained answer parses; ngram speculation leaves greedy outputs unchanged."""
    import re

    from zllm import SamplingParams
    from zllm.sampling_params import StructuredOutputsParams

    llm = make_llm(tiny_gpu_llama_dir, "cuda")
    regex = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
    )  # fmt: skip
    text = llm.generate(["Give me a code:"], regex, use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    vocab = llm.config.arch.vocab_size
    repeats = [
        {"prompt_token_ids": p["prompt_token_ids"] * 4} for p in engine_prompts(vocab, [8, 13], 6)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(repeats, greedy, use_tqdm=False)]
    free_llm(llm)
    # Verify steps (several tokens a row) take no decode graph; piecewise graphs replay them.
    for mode in ("full_decode_only", "full_and_piecewise"):
        spec = make_llm(
            tiny_gpu_llama_dir, "cuda", cudagraph_mode=mode,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        )  # fmt: skip
        outs = [o.outputs[0].token_ids for o in spec.generate(repeats, greedy, use_tqdm=False)]
        assert outs == plain, mode
        runner = spec.executor.runner.host.decode.piecewise_runner
        assert (runner is not None and runner.steps_replayed > 0) == (mode != "full_decode_only")
        free_llm(spec)


def test_preemption_on_cuda(tiny_gpu_llama_dir):
    """A pool too small for the batch: requests are preempted and recomputed, and the
    outputs equal those of a pool that holds them all."""
    from zllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = []
    for blocks in (None, 24):
        llm = make_llm(tiny_gpu_llama_dir, "cuda", num_gpu_blocks_override=blocks)
        prompts = engine_prompts(llm.config.arch.vocab_size, [40, 60, 80, 100], 7)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if blocks is not None:
            assert llm.engine.heartbeat().load.num_preemptions > 0
        free_llm(llm)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_levels_free_the_gpu_and_wake_to_the_same_outputs(tiny_gpu_llama_dir, level):
    """Level 1: the KV pool is freed and the weights wait in pinned host memory (GPU memory
    falls by the pool and the weights); level 2: the weights are freed and reloaded from
    the file. Woken in parts (weights, then the pool), the outputs equal those before."""
    from zllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = make_llm(tiny_gpu_llama_dir, "cuda", dtype="bfloat16", enable_sleep_mode=True)
    prompts = engine_prompts(llm.config.arch.vocab_size, [30, 50], 3)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.model_runner
    weights = sum(p.nbytes for p in runner.model.parameters())
    pool = sum(t.nbytes for t in runner.kv_tensors)
    allocated = torch.cuda.memory_allocated()
    llm.sleep(level=level)
    assert allocated - torch.cuda.memory_allocated() >= pool + 0.9 * weights
    if level == 1:
        param = next(runner.model.parameters())
        assert param.device.type == "cpu" and param.is_pinned()
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and next(runner.model.parameters()).device.type == "cuda"
    llm.wake_up(["kv_cache"])
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
    free_llm(llm)


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_cache_kernel_equals_rope_then_the_cache_write(dtype):
    """zllm_rope_cache on the GPU: the bits of zllm_rope followed by the cache write kernel
    (decode-sized and prefill-sized rows, a padding slot, strided q/k/v as in qkv)."""
    from zllm.executor.kernels import cuda_layer_ops as lo

    gen = torch.Generator().manual_seed(31)
    heads, kv_heads, head_dim, block_size = 8, 2, 128, 16
    for tokens in (3, 300):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
        qkv = qkv.to(DEVICE, dtype)
        cos, sin = torch.randn(2, tokens, 1, head_dim // 2, generator=gen).to(DEVICE, dtype)
        slots = torch.randperm(64 * block_size, generator=gen)[:tokens].to(DEVICE)
        slots[1] = -1
        caches = [torch.zeros(2, 64, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
                  for _ in range(2)]  # fmt: skip
        qkvs = [qkv.clone() for _ in range(2)]
        views = [
            (x[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim),
             x[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim))
            for x in qkvs
        ]  # fmt: skip
        (qk0, v0), (qk1, v1) = views
        assert lo.rope_cache_(qk0, v0, cos, sin, caches[0], slots)
        lo.rope_(qk1, cos, sin)
        ck.write_kv_cache(qk1[:, heads:], v1, caches[1], slots)
        assert torch.equal(qkvs[0], qkvs[1])
        assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_async_executor_on_gpu_equals_one_step_at_a_time(tiny_gpu_llama_dir, enforce_eager):
    """`--async-executor` (on by default for CUDA): greedy and seeded outputs equal to the
    synchronous executor's on the same GPU, with most steps launched over the one before
    (tokens fed on the device into graph replays and eager steps alike)."""
    from zllm import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=5, max_tokens=32),
        # Read on the host, so the steps it is in run one at a time: short, so most steps
        # overlap once it is done.
        SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3),
    ] * 4
    outs, overlapped = {}, {}
    for mode in ("off", "on"):
        llm = make_llm(tiny_gpu_llama_dir, "cuda", async_executor=mode,
                       enforce_eager=enforce_eager, max_num_batched_tokens=128)  # fmt: skip
        prompts = engine_prompts(llm.config.arch.vocab_size, [3, 30, 90, 200] * 3, seed=8)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]  # fmt: skip
        overlapped[mode] = llm.executor.pipeline.num_overlapped
        solo = llm.generate(prompts[:1], params[0], use_tqdm=False)[0].outputs[0].token_ids
        assert solo == outs[mode][0]
        free_llm(llm)
    assert outs["on"] == outs["off"]
    assert overlapped["off"] == 0 and overlapped["on"] > 10


def test_launching_a_step_over_a_pending_one_never_waits_for_the_gpu(tiny_gpu_llama_dir):
    """While a step is pending, launching the next one must only queue work: any call that
    synchronizes with the device (a blocking copy, .item(), .tolist()) would stall the host
    until the pending step's kernels finish, undoing the overlap. CUDA's sync debug mode
    turns such a call into an error, raised inside the launch that made it."""
    from zllm import SamplingParams
    from zllm.executor.model_runner import ModelRunner

    launch = ModelRunner.launch
    checked = []

    def strict_launch(self, so, pending=None):
        if pending is None:
            return launch(self, so, pending)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, so, pending)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(so.step_id)

    ModelRunner.launch = strict_launch
    try:
        llm = make_llm(tiny_gpu_llama_dir, "cuda", dtype="bfloat16", async_executor="on")
        vocab = llm.config.arch.vocab_size
        params = [
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.8, min_p=0.01, max_tokens=24,
                           logit_bias={5: 1.0}, ignore_eos=True),
        ]  # fmt: skip
        llm.generate(engine_prompts(vocab, [5, 50, 150], seed=9), params, use_tqdm=False)
    finally:
        ModelRunner.launch = launch
    assert len(checked) > 10
    free_llm(llm)


@pytest.mark.parametrize(
    "other_job_gib, cudagraph_mode",
    [(0, "full_decode_only"), (0, "full_and_piecewise"), (8, "full_decode_only")],
    ids=["alone", "alone-piecewise", "beside-another-job"],
)
def test_gpu_memory_utilization_keeps_the_engine_in_its_share(
    tiny_gpu_llama_dir, other_job_gib, cudagraph_mode
):
    """--gpu-memory-utilization 0.3: the engine's peak (weights, KV pool, the largest steps'
    activations, graphs) stays within 0.3 of the GPU, the activations' peak within the
    reserve computed from the shapes, and the pool takes what the share leaves; with
    piecewise graphs too, whose pieces are captured after the pool within the static
    memory reserved for them (`piecewise_graph.static_bytes`). Beside another job holding
    memory (a tensor allocated before the engine: not the engine's load), the pool takes
    only what is free, and long prefills still run."""
    from zllm import SamplingParams
    from zllm.executor.kv.gpu_memory import StepShape, activation_reserve_bytes

    free_llm(None)
    hog = torch.empty(other_job_gib << 30, dtype=torch.uint8, device=DEVICE)
    _, total = torch.cuda.mem_get_info()
    utilization = 0.3 if other_job_gib == 0 else 1.0
    base = torch.cuda.memory_reserved()
    llm = make_llm(tiny_gpu_llama_dir, "cuda", kv_cache_memory_bytes=None,
                   gpu_memory_utilization=utilization, max_num_batched_tokens=2048,
                   max_num_seqs=256, cudagraph_mode=cudagraph_mode)  # fmt: skip
    config = llm.config
    loaded = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    vocab = config.arch.vocab_size
    prompts = engine_prompts(vocab, [500] * 8 + [5] * 248, seed=10)  # 2,048-token prefills
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    peak_activations = torch.cuda.max_memory_allocated() - loaded
    step = StepShape(2048, 256, config.scheduler.max_model_len, 4)
    assert peak_activations <= activation_reserve_bytes(config.arch, step)
    engine_peak = torch.cuda.max_memory_reserved() - base
    if other_job_gib == 0:
        assert engine_peak <= utilization * total
        per_block = llm.model_runner.host.kv.bytes_per_slot() * config.cache.block_size
        pool = config.cache.num_blocks * per_block
        weights_and_rest = loaded - pool
        reserve = activation_reserve_bytes(config.arch, step)
        assert pool >= utilization * total - weights_and_rest - reserve - (1 << 30)
    del hog
    free_llm(llm)


@pytest.mark.e2e
def test_served_on_gpu_with_the_openai_client(tiny_gpu_llama_dir, tmp_path):
    """`zllm serve` on the GPU: all five process kinds up, chat and streaming through the
    openai client, greedy equal to the offline GPU engine."""
    import openai
    from servers import start_server, stop_server

    from zllm import SamplingParams

    server = start_server(
        tiny_gpu_llama_dir, tmp_path / "serve.log", "--dtype", "float32",
        "--served-model-name", "tiny",
    )  # fmt: skip
    try:
        kinds = {title.split()[0] for title in server.children()}
        assert {"frontend", "tokenizer", "core", "executor", "detokenizer"} <= kinds
        assert "Attention: cuda" in server.log_text()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": "Hello there, GPU"}]
        chat = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, temperature=0.0
        )
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, temperature=0.0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == chat.choices[0].message.content
    finally:
        stop_server(server)
    llm = make_llm(tiny_gpu_llama_dir, "cuda")
    offline = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert offline[0].outputs[0].text == chat.choices[0].message.content
    free_llm(llm)


@pytest.mark.e2e
def test_served_soak_at_concurrency_128_then_kill_9_of_the_executor(tiny_gpu_llama_dir, tmp_path):
    """Reliability on the GPU: 1,000 requests at concurrency 128 (a quarter streamed, some
    cancelled mid-stream, random lengths) leave no KV block held and no request running;
    then kill -9 of the executor while it holds the GPU: the supervisor restarts it and
    the server answers again, greedy as before."""
    import asyncio
    import os
    import random
    import signal

    import httpx
    from servers import metric, start_server, stop_server, wait_until

    server = start_server(tiny_gpu_llama_dir, tmp_path / "serve.log", "--dtype", "bfloat16",
                          "--served-model-name", "tiny")  # fmt: skip
    try:
        body = {"model": "tiny", "prompt": "The GPU soak", "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        before = server.post("/v1/completions", body).json()["choices"][0]["text"]

        async def one(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
            request = {"model": "tiny", "prompt": [rng.randrange(3, 400) for _ in range(
                rng.randrange(1, 300))], "max_tokens": rng.randrange(1, 48),
                "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True,
                "stream": i % 4 == 0}  # fmt: skip
            try:
                if not request["stream"]:
                    r = await client.post(server.url + "/v1/completions", json=request)
                    return "ok" if r.status_code == 200 else f"status {r.status_code}"
                url = server.url + "/v1/completions"
                async with client.stream("POST", url, json=request) as r:
                    async for i_line, _ in enumerate_lines(r):
                        if i % 8 == 0 and i_line >= 3:
                            return "cancelled"
                return "ok"
            except httpx.TransportError as e:  # counted and shown, with the server's log
                return f"{type(e).__name__} on {'stream' if request['stream'] else 'post'}"

        async def enumerate_lines(response):
            i = 0
            async for line in response.aiter_lines():
                yield i, line
                i += 1

        async def soak() -> list[str]:
            rng = random.Random(0)
            gate = asyncio.Semaphore(128)
            # Idle connections expire on the client before uvicorn's 5 s keep-alive closes
            # them, so no request is sent down a socket the server is closing.
            limits = httpx.Limits(max_connections=160, keepalive_expiry=2)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:

                async def bounded(i: int) -> str:
                    async with gate:
                        return await one(client, i, rng)

                return await asyncio.wait_for(
                    asyncio.gather(*(bounded(i) for i in range(1000))), 480
                )

        outcomes = asyncio.run(soak())
        counts = {o: outcomes.count(o) for o in outcomes}
        assert set(outcomes) <= {"ok", "cancelled"}, (counts, server.log_tail())

        def idle() -> bool:
            text = server.get("/metrics").text
            return (
                metric(text, "vllm:num_requests_running") == 0
                and metric(text, "vllm:num_requests_waiting") == 0
                and metric(text, "vllm:kv_cache_usage_perc") == 0
            )

        assert wait_until(idle, 15), "KV blocks or requests left after the soak"
        executor = server.children()["executor"]
        os.kill(executor, signal.SIGKILL)
        assert wait_until(lambda: server.children().get("executor", executor) != executor, 60)
        assert wait_until(server.healthy, 120), server.log_tail()
        after = server.post("/v1/completions", body).json()["choices"][0]["text"]
        assert after == before
    finally:
        assert stop_server(server) == 0


@pytest.mark.slow
def test_smollm2_fp32_on_gpu_equals_cpu(smollm2_path):
    """SmolLM2 in fp32: the GPU engine's greedy outputs equal the CPU engine's on 16 chat
    prompts (near-tie rule as in the parity tests, flips counted in the summary)."""
    from zllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=5)
    messages = [[{"role": "user", "content": p}] for p in SMOLLM2_PROMPTS]
    out = {}
    for device in ("cpu", "cuda"):
        llm = make_llm(smollm2_path, device, quantization="none")
        out[device] = llm.chat(messages, params, use_tqdm=False)
        if device == "cuda":
            free_llm(llm)
    flips = assert_same_greedy(out["cuda"], out["cpu"], "smollm2 fp32")
    assert flips <= 2, f"{flips} near-tie flips in 16 prompts"
