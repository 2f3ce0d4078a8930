"""A model's weights fingerprint: what KV blocks computed by it are named by, on disk and on
the wire.

KV blocks on disk (`--kv-offload-dir`, zllm/kv/tiers.py) and blocks sent between servers
(`--kv-transfer-config`, executor/kv/transfer.py) hold K and V that only the exact weights
that computed them may reuse. A file's name and size, or a directory's config.json, do not
tell two models apart: weights replaced in place, or another model of the same name and
size, would serve stale or foreign KV. So the fingerprint is SHA-256 over the contents of
every file that defines the model (a GGUF file; a directory's weights files and config.json).

Hashing reads every byte once (about 1 GB/s here: 0.1 s for SmolLM2's 98 MB, seconds for a
multi-GB model), so each file's digest is cached in `$ZLLM_CACHE/fingerprints.json` under
its path, inode, size and modification and change times: a restart, or the core and executor
processes of one server, hash nothing again, and a file written in any way is hashed anew
(its change time moves with every write, and unlike the modification time no user can set
it back).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from zllm.model.files import cache_dir

logger = logging.getLogger(__name__)

CACHE_FILE = "fingerprints.json"
# The files of a model directory whose bytes decide its KV: weights in every format we load,
# and the config that shapes them.
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_CHUNK = 8 << 20


def weights_fingerprint(model_path: str) -> str:
    """16 hex digits naming the model's weights by their contents (and its files' names)."""
    path = Path(model_path).expanduser()
    files = _model_files(path)
    if not files:  # no file to read (--load-format dummy with a bare name): the name itself
        return hashlib.sha256(str(model_path).encode()).hexdigest()[:16]
    cache = _DigestCache()
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + cache.digest(file).encode())
    cache.save()
    return digest.hexdigest()[:16]


def _model_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(
        p
        for p in path.iterdir()
        if p.is_file() and (p.name == "config.json" or p.suffix in _MODEL_FILE_SUFFIXES)
    )


class _DigestCache:
    """File digests by (resolved path, inode, size, mtime, ctime), kept in $ZLLM_CACHE."""

    def __init__(self) -> None:
        self.path = cache_dir() / CACHE_FILE
        try:
            self.entries: dict[str, str] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def digest(self, file: Path) -> str:
        stat = file.stat()
        key = f"{file.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"
        found = self.entries.get(key)
        if found is None:
            sha = hashlib.sha256()
            with open(file, "rb") as f:
                while chunk := f.read(_CHUNK):
                    sha.update(chunk)
            found = self.entries[key] = sha.hexdigest()
            self.changed = True
        return found

    def save(self) -> None:
        """Written whole and renamed into place; a cache that cannot be written is skipped
        (the next start hashes again)."""
        if not self.changed:
            return
        tmp = self.path.with_name(f".{CACHE_FILE}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("weights fingerprints not cached in %s: %s", self.path, e)
