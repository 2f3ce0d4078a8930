"""zllm's logits against transformers' at every prompt position, on one model directory.

Greedy tokens are a weak check on random weights (near-ties everywhere), so this compares the
whole distributions: for each position, the largest absolute logit difference and the KL
divergence KL(transformers || zllm), with transformers computing in fp32 on the checkpoint's
weights. zllm runs as `zllm serve` would load the directory (a bf16/fp16 checkpoint keeps its
matrices 16-bit, widened in the CPU kernel), through its model's own forward over a paged KV
cache (one prefill of each prompt). A GGUF file: transformers dequantizes it to fp32, zllm
reads its blocks with `--quantization` (default: the engine's default, `gguf`), each position
scored with the arithmetic decode gives it (the matmuls that take integer dots at one row take
them at every size, as `zllm bench accuracy` scores).

    python benchmarks/logits_parity.py MODEL_DIR [--prompts 4] [--length 256]
    python benchmarks/logits_parity.py FILE.gguf [--quantization gguf-float] [--config HF_DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


@torch.inference_mode()
def zllm_logits(llm, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] fp32: the engine's model over a fresh paged cache, one prefill."""
    from zllm.executor.attention.paged import AttentionMetadata

    model = llm.model_runner.model
    arch = model.arch
    block_size = 16
    num_blocks = (len(prompt) + block_size - 1) // block_size
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    caches = [torch.zeros(shape) for _ in range(arch.num_layers)]
    meta = AttentionMetadata.build(
        query_lens=[len(prompt)],
        seq_lens=[len(prompt)],
        block_tables=[list(range(num_blocks))],
        slot_mapping=list(range(len(prompt))),
        block_size=block_size,
        device="cpu",
    )
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), caches, meta)
    return model.compute_logits(hidden).float()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--quantization", default=None)
    parser.add_argument(
        "--config",
        default=None,
        help="a GGUF file's Hugging Face config directory for transformers (its GGUF reader "
        "drops what the file does not name, e.g. Llama 3's RoPE scaling)",
    )
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from zllm import LLM
    from zllm.executor.kernels import cpu as cpu_kernels

    torch.manual_seed(0)
    llm = LLM(
        args.model,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=args.length + 16,
        quantization=args.quantization,
    )
    if llm.model_runner.quantization in ("gguf", "gguf-int8"):
        from zllm.executor.kernels.gguf_arithmetic import ALL_ROWS
        from zllm.executor.weights.quantization import set_int8_max_rows

        set_int8_max_rows(llm.model_runner.model, ALL_ROWS)
    vocab = llm.config.arch.vocab_size
    prompts = [torch.randint(3, vocab, (args.length,)).tolist() for _ in range(args.prompts)]
    ours = [zllm_logits(llm, p) for p in prompts]
    method = llm.model_runner.quantization
    del llm
    if args.model.endswith(".gguf"):
        path = Path(args.model)
        config = None if args.config is None else AutoConfig.from_pretrained(args.config)
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=config, dtype=torch.float32
        ).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    max_diffs, kls, agree = [], [], 0
    with torch.inference_mode():
        for prompt, mine in zip(prompts, ours, strict=True):
            theirs = hf(torch.tensor([prompt])).logits[0].float()
            max_diffs += (theirs - mine).abs().amax(-1).tolist()
            p_log, q_log = theirs.log_softmax(-1), mine.log_softmax(-1)
            kls += (p_log.exp() * (p_log - q_log)).sum(-1).tolist()
            agree += int((theirs.argmax(-1) == mine.argmax(-1)).sum())
    positions = len(max_diffs)
    result = {
        "model": args.model,
        "zllm_weights": method,
        "cpu_isa": cpu_kernels.cpu_isa(),
        "positions": positions,
        "max_abs_logit_diff": {"median": statistics.median(max_diffs), "max": max(max_diffs)},
        "kl": {"median": statistics.median(kls), "max": max(kls)},
        "argmax_agree": agree / positions,
    }
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
