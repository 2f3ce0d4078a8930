"""The secret that authenticates the disk tier's block files (executor/kv/connector.py).

Each file carries an HMAC-SHA256 of its header and bytes under this key, so a file edited by
whoever can write `--kv-offload-dir` (with any checksum recomputed) fails its check, is
removed and recomputed, never loaded: a CRC catches accidents only. The key therefore lives
outside that directory: `--kv-offload-key-file`, or `$ZLLM_CACHE/kv-offload.key`, made at
first start with owner-only permissions (0600 in a 0700 directory) and kept across restarts,
so the files an engine wrote stay loadable after it restarts. Torch-free: the supervisor
and `LLM` resolve it before the executor starts.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from zllm.model.files import cache_dir

logger = logging.getLogger(__name__)

KEY_BYTES = 32
DEFAULT_KEY_FILE = "kv-offload.key"


def resolve_key_file(disk_dir: str, key_file: str | None) -> str:
    """The key file's absolute path, made (32 random bytes, 0600) if it does not exist;
    ValueError when it sits inside the disk tier's directory or cannot be read or made."""
    path = Path(key_file).expanduser() if key_file else cache_dir() / DEFAULT_KEY_FILE
    path = path.resolve()
    directory = Path(disk_dir).expanduser().resolve()
    if path == directory or directory in path.parents:
        raise ValueError(
            f"--kv-offload-key-file {path} is inside --kv-offload-dir {directory}: whoever can "
            "write the blocks must not hold the key that authenticates them"
        )
    if not path.exists():
        make_key_file(path, "--kv-offload-key-file")
        logger.info("KV disk tier: made the key that authenticates its files, %s", path)
    read_key(str(path))  # readable and long enough, or the engine does not start
    warn_if_shared(path, "KV disk tier key")
    return str(path)


def warn_if_shared(path: Path, what: str) -> None:
    """A warning when a key file is open to its group or to others: it still works, but
    whoever else can read it can forge what it authenticates."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        logger.warning("%s %s is readable by others (mode %o): chmod 600", what, path, mode)


def read_key(key_file: str, flag: str = "--kv-offload-key-file") -> bytes:
    try:
        key = Path(key_file).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {key_file}: cannot read it ({e})") from e
    if len(key) < KEY_BYTES:
        raise ValueError(f"{flag} {key_file}: {len(key)} bytes, at least {KEY_BYTES} needed")
    return key


def make_key_file(path: Path, flag: str) -> None:
    """32 random bytes, 0600 in a 0700 directory (errors name `flag`). Written whole under
    a temporary name, then linked into place: an engine starting at the same moment reads
    either no file or the whole key, never a part of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        os.link(tmp, path)
    except FileExistsError:
        return  # another engine made it first: use theirs
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create it ({e})") from e
    finally:
        tmp.unlink(missing_ok=True)
