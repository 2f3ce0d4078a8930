"""Hugging Face Hub ids as models and tokenizers, resolved to local paths before any process
starts (zllm/model/files.py asks here for what is neither a short name nor a local path):

    org/name                a repo in Hugging Face layout (config.json, *.safetensors,
                            tokenizer.json); a repo without config.json but with GGUF files
                            gives its only GGUF file, else its Q4_K_M one (llama-server's
                            default)
    org/name:Q4_K_M         the GGUF file of that quantization, as llama-server's `-hf`: the
                            tag, in any case, ends the file's name (`Name-Q4_K_M.gguf`,
                            `name.q4_k_m.gguf`) or names its folder
    org/name/dir/file.gguf  that file

huggingface_hub fetches into its cache (HF_HUB_CACHE, or `download_dir`) only the files the
engine reads, with its own progress bars, and reads HF_TOKEN and HF_ENDPOINT itself. With
HF_HUB_OFFLINE=1, or when the Hub cannot be reached, the cache's snapshot of the revision
serves. A split GGUF file's parts (`-00001-of-00003.gguf`) are all fetched; files.py joins
them. Every failure is a HubError: one line naming the id and what to do.

huggingface_hub is imported inside the functions: processes that never resolve an id never
load it.
"""

from __future__ import annotations

import glob
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from zllm.model.gguf_split import split_name

logger = logging.getLogger(__name__)

# What the engine reads of a repo in Hugging Face layout, at its top level: the tokenizer and
# chat template (zllm/text/tokenizer.py), the architecture (zllm/model/arch.py), sampling
# defaults (zllm/config/generation.py) and the weights (executor/weights/loader.py).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MODEL_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
# The GGUF file picked from a repo of several when the id names none (llama-server's choice).
DEFAULT_GGUF_TAG = "Q4_K_M"

_NAME = r"[A-Za-z0-9][\w.-]*"
_HUB_REF = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?::(?P<tag>[\w.-]+)|/(?P<file>[^:\\]+\.gguf))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHOWN_FILES = 8  # files named in a refusal, at most


class HubError(ValueError):
    """A Hub id that cannot be resolved; the message names the id and what to do."""


@dataclass(frozen=True, slots=True)
class HubRef:
    """A Hub id, parsed: the repo and what it names in it."""

    spec: str  # as the user wrote it
    repo_id: str
    tag: str | None = None  # org/name:TAG
    filename: str | None = None  # org/name/FILE.gguf


def parse_hub_ref(spec: str) -> HubRef | None:
    """The Hub id `spec` spells, None for anything else (a path, a short name)."""
    match = _HUB_REF.fullmatch(spec)
    if match is None:
        return None
    return HubRef(spec, match["repo"], match["tag"], match["file"])


def resolve_hub_model(
    ref: HubRef, revision: str | None, download_dir: str | None, *, tokenizer_only: bool = False
) -> str:
    """The local path of what `ref` names: the snapshot directory of a Hugging Face-layout
    repo, or a GGUF file in it (a split file's first part), fetching what the cache lacks.
    `tokenizer_only`: of a Hugging Face-layout repo, only the tokenizer's files."""
    listing = _list_repo(ref, revision, download_dir)
    files, entry = _choose_files(ref, listing, tokenizer_only)
    snapshot = listing.snapshot or _download(ref, revision, download_dir, files)
    missing = [f for f in files if not (snapshot / f).is_file()]
    if missing:  # fetched, yet not there: a cache changed under us
        raise HubError(f"{ref.spec}: {_names(missing)} missing from {snapshot}; run again")
    path = snapshot / entry if entry else snapshot
    logger.info("%s: %s", ref.spec, path)
    return str(path)


# ---------------------------------------------------------------------------------------------
# What the repo holds: on the Hub, else in the cache


@dataclass(frozen=True, slots=True)
class _Listing:
    files: tuple[str, ...]  # paths in the repo at the revision
    snapshot: Path | None  # the cached snapshot holding them; None: on the Hub, to fetch
    where: str  # for messages


