"""transformers' GGUF loading with each file parsed once, faster, and each tensor-name map
built once.

transformers reads a GGUF file through gguf-py, and repeats pure work:

- Every reader of the file parses it again: `AutoConfig`, the weights and the tokenizer each
  build a `gguf.GGUFReader`, whose metadata fields are built in Python, one numpy slice of the
  file's map per value and string: seconds for a vocabulary of tens of thousands of entries,
  most of it numpy's `memmap` bookkeeping on each of those slices.
- Its parameter-name map (`get_gguf_hf_weights_map`, which zllm also calls:
  executor/models/transformers/quant.py) recurses into every submodule and builds gguf-py's
  `TensorNameMap` of the whole model at each one: hundreds of times for one model.

Within `gguf_parsed_once()`, `gguf.GGUFReader(path)` gives one `PlainMapGGUFReader` per file
(the same fields and tensors, sliced from a plain ndarray view of the same read-only map) and
`gguf.get_tensor_name_map(arch, n)` one map per architecture and layer count: both are
functions of their arguments alone. Measured on the 2-core dev VM (2026-11-30, imports warm,
three runs alternated in one process): transformers' `AutoConfig`, `from_pretrained` and the
name map of SmolLM2's 138 MB GGUF 50.9 s without it, 5.2 s within it (medians); the whole
`LLM(path, model_impl="transformers")` 57.8 s -> 26.0 s.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np


class PlainMapGGUFReader(gguf.GGUFReader):
    """gguf-py's reader, its read-only map held as a plain ndarray view: the same bytes, read
    lazily from the same map, without memmap's `__array_finalize__` on each of the parse's
    slices (Gemma 3's 262,144-token vocabulary: 23 s -> 7 s)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        plain = isinstance(mapped, np.memmap) and mapped.mode == "r"
        self._plain_data = mapped.view(np.ndarray) if plain else mapped


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within it, `gguf.GGUFReader(path)` and `gguf.get_tensor_name_map(arch, n)` give one
    object per argument (transformers imports both names from gguf-py when it calls them).
    Re-entrant; the readers (and their mapped files) are released on leaving the outermost."""
    if getattr(gguf.GGUFReader, "_zllm_memoized", False):  # an outer one is in effect
        yield
        return
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    # (a subclass already installed, e.g. the test suite's shared reader, is kept)
    make = reader_cls if issubclass(reader_cls, PlainMapGGUFReader) else PlainMapGGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = make(path, mode)
        return readers[key]

    reader._zllm_memoized = True  # type: ignore[attr-defined]
    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map
        readers.clear()
