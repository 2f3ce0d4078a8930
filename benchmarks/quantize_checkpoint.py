"""Quantize a bf16 Hugging Face directory into a compressed-tensors checkpoint as llm-compressor
writes one (round-to-nearest, data-free; tests/quant_checkpoints.py does the writing through
compressed-tensors' own API), for issue 59's speed and memory goals on a real shape.

    python benchmarks/quantize_checkpoint.py BASE_DIR OUT_DIR --scheme W4A16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from quant_checkpoints import CT_SCHEMES, write_compressed_tensors  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--scheme", choices=CT_SCHEMES, default="W4A16")
    args = parser.parse_args()
    write_compressed_tensors(args.out, args.scheme, base=args.base)
    print(f"wrote {args.out} ({args.scheme})")


if __name__ == "__main__":
    main()
