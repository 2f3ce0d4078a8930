"""For the tests of Hugging Face Hub ids (tests/test_hub.py), where the Hub cannot be reached:
a Hub cache written by hand, laid out as huggingface_hub lays it out (the library has no API
that fills its cache without the Hub; tests/test_hub.py checks its scan_cache_dir reads this
one), a GGUF file split as llama.cpp's gguf-split splits it, and a stand-in Hub on loopback
that answers as the Hub does for a missing, gated or unknown-revision repo.

    CACHE/models--org--name/
        blobs/<sha256>              each file's bytes, once
        refs/main                   the commit a branch or tag points at (no newline)
        snapshots/<commit>/<path>   -> ../../blobs/<sha256> (relative symlinks)
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter


def add_snapshot(
    cache: Path, repo_id: str, files: Mapping[str, Path], refs: Sequence[str] = ("main",)
) -> Path:
    """Put `files` (path in the repo -> a local file) into `cache` as one commit of
    `repo_id` that `refs` point at; returns the snapshot directory."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    digests = {
        name: hashlib.sha256(Path(src).read_bytes()).hexdigest() for name, src in files.items()
    }
    commit = hashlib.sha1(repr(sorted(digests.items())).encode()).hexdigest()
    snapshot = repo_dir / "snapshots" / commit
    for name, src in files.items():
        blob = repo_dir / "blobs" / digests[name]
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(Path(src).read_bytes())
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        ref_file = repo_dir / "refs" / ref
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        ref_file.write_text(commit)
    return snapshot


def files_of(directory: Path, names: Sequence[str] | None = None) -> dict[str, Path]:
    """A directory's files (or those `names`) by their path in it."""
    found = {p.relative_to(directory).as_posix(): p for p in directory.rglob("*") if p.is_file()}
    return found if names is None else {n: found[n] for n in names}


def write_split_gguf(source: Path, out: Path, max_tensors: int) -> list[Path]:
    """`source` split by gguf-py's writer as llama.cpp's gguf-split splits it (at most
    `max_tensors` tensors a part, NAME-00001-of-0000N.gguf beside `out`); the parts, in order."""
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch, split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    floats = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    for tensor in reader.tensors:
        raw = None if tensor.tensor_type in floats else tensor.tensor_type
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))


class StubHub:
    """An HTTP server on loopback standing in for the Hub: each request is answered with
    `status` and the X-Error-Code the Hub sends (RepoNotFound, GatedRepo, RevisionNotFound),
    from which huggingface_hub raises its own errors; with `siblings`, a repo's model info
    (GET /api/models/ORG/NAME[/revision/REV]) answers 200 listing those files first.
    `requests` holds every path asked for."""

    def __init__(self, status: int, error_code: str, siblings: Sequence[str] | None = None):
        self.requests: list[str] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub.requests.append(self.path)
                info = self.path.startswith("/api/models/") and "/tree/" not in self.path
                if siblings is not None and info:
                    repo = "/".join(self.path.split("?")[0].split("/")[3:5])
                    body = json.dumps(
                        {
                            "id": repo,
                            "sha": "0" * 40,
                            "private": False,
                            "siblings": [{"rfilename": name} for name in siblings],
                        }
                    ).encode()
                    self._answer(200, body, {"Content-Type": "application/json"})
                else:
                    body = json.dumps({"error": error_code}).encode()
                    headers = {"X-Error-Code": error_code, "X-Error-Message": error_code}
                    self._answer(status, body, {"Content-Type": "application/json", **headers})

            do_HEAD = do_GET

            def _answer(self, code: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, *args) -> None:  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> StubHub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
