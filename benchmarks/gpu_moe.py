"""A mixture-of-experts model's decode step on the GPU against its floor (issue 62): the
layers of Qwen3-30B-A3B (128 experts, 8 a token, experts of 768, hidden 2048, 32 query and 4
KV heads of 128), fewer of them so the weights fit a short device call, random bf16 weights.

For each batch size: the step (forward + logits + argmax) eager through the per-expert
matmuls (ZLLM_CUDA_MOE=0's path, a host sync a layer), eager through the expert kernel
(csrc/moe_experts.cu), and replayed from a CUDA graph (only the kernel path can be
captured); against the bytes floor: the weights a step must read (attention, norms, routers,
the logits matrix, and per layer only the experts its tokens chose, counted from the step's
own routes) plus the KV cache, over the HBM bandwidth a device copy measures.

    python benchmarks/gpu_moe.py [--layers 8] [--batches 1 8 32 64] [--context 512]
        [--output-json F]
    python benchmarks/gpu_moe.py --shape tiny --device cpu     (a smoke run without a GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import (  # noqa: E402
    captured_graphs,
    measured_bandwidth,
    random_caches,
    time_events,
)
from pooling_peers import timed  # noqa: E402

QWEN3_30B_A3B_LAYERS = dict(
    architecture="qwen3_moe", family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=8192, tie_word_embeddings=False, qk_norm=True,
    moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
)  # fmt: skip
TINY = dict(
    QWEN3_30B_A3B_LAYERS, vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
    num_kv_heads=2, head_dim=64,
    moe=dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True),
)  # fmt: skip
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B_LAYERS, "tiny": TINY}


def build(shape: str, layers: int, device: torch.device, dtype: torch.dtype):
    from zllm.executor.attention.backend import choose_attention_backend
    from zllm.executor.models.llama import LlamaForCausalLM
    from zllm.model.arch_config import ModelArchConfig, MoEConfig

    shape_fields = dict(SHAPES[shape])
    moe = MoEConfig(**shape_fields.pop("moe"))
    arch = ModelArchConfig(**shape_fields, moe=moe, num_layers=layers)
    attention = choose_attention_backend(device, dtype, arch.head_dim)
    with torch.device(device):
        model = LlamaForCausalLM(arch, dtype=dtype, attention=attention)
    model.to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
    return model.eval(), arch, attention


def step_bytes(model, arch, chosen_per_layer: list[int], batch: int, context: int) -> int:
    """Bytes a decode step must read: every weight but the embedding table (a row a token)
    and the experts no token chose; plus the context's K and V."""
    from zllm.executor.layers.moe.experts import ExpertMatrices

    expert_params = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, ExpertMatrices) and m.weight is not None
    }
    embed = model.embed_tokens
    tied = model.lm_head is None  # the logits read the whole table
    total = (embed.shape[0] if tied else batch) * embed.shape[1] * embed.element_size()
    for p in model.parameters():
        if id(p) not in expert_params and p is not embed:
            total += p.numel() * p.element_size()
    element = embed.element_size()
    per_expert = 3 * arch.hidden_size * arch.moe.moe_intermediate_size * element
    total += sum(chosen_per_layer) * per_expert
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * element
    return total + batch * (context + 1) * kv_per_token


def chosen_experts(model, run_step) -> list[int]:
    """Distinct experts each MoE layer's tokens chose in one run of the step."""
    from zllm.executor.layers.moe.block import MoEBlock
    from zllm.executor.layers.moe.router import route

    counts: list[int] = []

    def hook(block, inputs, output):
        _, experts = route(block.gate(inputs[0]), block.top_k, block.rule)
        counts.append(int(experts.unique().numel()))

    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    handles = [b.register_forward_hook(hook) for b in blocks]
    run_step()
    for h in handles:
        h.remove()
    return counts


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    from zllm.executor.kernels import cuda_moe

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model, arch, attention = build(args.shape, args.layers, device, dtype)
    bandwidth = measured_bandwidth(device) if on_gpu else float("nan")
    block_size, ctx, max_batch = 16, args.context, max(args.batches)
    caches, blocks_per_seq = random_caches(arch, max_batch, ctx, block_size, dtype, device)
    runner = captured_graphs(model, caches, arch, max_batch, block_size) if on_gpu else None
    timer = (lambda fn: time_events(fn, args.repeats)) if on_gpu else (lambda fn: timed(fn, 3))
    rows = []
    for b in args.batches:
        tables = [
            list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(b)
        ]
        slots = [t[ctx // block_size] * block_size + ctx % block_size for t in tables]
        meta = attention.build_metadata([1] * b, [ctx + 1] * b, tables, slots, block_size, device)
        ids = torch.randint(0, arch.vocab_size, (b,), device=device)
        pos = torch.full((b,), ctx, dtype=torch.int64, device=device)

        def eager(ids=ids, pos=pos, meta=meta):
            model.compute_logits(model(ids, pos, caches, meta)).argmax(-1)

        chosen = chosen_experts(model, eager)
        floor = step_bytes(model, arch, chosen, b, ctx) / bandwidth
        cuda_moe.ENABLED = False
        per_expert = timer(eager)
        cuda_moe.ENABLED = True
        kernel = timer(eager)
        row = dict(batch=b, experts_chosen_per_layer=statistics.mean(chosen),
                   per_expert_eager_ms=1000 * per_expert, kernel_eager_ms=1000 * kernel,
                   bytes_floor_ms=1000 * floor)  # fmt: skip
        line = (
            f"batch {b:4d}: {row['experts_chosen_per_layer']:6.1f} experts/layer  eager "
            f"per-expert {1000 * per_expert:8.3f} ms  kernel {1000 * kernel:8.3f} ms"
        )
        if runner is not None:

            def graph(ids=ids, pos=pos, meta=meta):
                model.compute_logits(runner.run(ids, pos, meta)).argmax(-1)

            g = timer(graph)
            row["kernel_graph_ms"] = 1000 * g
            line += f"  graph {1000 * g:8.3f} ms  floor {1000 * floor:7.3f} ms  graph / floor {g / floor:5.2f}x"
        print(line, flush=True)
        rows.append(row)
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    return dict(shape=args.shape, layers=args.layers, device=name, torch=torch.__version__,
                context=ctx, hbm_bytes_per_s=bandwidth, rows=rows)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8, help="of the model's 48")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    result = run(args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
