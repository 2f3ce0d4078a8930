"""llama.cpp's convert_hf_to_gguf.py for a random-weight shape with SmolLM2's tokenizer whose
architecture's converter class reads only its own family's BPE tokenizer (it checks the
pre-tokenizer's hash against the real ones: Qwen3.5's here). Only the pre-tokenizer's name
is given (SmolLM2's, "smollm", which llama.cpp knows); the vocabulary, tensors and metadata
are the converter's.

    python benchmarks/convert_shape.py LLAMA_CPP_DIR HF_DIR [converter arguments...]
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    root, *args = sys.argv[1:]
    sys.path.insert(0, root)
    sys.path.insert(0, f"{root}/gguf-py")
    from conversion import qwen  # the converter's own package

    qwen.Qwen3NextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
    script = f"{root}/convert_hf_to_gguf.py"
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
