"""What dropping the fp32 weight copies costs prefill (issue 20, goal 4): the GGUF kernel's
panel path against MKL on fp32 copies, for calls of many rows.

1. Per layer: the four matmuls of layer 0 (qkv, o, gate/up, down) at 3 to 2,048 rows,
   `cpu_kernels.gguf_linear` on the file's blocks vs `F.linear` on their dequantized copy
   (best of 5).
2. End to end, in one process: `LLM(model)` prefills PROMPTS random prompts of INPUT_LEN
   tokens (max_tokens=1, no prefix caching) with the engine as it is (blocks for every call)
   and with the old path emulated (calls of more than 256 rows go to `F.linear` on copies),
   alternating for ROUNDS rounds.

    OMP_NUM_THREADS=2 python benchmarks/gguf_prefill.py            # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from zllm import LLM, SamplingParams
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.layers.linear.gguf import GGUFLinear

OLD_MAX_KERNEL_ROWS = 256  # the old path: more rows than this used the fp32 copy


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def per_layer(llm: LLM) -> None:
    layer = llm.model_runner.model.layers[0]
    mods = [
        layer.self_attn.qkv_proj, layer.self_attn.o_proj,
        layer.mlp.gate_up_proj, layer.mlp.down_proj,
    ]  # fmt: skip
    copies = [cpu_kernels.gguf_dequantize(m.qweight, m.ggml_type, m.in_features) for m in mods]
    for rows in (3, 64, 256, 512, 1024, 2048):
        kernel = gemm = 0.0
        for m, w in zip(mods, copies, strict=True):
            x = torch.randn(rows, m.in_features)
            kernel += best_of(lambda m=m, x=x: cpu_kernels.gguf_linear(x, m.qweight, m.ggml_type))
            gemm += best_of(lambda w=w, x=x: F.linear(x, w))
        print(f"rows {rows}: kernel {kernel * 1e3:.2f} ms, fp32 GEMM {gemm * 1e3:.2f} ms per "
              f"layer, kernel/GEMM {kernel / gemm:.2f}")  # fmt: skip


def end_to_end(llm: LLM, args: argparse.Namespace) -> None:
    mods = [m for m in llm.model_runner.model.modules() if isinstance(m, GGUFLinear)]
    copies = {
        id(m): cpu_kernels.gguf_dequantize(m.qweight, m.ggml_type, m.in_features) for m in mods
    }
    blocks_forward = GGUFLinear.forward

    def copy_forward(self: GGUFLinear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > OLD_MAX_KERNEL_ROWS:
            return F.linear(x, copies[id(self)], self.bias)
        return blocks_forward(self, x)

    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    results: dict[str, list[float]] = {"blocks": [], "fp32 copy": []}
    try:
        for _ in range(args.rounds):
            for name, forward in (("blocks", blocks_forward), ("fp32 copy", copy_forward)):
                GGUFLinear.forward = forward
                prompts = [
                    {"prompt_token_ids": rng.integers(256, 49000, args.input_len).tolist()}
                    for _ in range(args.prompts)
                ]
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                results[name].append(time.perf_counter() - start)
    finally:
        GGUFLinear.forward = blocks_forward
    for name, times in results.items():
        each = ", ".join(f"{t:.2f}" for t in times)
        print(f"prefill {args.prompts} x {args.input_len}: {name}: {each} s, median "
              f"{statistics.median(times):.2f} s")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    llm = LLM(args.model, max_num_seqs=64, enable_prefix_caching=False)
    per_layer(llm)
    end_to_end(llm, args)


if __name__ == "__main__":
    main()
