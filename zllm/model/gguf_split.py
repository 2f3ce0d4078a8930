"""llama.cpp's split GGUF files (`gguf-split`: `NAME-00001-of-00003.gguf`, ...) joined into one.

Each part is a whole GGUF file, not a slice of bytes: the first carries the model's metadata,
every part a run of the tensors, and every part split.no / split.count /
split.tensors.count. So joining is not concatenation: it writes one header (the first part's
metadata less the split.* keys, then every part's tensor infos with offsets into one data
section) and then each part's tensor bytes, as `gguf-split --merge` does. Every reader
(weights, tokenizer, architecture) then sees one file, as it does for any other GGUF.

    part 1: header(meta + split.*, tensors A) | A's data
    part 2: header(split.*, tensors B)        | B's data        ->  header(meta, A + B) | A | B

No torch here.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

from zllm.model.gguf import GGUFFile, GGUFTensorInfo, read_gguf
from zllm.model.progress import Progress

logger = logging.getLogger(__name__)

# llama.cpp's llama_split_path: "%s-%05d-of-%05d.gguf".
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_DEFAULT_ALIGNMENT = 32

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALAR_BYTES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


@dataclass(frozen=True, slots=True)
class SplitName:
    """What a part's file name says: the common prefix, its number (from 1) and the count."""

    prefix: str
    index: int
    count: int

    def part(self, index: int) -> str:
        return f"{self.prefix}-{index:05d}-of-{self.count:05d}.gguf"

    @property
    def parts(self) -> list[str]:
        return [self.part(i) for i in range(1, self.count + 1)]

    @property
    def joined(self) -> str:
        """The joined file's name: the prefix's last component, as a .gguf."""
        return self.prefix.rsplit("/", 1)[-1] + ".gguf"


def split_name(name: str) -> SplitName | None:
    """The split a file (or repo path) belongs to, None for a file that is not a part."""
    match = _SPLIT_NAME.match(name)
    if match is None:
        return None
    index, count = int(match["index"]), int(match["count"])
    return SplitName(match["prefix"], index, count) if 1 <= index <= count else None


def join_split_gguf(parts: Sequence[str | Path], out: str | Path) -> None:
    """Write `parts` (in order) as one GGUF file at `out`, which appears only once complete."""
    files = [read_gguf(str(p)) for p in parts]
    _check_parts(files)
    alignment = files[0].metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    tensors = [(f.path, info) for f in files for info in f.tensors.values()]
    header = bytearray()
    with open(files[0].path, "rb") as f:
        version = _U32.unpack(f.read(8)[4:])[0]
    kv = _metadata_without_split_keys(files[0])
    header += b"GGUF" + _U32.pack(version) + _U64.pack(len(tensors)) + _U64.pack(len(kv))
    header += b"".join(kv)
    offset = 0
    for _, info in tensors:
        header += _tensor_info_bytes(info, offset)
        offset = _aligned(offset + info.nbytes, alignment)
    header += bytes(_aligned(len(header), alignment) - len(header))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as dst:
            dst.write(header)
            _copy_tensor_data(
                tensors, dst, alignment, f"Joining {len(files)} parts into {out.name}"
            )
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _check_parts(files: list[GGUFFile]) -> None:
    """Every part there, in order, each saying so in its split.* keys."""
    for i, part in enumerate(files):
        count, no = part.metadata.get("split.count"), part.metadata.get("split.no")
        if count != len(files) or no != i:
            raise ValueError(
                f"{part.path} says it is part {no} (from 0) of {count} (split.no, "
                f"split.count), but was given as part {i} of {len(files)}"
            )


def _metadata_without_split_keys(part: GGUFFile) -> list[bytes]:
    """The raw bytes of each metadata entry of `part` but the split.* ones (copied, not
    re-encoded, so every value keeps its exact type)."""
    # The metadata ends before the first tensor's data (or the file's end, without tensors).
    end = min((t.offset for t in part.tensors.values()), default=os.path.getsize(part.path))
    with open(part.path, "rb") as f:
        data = f.read(end)
    entries = _metadata_entries(data)
    return [data[start:stop] for key, start, stop in entries if key not in _SPLIT_KEYS]


def _metadata_entries(data: bytes) -> Iterator[tuple[str, int, int]]:
    """(key, start, end) of each metadata entry; the layout is in zllm/model/gguf.py."""
    n_kv = _U64.unpack_from(data, 16)[0]
    pos = 24
    for _ in range(n_kv):
        start = pos
        length = _U64.unpack_from(data, pos)[0]
        key = data[pos + 8 : pos + 8 + length].decode("utf-8")
        pos += 8 + length
        value_type = _U32.unpack_from(data, pos)[0]
        pos = _skip_value(data, pos + 4, value_type)
        yield key, start, pos


def _skip_value(data: bytes, pos: int, value_type: int) -> int:
    if value_type == GGUFValueType.STRING:
        return pos + 8 + _U64.unpack_from(data, pos)[0]
    if value_type in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[value_type]
    if value_type != GGUFValueType.ARRAY:
        raise ValueError(f"unknown metadata value type {value_type}")
    item_type, count = _U32.unpack_from(data, pos)[0], _U64.unpack_from(data, pos + 4)[0]
    pos += 12
    if item_type in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[item_type] * count
    for _ in range(count):
        pos = _skip_value(data, pos, item_type)
    return pos


def _tensor_info_bytes(info: GGUFTensorInfo, offset: int) -> bytes:
    name = info.name.encode("utf-8")
    ne = tuple(reversed(info.shape))  # GGUF order: columns first
    return b"".join(
        [
            _U64.pack(len(name)),
            name,
            _U32.pack(len(ne)),
            *(_U64.pack(n) for n in ne),
            _U32.pack(int(info.ggml_type)),
            _U64.pack(offset),
        ]
    )


def _copy_tensor_data(
    tensors: list[tuple[str, GGUFTensorInfo]], dst, alignment: int, description: str
) -> None:
    total = sum(info.nbytes for _, info in tensors)
    written = 0
    with Progress(description, total=total, unit="B", logger=logger) as progress:
        for name, info in tensors:
            with open(name, "rb") as src:
                src.seek(info.offset)
                left = info.nbytes
                while left:
                    block = src.read(min(left, 1 << 22))
                    if not block:
                        raise ValueError(f"{name} ends inside tensor {info.name!r}")
                    dst.write(block)
                    left -= len(block)
                    progress.advance(len(block))
            written += info.nbytes
            pad = _aligned(written, alignment) - written
            dst.write(bytes(pad))
            written += pad


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment
