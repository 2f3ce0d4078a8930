"""GPU figures that no `zllm bench` subcommand gives (run on a lent GPU machine; see
benchmarks/README.md):

  decode-steps   the model's decode step (forward + logits) for batch 1..256, eager and
                 replayed from CUDA graphs, timed with CUDA events; with the two floors of a
                 batch-1 step: bytes over measured HBM bandwidth, and kernel launches
  profile        a batch-1 decode step's kernels, grouped by name, with their GPU time
  prefill        eager prefill steps (whole prompts, a chunk after cached context) through
                 varlen FlashAttention, csrc/paged_prefill.cu, and one SDPA call per sequence
  divergence     SmolLM2 in bf16 on the GPU against the CPU engine in fp32: where greedy
                 outputs first diverge

    python benchmarks/gpu_bench.py decode-steps --shape smollm2|llama3-8b [--context 512]
        [--blocks q4_0|q8_0|fp8]   (the decoder's matmuls as random blocks: a quantized
                                    checkpoint's layout, csrc/block_gemv.cu)
    python benchmarks/gpu_bench.py profile [--shape smollm2-shape]
    python benchmarks/gpu_bench.py prefill [--shape llama3-8b]
    python benchmarks/gpu_bench.py divergence
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Llama-3-8B's shape (random bf16 weights: the timing depends on shapes, not values).
LLAMA3_8B = dict(
    architecture="llama", family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
)  # fmt: skip


# SmolLM2-135M's shape, for figures that need no real weights.
SMOLLM2_SHAPE = dict(
    architecture="llama", family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip
SHAPES = {"llama3-8b": LLAMA3_8B, "smollm2-shape": SMOLLM2_SHAPE}


def measured_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 4 GiB device-to-device copy, counting bytes read + written."""
    src = torch.empty(1 << 31, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * (1 << 32) / statistics.median(times[2:])


def launch_time(device: torch.device) -> tuple[float, float]:
    """Seconds per tiny kernel: launched eagerly one by one, and replayed in a graph."""
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize(device)
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    torch.cuda.synchronize(device)
    eager = (time.perf_counter() - start) / n
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize(device)
    return eager, (time.perf_counter() - start) / n


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    from zllm.executor.attention.cuda import CUDA_ATTENTION
    from zllm.executor.models.llama import LlamaForCausalLM
    from zllm.model.arch_config import ModelArchConfig

    if shape in SHAPES:
        arch = ModelArchConfig(**SHAPES[shape])
        with torch.device(device):
            model = LlamaForCausalLM(arch, dtype=dtype, attention=CUDA_ATTENTION)
        model.to(device)  # what the constructor made on the CPU explicitly
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
        return model.eval(), arch
    from zllm.executor.weights.loader import load_weights
    from zllm.model.arch import read_arch_config
    from zllm.model.files import resolve_model

    path = resolve_model("smollm2")
    arch = read_arch_config(path)
    model = LlamaForCausalLM(arch, dtype=dtype, attention=CUDA_ATTENTION)
    model.load_weights(load_weights(path, arch))
    return model.to(device).eval(), arch


# Random blocks for --blocks (ggml type id, bytes per 32 values): what a W4A16 (symmetric),
# W8A16 and fp8 checkpoint become at load (executor/weights/quantized/to_blocks.py).
BLOCK_KINDS = {"q4_0": (2, 18), "q8_0": (8, 34), "fp8": (100, 34)}


def random_blocks_(model, kind: str) -> int:
    """Every decoder matmul as random blocks of `kind` on the model's device (scales 2^-7,
    fp8 codes kept finite); returns the blocks' bytes."""
    from zllm.executor.layers.linear.gguf import GGUFLinear
    from zllm.executor.weights.blocks import decoder_matmul_targets

    ggml_type, block_bytes = BLOCK_KINDS[kind]
    total = 0
    for module, attr, _ in decoder_matmul_targets(model):
        linear = getattr(module, attr)
        rows, columns = linear.weight.shape
        device = linear.weight.device
        blocks = torch.randint(0, 256, (rows, columns // 32, block_bytes), dtype=torch.uint8,
                               device=device)  # fmt: skip
        if kind == "fp8":
            blocks &= 0x77  # exponents below 15: no NaN code
        blocks[..., :2] = torch.tensor([0x00, 0x20], dtype=torch.uint8, device=device)  # 2^-7
        qweight = blocks.view(rows, -1)
        setattr(module, attr, GGUFLinear(qweight, ggml_type, columns, linear.bias))
        total += qweight.numel()
    return total


def random_caches(arch, max_batch: int, context: int, block_size: int, dtype, device):
    """(KV caches of random values, one per layer, with room for `max_batch` sequences of
    `context` cached tokens and one new; blocks each sequence owns: 1 + i * that onwards)."""
    blocks_per_seq = -(-(context + 1) // block_size)
    num_blocks = max_batch * blocks_per_seq + 1
    caches = [
        torch.randn(2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim,
                    dtype=dtype, device=device)
        for _ in range(arch.num_layers)
    ]  # fmt: skip
    return caches, blocks_per_seq


def captured_graphs(model, caches, arch, max_batch: int, block_size: int):
    """The model's decode-step CUDA graphs for batches up to `max_batch`, captured."""
    from zllm.executor.graphs.decode import CudaGraphRunner

    max_blocks = -(-arch.max_position_embeddings // block_size)
    runner = CudaGraphRunner(
        model, caches, max_num_seqs=max_batch, max_blocks_per_seq=max_blocks,
        block_size=block_size, num_heads=arch.num_heads, head_dim=arch.head_dim,
    )  # fmt: skip
    runner.capture()
    return runner


def time_events(fn, repeats: int) -> float:
    """Median seconds of fn() between CUDA events (after two warm-up calls)."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def count_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(
        e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
    )


# Eager prefill steps (graphs hold decode steps only): (prompts, new tokens, cached tokens).
PREFILL_STEPS = ((16, 128, 0), (4, 1024, 0), (4, 512, 1536), (64, 64, 0))


def prefill_steps(model, caches, block_size: int, device, vocab_size: int) -> list[dict]:
    """Each PREFILL_STEPS step through the varlen FlashAttention call, the varlen kernel
    (ZLLM_CUDA_PREFILL=kernel) and one SDPA call per sequence (=sdpa), in the same run."""
    from zllm.executor.attention.cuda import CudaAttentionMetadata

    results = []
    for n, q, cached in PREFILL_STEPS:
        per_seq = -(-(q + cached) // block_size)
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(n)]
        slots = [
            t[p // block_size] * block_size + p % block_size
            for t in tables
            for p in range(cached, cached + q)
        ]
        ids = torch.randint(0, vocab_size, (n * q,), device=device)
        pos = torch.arange(cached, cached + q, device=device).repeat(n)
        row = dict(prompts=n, new_tokens=q, cached_tokens=cached)
        for label, mode in (("flash_ms", "auto"), ("kernel_ms", "kernel"), ("sdpa_ms", "sdpa")):
            os.environ["ZLLM_CUDA_PREFILL"] = mode
            meta = CudaAttentionMetadata.build(
                [q] * n, [cached + q] * n, tables, slots, block_size, device
            )

            def step(ids=ids, pos=pos, meta=meta, n=n):
                model.compute_logits(model(ids, pos, caches, meta)[-n:])

            row[label] = 1000 * time_events(step, 10)
        os.environ.pop("ZLLM_CUDA_PREFILL")
        print(
            f"prefill {n} x {q} new tokens after {cached} cached, eager: varlen flash "
            f"{row['flash_ms']:.3f} ms, varlen kernel {row['kernel_ms']:.3f} ms, per-sequence "
            f"SDPA {row['sdpa_ms']:.3f} ms (SDPA / flash {row['sdpa_ms'] / row['flash_ms']:.2f}x)",
            flush=True,
        )
        results.append(row)
    return results


@torch.inference_mode()
def decode_steps(args: argparse.Namespace) -> dict:
    from zllm.executor.attention.cuda import CudaAttentionMetadata

    device, dtype = torch.device("cuda", 0), torch.bfloat16
    bandwidth = measured_bandwidth(device)
    eager_launch, graph_launch = launch_time(device)
    model, arch = build_model(args.shape, device, dtype)
    block_bytes = 0 if args.blocks == "none" else random_blocks_(model, args.blocks)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + block_bytes
    block_size, ctx = 16, args.context
    max_batch = max(BATCHES)
    caches, blocks_per_seq = random_caches(arch, max_batch, ctx, block_size, dtype, device)
    kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    runner = captured_graphs(model, caches, arch, max_batch, block_size)
    rows = []
    for b in BATCHES:
        # Sequence i owns blocks [1 + i * blocks_per_seq, ...): its context (ctx tokens) is
        # cached, the new token goes to position ctx.
        tables = [
            list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(b)
        ]
        slots = [t[ctx // block_size] * block_size + ctx % block_size for t in tables]
        meta = CudaAttentionMetadata.build(
            [1] * b, [ctx + 1] * b, tables, slots, block_size, device
        )
        ids = torch.randint(0, arch.vocab_size, (b,), device=device)
        pos = torch.full((b,), ctx, dtype=torch.int64, device=device)

        def eager(ids=ids, pos=pos, meta=meta):
            model.compute_logits(model(ids, pos, caches, meta)).argmax(-1)

        def graph(ids=ids, pos=pos, meta=meta):
            model.compute_logits(runner.run(ids, pos, meta)).argmax(-1)

        e, g = time_events(eager, args.repeats), time_events(graph, args.repeats)
        floor = (weight_bytes + b * (ctx + 1) * kv_bytes_per_token) / bandwidth
        rows.append(
            dict(batch=b, eager_ms=1000 * e, graph_ms=1000 * g, bytes_floor_ms=1000 * floor)
        )
        print(
            f"batch {b:4d}: eager {1000 * e:8.3f} ms  graphs {1000 * g:8.3f} ms  "
            f"({e / g:5.2f}x)  bytes floor {1000 * floor:7.3f} ms  "
            f"graph / floor {g / floor:5.2f}x  {b / g:9.0f} tok/s",
            flush=True,
        )
    prefills = prefill_steps(model, caches, block_size, device, arch.vocab_size)
    one = rows[0]
    tables = [list(range(1, 1 + blocks_per_seq))]
    meta = CudaAttentionMetadata.build(
        [1], [ctx + 1], tables, [tables[0][ctx // 16] * 16 + ctx % 16], 16, device
    )
    ids, pos = (
        torch.zeros(1, dtype=torch.int64, device=device),
        torch.full((1,), ctx, device=device),
    )
    try:
        kernels = count_kernels(
            lambda: model.compute_logits(model(ids, pos, caches, meta)).argmax(-1)
        )
    except Exception as e:  # the profiler is a nicety: keep the timings
        print(f"kernel count failed: {e}")
        kernels = 0
    result = dict(
        shape=args.shape, blocks=args.blocks, device=torch.cuda.get_device_name(device),
        torch=torch.__version__,
        context=ctx, weight_bytes=weight_bytes, hbm_bytes_per_s=bandwidth,
        launch_eager_us=1e6 * eager_launch, launch_graph_us=1e6 * graph_launch,
        kernels_per_step=kernels, rows=rows, prefill_16x128_flash_ms=prefills[0]["flash_ms"],
        prefill_steps=prefills,
    )  # fmt: skip
    print(
        f"{args.shape}: weights {weight_bytes / 1e9:.2f} GB; HBM {bandwidth / 1e12:.2f} TB/s "
        f"(copy, read + write); batch 1: {kernels} kernels per step, launch {1e6 * eager_launch:.1f} "
        f"us eager / {1e6 * graph_launch:.2f} us in a graph -> launch floor "
        f"{kernels * eager_launch * 1000:.3f} ms eager, {kernels * graph_launch * 1000:.3f} ms "
        f"graphs; bytes floor {one['bytes_floor_ms']:.3f} ms; measured {one['graph_ms']:.3f} ms "
        f"graphs, {one['eager_ms']:.3f} ms eager"
    )
    return result


@torch.inference_mode()
def profile_step(args: argparse.Namespace) -> dict:
    """Where a batch-1 decode step's GPU time goes: kernels grouped by name (eager launch,
    so each kernel's own duration; a graph replay runs the same kernels back to back)."""
    from torch.profiler import ProfilerActivity, profile

    from zllm.executor.attention.cuda import CudaAttentionMetadata

    device = torch.device("cuda", 0)
    model, arch = build_model(args.shape, device, torch.bfloat16)
    ctx, bs = args.context, 16
    blocks = -(-(ctx + 1) // bs)
    caches = [
        torch.randn(2, blocks + 1, bs, arch.num_kv_heads, arch.head_dim,
                    dtype=torch.bfloat16, device=device)
        for _ in range(arch.num_layers)
    ]  # fmt: skip
    table = list(range(1, blocks + 1))
    meta = CudaAttentionMetadata.build(
        [1], [ctx + 1], [table], [table[ctx // bs] * bs + ctx % bs], bs, device
    )
    ids = torch.zeros(1, dtype=torch.int64, device=device)
    pos = torch.full((1,), ctx, dtype=torch.int64, device=device)

    def step():
        model.compute_logits(model(ids, pos, caches, meta)).argmax(-1)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in kernels)
    count = sum(e.count for e in kernels)
    print(f"{args.shape} batch 1, context {ctx}: {count} kernels, {total:.0f} us of kernel time")
    for e in kernels[: args.top]:
        print(
            f"  {e.device_time_total:8.1f} us {100 * e.device_time_total / total:5.1f}% "
            f"{e.count:5d}x {e.device_time_total / e.count:6.2f} us  {e.key[:90]}"
        )
    return dict(
        kernels=count,
        kernel_us=total,
        top=[(e.key, e.count, e.device_time_total) for e in kernels[: args.top]],
    )


def divergence(args: argparse.Namespace) -> dict:
    """SmolLM2 bf16 on the GPU vs fp32 on the CPU: greedy first-divergence statistics."""
    sys.path.insert(0, "tests")
    from test_cuda import SMOLLM2_PROMPTS

    from zllm import LLM, SamplingParams
    from zllm.model.files import resolve_model

    path = resolve_model("smollm2")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    messages = [[{"role": "user", "content": p}] for p in SMOLLM2_PROMPTS]
    out = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16"), ("cuda", "float32")):
        llm = LLM(path, device=device, dtype=dtype, quantization="none",
                  kv_cache_memory_bytes=1 << 30)  # fmt: skip
        out[(device, dtype)] = [
            o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)
        ]
        del llm
    ref = out[("cpu", "float32")]
    result = {}
    for key in (("cuda", "bfloat16"), ("cuda", "float32")):
        firsts = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(out[key], ref, strict=True)
        ]
        same = sum(f == args.max_tokens for f in firsts)
        result["/".join(key)] = dict(identical=same, first_divergence=firsts)
        print(
            f"{'/'.join(key)} vs cpu/float32, {len(ref)} prompts x {args.max_tokens} greedy tokens: "
            f"identical {same}/{len(ref)}; first divergence at {sorted(firsts)} "
            f"(median {statistics.median(firsts)})"
        )
    return result


@torch.inference_mode()
def prefill(args: argparse.Namespace) -> dict:
    """PREFILL_STEPS alone (no decode batches): flash, the kernel and per-sequence SDPA."""
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    model, arch = build_model(args.shape, device, dtype)
    block_size = 16
    num_blocks = max(n * -(-(q + c) // block_size) for n, q, c in PREFILL_STEPS) + 1
    caches = [
        torch.randn(2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim,
                    dtype=dtype, device=device)
        for _ in range(arch.num_layers)
    ]  # fmt: skip
    rows = prefill_steps(model, caches, block_size, device, arch.vocab_size)
    return dict(shape=args.shape, device=torch.cuda.get_device_name(device), rows=rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decode-steps")
    d.add_argument("--shape", choices=("smollm2", *SHAPES), default="smollm2")
    d.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    d.add_argument("--repeats", type=int, default=30)
    d.add_argument("--blocks", choices=("none", *BLOCK_KINDS), default="none")
    f = sub.add_parser("profile")
    f.add_argument("--shape", choices=("smollm2", *SHAPES), default="smollm2-shape")
    f.add_argument("--context", type=int, default=512)
    f.add_argument("--top", type=int, default=25)
    r = sub.add_parser("prefill")
    r.add_argument("--shape", choices=("smollm2", *SHAPES), default="llama3-8b")
    v = sub.add_parser("divergence")
    v.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    commands = {
        "decode-steps": decode_steps,
        "profile": profile_step,
        "prefill": prefill,
        "divergence": divergence,
    }
    result = commands[args.command](args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
