"""One gguf-py reader per GGUF file for the whole test session.

transformers parses a GGUF's metadata with gguf-py's `GGUFReader` at every `from_pretrained`
(twice for a model: once for its config, once for its weights), and a tokenizer once more.
The parse walks every field in Python: ~23 s for Gemma 3's 262,144-token vocabulary on the
2-core machine, the biggest single cost of the non-e2e suite. The tests never change a model
file, so a file (same path, size and mtime) read read-only is parsed once and its reader
shared. Most of a parse is numpy's `memmap` subclass bookkeeping on each of its ~6 million
slices; the shared reader slices a plain ndarray view of the same mapping instead (the same
bytes, read lazily from the same map: 23 s -> 7 s). transformers stays the reference: it
reads the same fields and tensors from the same reader.
"""

from __future__ import annotations

import os

import numpy as np


def share_gguf_readers() -> None:
    """Make `gguf.GGUFReader(path)` (mode "r") return one parsed reader per file."""
    try:
        import gguf
    except ImportError:
        return
    if getattr(gguf.GGUFReader, "_zllm_shared", False):
        return

    class SharedGGUFReader(gguf.GGUFReader):
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

        @property
        def data(self) -> np.ndarray:
            return self._zllm_data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            # A read-only map as a plain ndarray: its slices skip memmap's __array_finalize__.
            plain = isinstance(mapped, np.memmap) and mapped.mode == "r"
            self._zllm_data = mapped.view(np.ndarray) if plain else mapped

        def __init__(self, path, mode="r"):
            if mode == "r" and getattr(self, "_zllm_parsed", False):
                return  # __new__ handed back a parsed reader: Python calls __init__ again
            super().__init__(path, mode)
            self._zllm_parsed = True

    gguf.GGUFReader = SharedGGUFReader