def _list_repo(ref: HubRef, revision: str | None, cache_dir: str | None) -> _Listing:
    import huggingface_hub
    from huggingface_hub import constants, errors

    if constants.HF_HUB_OFFLINE:
        reason = "HF_HUB_OFFLINE is set"
    else:
        try:
            info = huggingface_hub.HfApi().model_info(ref.repo_id, revision=revision)
        except errors.GatedRepoError:
            raise _gated(ref) from None
        except errors.RepositoryNotFoundError:
            raise _not_found(ref) from None
        except errors.RevisionNotFoundError:
            raise HubError(
                f"{ref.spec}: {ref.repo_id} has no revision {revision!r} on the Hugging Face "
                f"Hub; give a branch, tag or commit hash it has"
            ) from None
        except Exception as e:  # no network, the Hub down, a proxy: the cache may serve
            reason = f"the Hugging Face Hub could not be reached ({_one_line(e)})"
        else:
            files = tuple(sibling.rfilename for sibling in info.siblings or ())
            return _Listing(files, None, "on the Hugging Face Hub")
    snapshot = _cached_snapshot(ref, revision, cache_dir, reason)
    logger.info("%s: %s; using the cached snapshot %s", ref.spec, reason, snapshot)
    files = tuple(
        sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    )
    return _Listing(files, snapshot, "in the Hugging Face cache")


