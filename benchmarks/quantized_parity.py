"""Each quantized checkpoint format zllm reads, against its reference: the tiny checkpoints of
tests/quant_checkpoints.py (compressed-tensors, GPTQ, AWQ, as their libraries write them),
zllm's logits (one prefill over the prompt and its greedy continuation) against transformers
loading the same checkpoint where it runs it on CPU, else against the dequantized weights.

    python benchmarks/quantized_parity.py [--cases ct-w4a16 awq-g128 ...] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from logits_parity import zllm_logits  # noqa: E402
from quant_checkpoints import CHECKPOINTS, reference_of, transformers_model  # noqa: E402

# The schemes whose own arithmetic rounds activations (int8 per token, fp8): beside the fp32-
# activation reference, zllm is also compared with transformers' rounding of them.
ACTIVATION_SCHEMES = ("ct-w8a8", "ct-fp8-dynamic", "ct-fp8-static")
PROMPTS = [[5, 17, 200, 33, 61, 90], [300, 2, 2, 48, 111, 7, 8, 9, 250, 13], [401, 66]]
CONTINUATION = 24


def compare(case: str, directory: Path) -> dict:
    """Max |logit difference|, KL(reference || zllm) and argmax agreement over every position
    of each prompt and its greedy continuation (zllm's)."""
    from zllm import LLM, SamplingParams

    path = CHECKPOINTS[case](directory / case)
    reference = reference_of(case, path)
    rounding = transformers_model(path) if case in ACTIVATION_SCHEMES else None
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    greedy = SamplingParams(max_tokens=CONTINUATION, temperature=0.0, ignore_eos=True)
    diffs, kls, agree, positions, rounded_kls = [], [], 0, 0, []
    for prompt in PROMPTS:
        out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
        sequence = prompt + list(out.outputs[0].token_ids)
        ours = zllm_logits(llm, sequence)
        with torch.inference_mode():
            theirs = reference(torch.tensor([sequence])).logits[0].float()
        diffs.append(float((ours - theirs).abs().max()))
        p_log, q_log = theirs.log_softmax(-1), ours.log_softmax(-1)
        kls += (p_log.exp() * (p_log - q_log)).sum(-1).tolist()
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        positions += len(sequence)
        if rounding is not None:
            with torch.inference_mode():
                r_log = rounding(torch.tensor([sequence])).logits[0].float().log_softmax(-1)
            rounded_kls += (r_log.exp() * (r_log - q_log)).sum(-1).tolist()
    return {
        "case": case,
        "max_logit_diff": max(diffs),
        "kl_median": statistics.median(kls),
        "kl_max": max(kls),
        "argmax_agree": agree / positions,
        "kl_vs_activation_rounding": statistics.median(rounded_kls) if rounded_kls else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CHECKPOINTS), choices=CHECKPOINTS)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for case in args.cases:
            rows.append(compare(case, Path(directory)))
            row = rows[-1]
            rounded = row["kl_vs_activation_rounding"]
            print(
                f"| {case} | {row['max_logit_diff']:.2e} | {row['kl_median']:.1e} / "
                f"{row['kl_max']:.1e} | {row['argmax_agree']:.1%} | "
                f"{'-' if rounded is None else f'{rounded:.1e}'} |",
                flush=True,
            )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
