"""Streaming one long tool call through each tool-call parser, a few characters at a time,
as the detokenizer's deltas arrive: the parser's total time for the call. A parser that
rescans the call from its start at every delta is quadratic in the call's length.

    python benchmarks/tool_parser_stream.py [--repeat 600] [--piece 4]

(To time another checkout's parsers: PYTHONPATH=that/checkout python this script.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import zllm.text.tool_parsers as tool_parsers


def calls(repeat: int) -> dict[str, str]:
    """One call per parser whose arguments hold a string with quotes and brackets."""
    text = 'lorem ipsum, "quoted" {braces} [x] ' * repeat
    args = json.dumps({"text": text})
    return {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>',
        "llama3_json": f'{{"name": "f", "parameters": {args}}}',
        "mistral": f"[TOOL_CALLS]f{args}",
        "pythonic": f"[f(text={text!r})]",
    }


def stream_time(name: str, text: str, piece: int) -> float:
    parser = tool_parsers.TOOL_PARSERS[name](None)
    start = time.perf_counter()
    for i in range(0, len(text), piece):
        parser.feed(text[i : i + piece])
    parser.finish()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=600, help="the string's 36-char units")
    parser.add_argument("--piece", type=int, default=4, help="characters per delta")
    args = parser.parse_args()
    print(f"parsers from {tool_parsers.__file__}")
    for name, text in calls(args.repeat).items():
        runs = [stream_time(name, text, args.piece) for _ in range(3)]
        print(
            f"{name:12s} {len(text)} chars in {args.piece}-char pieces: "
            f"{statistics.median(runs) * 1e3:.1f} ms (median of 3)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