def _cached_snapshot(ref: HubRef, revision: str | None, cache_dir: str | None, reason: str) -> Path:
    """The cache's snapshot of `revision` (a branch or tag through refs/, or a commit hash),
    in huggingface_hub's layout: models--org--name/{refs/REVISION, snapshots/COMMIT/...}."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    cache = Path(cache_dir or constants.HF_HUB_CACHE).expanduser()
    repo_dir = cache / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    what_to_do = (
        "fetch it once where the Hub is reachable (HF_HUB_OFFLINE unset), or name the cache "
        "that holds it (HF_HUB_CACHE, --download-dir)"
    )
    if not repo_dir.is_dir():
        raise HubError(
            f"{ref.spec} is neither a local path nor in the Hugging Face cache ({cache}), and "
            f"{reason}: {what_to_do}"
        )
    revision = revision or constants.DEFAULT_REVISION
    commit = revision if _COMMIT.fullmatch(revision) else _read_ref(repo_dir / "refs" / revision)
    snapshot = repo_dir / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise HubError(
            f"{ref.spec}: revision {revision!r} of {ref.repo_id} is not in the Hugging Face "
            f"cache ({cache}) and {reason}: {what_to_do}"
        )
    return snapshot


def _read_ref(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _download(ref: HubRef, revision: str | None, cache_dir: str | None, files: list[str]) -> Path:
    import huggingface_hub
    from huggingface_hub import errors

    logger.info("%s: fetching %s from the Hugging Face Hub", ref.spec, _names(files))
    try:
        folder = huggingface_hub.snapshot_download(
            ref.repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=[glob.escape(f) for f in files],  # these files, not patterns
        )
    except errors.GatedRepoError:
        raise _gated(ref) from None
    except errors.RepositoryNotFoundError:
        raise _not_found(ref) from None
    except Exception as e:  # the network, the disk: the message says which
        raise HubError(
            f"{ref.spec}: fetching {_names(files)} from the Hugging Face Hub failed "
            f"({_one_line(e)}); run again to resume"
        ) from None
    return Path(folder)


def _gated(ref: HubRef) -> HubError:
    return HubError(
        f"{ref.spec}: {ref.repo_id} is a gated model: accept its conditions at "
        f"https://huggingface.co/{ref.repo_id} and set HF_TOKEN to a token of that account"
    )


def _not_found(ref: HubRef) -> HubError:
    return HubError(
        f"{ref.spec}: no model repo {ref.repo_id} on the Hugging Face Hub (nor a local path of "
        f"that name), or it is private: check the id, or set HF_TOKEN to a token that can read it"
    )


# ---------------------------------------------------------------------------------------------
# Which files


def _choose_files(ref: HubRef, listing: _Listing, tokenizer_only: bool) -> tuple[list[str], str]:
    """The files to fetch, and the path in the repo to load ("": the repo's directory)."""
    if ref.filename is not None:
        chosen = _gguf_by_name(ref, listing)
    elif ref.tag is not None:
        chosen = _gguf_by_tag(ref, listing, ref.tag)
    else:
        top = [f for f in listing.files if "/" not in f]
        if ("tokenizer.json" if tokenizer_only else "config.json") in top:
            return _hf_layout_files(top, tokenizer_only), ""
        chosen = _default_gguf(ref, listing, tokenizer_only)
    return chosen, chosen[0]


def _hf_layout_files(top: list[str], tokenizer_only: bool) -> list[str]:
    if tokenizer_only:
        return [f for f in top if f in TOKENIZER_FILES]
    weights = [f for f in top if f.endswith((".safetensors", ".safetensors.index.json"))]
    # Mistral's repos hold consolidated.safetensors beside the transformers-named shards: the
    # same weights again, under names the loader does not read.
    if any(not f.startswith("consolidated") for f in weights if f.endswith(".safetensors")):
        weights = [f for f in weights if not f.startswith("consolidated")]
    return [f for f in top if f in MODEL_FILES] + weights


@dataclass(frozen=True, slots=True)
class _GgufFile:
    """One GGUF file of a repo: a single file, or the parts of a split one."""

    stem: str  # the path without .gguf (a split file's without its -0000N-of-0000M)
    parts: tuple[str, ...]  # the paths listed, in order
    count: int  # the parts it has (1: not split)

    @property
    def name(self) -> str:
        return self.parts[0]

    def matches(self, tag: str) -> bool:
        folder, _, name = self.stem.lower().rpartition("/")
        tag = tag.lower()
        in_folder = folder.rsplit("/", 1)[-1] == tag  # Q4_K_M/Name-00001-of-00002.gguf
        return name == tag or name.endswith(("-" + tag, "." + tag)) or in_folder


def _gguf_files(listing: _Listing) -> list[_GgufFile]:
    """The repo's GGUF model files (not multimodal projectors, mmproj-*), parts grouped."""
    stems: dict[str, tuple[list[str], int]] = {}
    for path in listing.files:
        name = path.rsplit("/", 1)[-1].lower()
        if not name.endswith(".gguf") or name.startswith("mmproj"):
            continue
        split = split_name(path)
        stem, count = (path[: -len(".gguf")], 1) if split is None else (split.prefix, split.count)
        stems.setdefault(stem, ([], count))[0].append(path)
    return [_GgufFile(stem, tuple(sorted(p)), n) for stem, (p, n) in sorted(stems.items())]


def _gguf_by_tag(ref: HubRef, listing: _Listing, tag: str) -> list[str]:
    files = _gguf_files(listing)
    matches = [f for f in files if f.matches(tag)]
    if not matches:
        raise HubError(
            f"{ref.spec}: no GGUF file of {ref.repo_id} {listing.where} matches the tag "
            f"{tag!r} ({_gguf_names(files)}); name one as {ref.repo_id}:TAG or "
            f"{ref.repo_id}/FILE.gguf"
        )
    if len(matches) > 1:
        raise HubError(
            f"{ref.spec}: the tag {tag!r} matches several GGUF files of {ref.repo_id} "
            f"({_names([m.name for m in matches])}); name one as {ref.repo_id}/FILE.gguf"
        )
    return _all_parts(ref, listing, matches[0])


def _gguf_by_name(ref: HubRef, listing: _Listing) -> list[str]:
    wanted = ref.filename or ""
    found = [f for f in listing.files if f == wanted]
    found = found or [f for f in listing.files if f.lower() == wanted.lower()]
    if not found:
        raise HubError(
            f"{ref.spec}: {ref.repo_id} has no file {wanted} {listing.where} "
            f"({_gguf_names(_gguf_files(listing))})"
        )
    named = next((f for f in _gguf_files(listing) if found[0] in f.parts), None)
    return [found[0]] if named is None else _all_parts(ref, listing, named)


def _default_gguf(ref: HubRef, listing: _Listing, tokenizer_only: bool) -> list[str]:
    """A repo without config.json (tokenizer.json): its GGUF file, if the choice is clear."""
    files = _gguf_files(listing)
    if len(files) == 1:
        return _all_parts(ref, listing, files[0])
    default = [f for f in files if f.matches(DEFAULT_GGUF_TAG)]
    if len(default) == 1:
        return _all_parts(ref, listing, default[0])
    layout = "tokenizer.json" if tokenizer_only else "config.json"
    if not files:
        raise HubError(
            f"{ref.spec}: {ref.repo_id} has neither {layout} nor a .gguf file "
            f"{listing.where}: not a model zllm reads (Hugging Face layout or GGUF)"
        )
    raise HubError(
        f"{ref.spec}: {ref.repo_id} has no {layout} and several GGUF files {listing.where} "
        f"({_gguf_names(files)}): name one as {ref.repo_id}:TAG or {ref.repo_id}/FILE.gguf"
    )


def _all_parts(ref: HubRef, listing: _Listing, file: _GgufFile) -> list[str]:
    if len(file.parts) != file.count:
        raise HubError(
            f"{ref.spec}: {file.name} is split in {file.count} parts but {len(file.parts)} are "
            f"{listing.where} ({_names(list(file.parts))}); each part is needed"
        )
    return list(file.parts)


def _gguf_names(files: list[_GgufFile]) -> str:
    if not files:
        return "it has no GGUF files"
    return "GGUF files: " + _names([f.name for f in files])


def _names(paths: list[str]) -> str:
    shown = ", ".join(paths[:_SHOWN_FILES])
    return shown if len(paths) <= _SHOWN_FILES else f"{shown} and {len(paths) - _SHOWN_FILES} more"


def _one_line(error: Exception) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first[:200]}" if first else type(error).__name__
