"""A GGUF file's header, read here rather than with gguf.GGUFReader: that reader builds a
numpy view per array element and takes seconds on a 49k-token vocabulary, and every process
reads the header. The layout (little-endian, GGUF v2/v3):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment | tensor data (offsets relative to here)

No torch here.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order, rows first: GGUF's ne list reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(slots=True)
class GGUFFile:
    """A parsed header over a read-only mmap. Shared through read_gguf's cache: don't mutate."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    _buffer: mmap.mmap

    def release_pages(self) -> None:
        """Unmap the pages of the file this process has read (they come back from the page
        cache if read again): once the weights are copied out, the file need not count in
        the resident set."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._buffer.madvise(mmap.MADV_DONTNEED)

    def tensor_data(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as uint8, shaped (rows..., bytes_per_row); no copy."""
        info = self.tensors[name]
        data = np.frombuffer(self._buffer, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], -1)


class _Truncated(Exception):
    pass


_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_U32, _U64 = _SCALARS[GGUFValueType.UINT32], _SCALARS[GGUFValueType.UINT64]


class _Cursor:
    """Bounds-checked sequential reads, so a short file fails with a reason, not garbage."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated(f"file ends at byte {len(self.buf)}, needed {self.pos + n}")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: struct.Struct) -> Any:
        return fmt.unpack_from(self.buf, self.take(fmt.size))[0]

    def string(self) -> str:
        n = self.scalar(_U64)
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if depth > 4:  # the format allows arrays of arrays; real files nest one level at most
            raise ValueError("metadata arrays nested too deeply")
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        item_type, count = self.scalar(_U32), self.scalar(_U64)
        if item_type == GGUFValueType.STRING or item_type == GGUFValueType.ARRAY:
            return [self.value(item_type, depth + 1) for _ in range(count)]
        if item_type not in _SCALARS:
            raise ValueError(f"unknown array item type {item_type}")
        fmt = _SCALARS[item_type]
        start = self.take(fmt.size * count)
        # One numpy call instead of a struct call per element: vocabularies are big.
        dtype = np.dtype(fmt.format)
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()


def invalid_gguf(path: str, reason: str) -> ValueError:
    return ValueError(f"{path} is not a valid GGUF model file: {reason}")


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF header; raise ValueError naming the file for anything malformed."""
    path = str(path)
    stat = os.stat(path)
    return _read_gguf_cached(os.path.realpath(path), stat.st_mtime_ns, stat.st_size, path)


@functools.lru_cache(maxsize=2)
def _read_gguf_cached(real: str, mtime_ns: int, size: int, shown: str) -> GGUFFile:
    # Cached because one process often reads arch config, tokenizer and weights in a row.
    if size < 24:
        raise invalid_gguf(shown, f"only {size} bytes long")
    with open(real, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf, shown)
    except _Truncated as e:
        raise invalid_gguf(shown, f"truncated ({e})") from None
    except (ValueError, UnicodeDecodeError, OverflowError) as e:
        raise invalid_gguf(shown, str(e)) from None


def _parse(buf: mmap.mmap, path: str) -> GGUFFile:
    cur = _Cursor(buf)
    if buf[:4] != b"GGUF":
        raise ValueError(f"bad magic {bytes(buf[:4])!r}, expected b'GGUF'")
    cur.take(4)
    version = cur.scalar(_U32)
    if version not in (2, 3):
        raise ValueError(
            f"unsupported GGUF version {version} (zllm reads v2 and v3, little-endian)"
        )
    n_tensors, n_kv = cur.scalar(_U64), cur.scalar(_U64)
    # Each entry takes at least 8 bytes, so larger counts can only come from corruption.
    if n_tensors > len(buf) // 8 or n_kv > len(buf) // 8:
        raise ValueError(
            f"{n_tensors} tensors and {n_kv} metadata keys cannot fit in {len(buf)} bytes "
            f"(truncated or corrupt)"
        )
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar(_U32))
    raw_infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.scalar(_U32)
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        ne = [cur.scalar(_U64) for _ in range(n_dims)]
        raw_infos.append((name, ne, cur.scalar(_U32), cur.scalar(_U64)))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, ne, type_id, offset in raw_infos:
        info = _tensor_info(name, ne, type_id, data_start + offset)
        if info.offset + info.nbytes > len(buf):
            raise _Truncated(f"tensor {name!r} ends at byte {info.offset + info.nbytes}")
        tensors[name] = info
    return GGUFFile(path, metadata, tensors, buf)


def _tensor_info(name: str, ne: list[int], type_id: int, offset: int) -> GGUFTensorInfo:
    try:
        ggml_type = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {name!r} has unknown ggml type {type_id}") from None
    if not ne or ne[0] % block_size:
        raise ValueError(f"tensor {name!r} shape {ne} does not fit {ggml_type.name} blocks")
    nbytes = int(np.prod(ne, dtype=np.uint64)) // block_size * type_size
    return GGUFTensorInfo(name, tuple(reversed(ne)), ggml_type, offset, nbytes)
