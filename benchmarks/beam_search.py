"""Beam search throughput: zllm's `LLM.beam_search` against transformers'
`generate(num_beams=W, do_sample=False)` on the same prompts, weights (the GGUF file,
dequantized by transformers) and machine, in one run. Prints a markdown table.

    python benchmarks/beam_search.py [--width 4] [--num-prompts 8] [--max-tokens 64]

zllm runs every prompt's beams in one continuous batch; transformers runs prompt by prompt
(its batch of W beams), as `generate` does for a single prompt. Output tokens counted are
the best hypothesis' tokens per prompt, for both.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from zllm import LLM, BeamSearchParams
from zllm.model.files import resolve_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three laws of thermodynamics are",
    "Translate to French: I like apples.",
    "A good breakfast should include",
    "The history of the printing press",
    "In Python, a list comprehension",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    path = resolve_model(args.model)
    llm = LLM(path)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.num_prompts)]
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens)
    llm.beam_search([{"prompt_token_ids": prompts[0]}], params)  # warm-up
    start = time.perf_counter()
    ours = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    zllm_s = time.perf_counter() - start
    zllm_tokens = sum(
        len(o.sequences[0].tokens) - len(p) for o, p in zip(ours, prompts, strict=True)
    )

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    eos = hf.generation_config.eos_token_id
    hf_tokens = 0
    same = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for p, o in zip(prompts, ours, strict=True):
            out = hf.generate(
                torch.tensor([p]),
                num_beams=args.width,
                do_sample=False,
                max_new_tokens=args.max_tokens,
                pad_token_id=eos,
            )[0, len(p) :].tolist()
            if eos in out:
                out = out[: out.index(eos) + 1]
            hf_tokens += len(out)
            same += out == o.sequences[0].tokens[len(p) :]
    hf_s = time.perf_counter() - start
    print(
        f"width {args.width}, {args.num_prompts} prompts, max_tokens {args.max_tokens}, "
        f"torch threads {torch.get_num_threads()}; best hypotheses equal: {same}/{len(prompts)}"
    )
    print("| engine | seconds | output tok/s | ratio |")
    print("|---|---|---|---|")
    print(f"| transformers generate | {hf_s:.2f} | {hf_tokens / hf_s:.1f} | 1.00x |")
    ratio = (zllm_tokens / zllm_s) / (hf_tokens / hf_s)
    print(f"| zllm LLM.beam_search | {zllm_s:.2f} | {zllm_tokens / zllm_s:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
