"""Greedy parity between two running `zllm serve` instances, through the HTTP API.

`record` sends 16 chat prompts (greedy, 48 tokens, top-5 logprobs) to one server and saves
the answers; `compare` sends the same prompts to another and reports, per prompt, equal
output or the first divergence: a near-tie flip when each side's token is in the other's
top-5 and the reference's logprob gap between the two is under the parity tests' tolerance,
a divergence otherwise. Made for the GPU: record on the CPU engine here, carry the JSON,
compare against the GPU engine there (benchmarks/gpu_figures.sh serve-parity): SmolLM2 in
fp32, where the answers must agree, and Gemma 3 in bf16 against fp32, where the statistic is
how far they agree.

    python benchmarks/serve_parity.py record --base-url http://127.0.0.1:8000 --out ref.json
    python benchmarks/serve_parity.py compare --base-url http://127.0.0.1:8000 --reference ref.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from chat_prompts import SMOLLM2_PROMPTS  # noqa: E402
from parity import TIE_TOLERANCE  # noqa: E402  (the parity tests' near-tie bound, nats)

MAX_TOKENS = 48


def answer(base_url: str, prompt: str, endpoint: str) -> dict:
    """One greedy completion: its tokens and each position's top-5 {token: logprob}.
    endpoint "chat" sends the prompt as a user turn, "completions" as raw text (for base
    models such as Gemma 3 270M, whose chat answers are not what it was trained for)."""
    # No "model" field: the server answers with the one model it serves.
    body = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    if endpoint == "chat":
        body |= {"messages": [{"role": "user", "content": prompt}], "logprobs": True}
        body["top_logprobs"] = 5
    else:
        body |= {"prompt": prompt, "logprobs": 5}
    request = urllib.request.Request(
        f"{base_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        logprobs = json.load(response)["choices"][0]["logprobs"]
    if endpoint == "completions":
        return {"prompt": prompt, "tokens": logprobs["tokens"], "top": logprobs["top_logprobs"]}
    content = logprobs["content"]
    return {
        "prompt": prompt,
        "tokens": [entry["token"] for entry in content],
        "top": [{t["token"]: t["logprob"] for t in entry["top_logprobs"]} for entry in content],
    }


def first_divergence(a: list[str], b: list[str]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def verdict(ours: dict, reference: dict) -> tuple[str, int | None]:
    """'equal', 'flip' (a near tie at the first divergence) or 'diverged', with its position."""
    k = first_divergence(ours["tokens"], reference["tokens"])
    if k is None:
        return "equal", None
    if k >= min(len(ours["tokens"]), len(reference["tokens"])):
        return "diverged", k  # one stopped where the other went on
    mine, theirs = ours["tokens"][k], reference["tokens"][k]
    ref_top, our_top = reference["top"][k], ours["top"][k]
    if (
        theirs in our_top
        and mine in ref_top
        and abs(ref_top[theirs] - ref_top[mine]) < TIE_TOLERANCE
    ):
        return "flip", k
    return "diverged", k


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["record", "compare"])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, help="record: where the answers go")
    parser.add_argument("--reference", type=Path, help="compare: a recorded JSON")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    args = parser.parse_args()
    answers = [answer(args.base_url, p, args.endpoint) for p in SMOLLM2_PROMPTS]
    if args.mode == "record":
        args.out.write_text(json.dumps(answers))
        print(f"recorded {len(answers)} answers to {args.out}")
        return 0
    references = json.loads(args.reference.read_text())
    counts = {"equal": 0, "flip": 0, "diverged": 0}
    agreed = []  # tokens equal before the first difference (the whole answer when equal)
    for i, (ours, ref) in enumerate(zip(answers, references, strict=True)):
        kind, k = verdict(ours, ref)
        counts[kind] += 1
        agreed.append(len(ref["tokens"]) if k is None else k)
        if k is not None:
            print(f"prompt {i}: {kind} at output position {k}")
    print(
        f"serve parity over {len(answers)} prompts: {counts['equal']} equal, "
        f"{counts['flip']} near-tie flips, {counts['diverged']} diverged; tokens equal before "
        f"the first difference: median {statistics.median(agreed)}, min {min(agreed)} "
        f"(of {MAX_TOKENS})"
    )
    return 0 if counts["diverged"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
