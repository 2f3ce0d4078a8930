"""One gguf-py reader per GGUF file and one tensor-name map per architecture for the whole test
session.

transformers parses a GGUF's metadata with gguf-py's `GGUFReader` at every `from_pretrained`
(twice for a model: once for its config, once for its weights), and a tokenizer once more.
The parse walks every field in Python: ~23 s for Gemma 3's 262,144-token vocabulary on the
2-core machine, the biggest single cost of the non-e2e suite. The tests never change a model
file, so a file (same path, size and mtime) read read-only is parsed once and its reader
shared, and it is the engine's own faster reader (executor/weights/gguf_reading.py
`PlainMapGGUFReader`: a plain ndarray view of the same map, 23 s -> 7 s). transformers stays
the reference: it reads the same fields and tensors from the same reader. Its parameter-name
map builds gguf-py's `TensorNameMap` once per submodule of the model, hundreds of times a load
(most of a small model's): one map per architecture and layer count serves them all, as the
engine's own `gguf_parsed_once` does during a load.
"""

from __future__ import annotations

import functools
import os


def share_gguf_readers() -> None:
    """Make `gguf.GGUFReader(path)` (mode "r") return one parsed reader per file, and
    `gguf.get_tensor_name_map(arch, n)` one map per argument."""
    try:
        import gguf
    except ImportError:
        return
    if getattr(gguf.GGUFReader, "_zllm_shared", False):
        return

    from zllm.executor.weights.gguf_reading import PlainMapGGUFReader

    class SharedGGUFReader(PlainMapGGUFReader):
        _zllm_shared = True
        _readers: dict[tuple, SharedGGUFReader] = {}

        def __new__(cls, path, mode="r"):
            if mode != "r":
                return super().__new__(cls)
            stat = os.stat(path)
            key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
            reader = cls._readers.get(key)
            if reader is None:
                reader = cls._readers[key] = super().__new__(cls)
            return reader

        def __init__(self, path, mode="r"):
            if mode == "r" and getattr(self, "_zllm_parsed", False):
                return  # __new__ handed back a parsed reader: Python calls __init__ again
            super().__init__(path, mode)
            self._zllm_parsed = True

    gguf.GGUFReader = SharedGGUFReader
    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
