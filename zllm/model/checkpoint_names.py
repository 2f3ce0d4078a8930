"""The tensor names a safetensors checkpoint holds, from its index or its files' headers
(no torch: the engine's config reads them before any process loads the model)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_MAX_HEADER = 100 << 20


def checkpoint_tensor_names(directory: Path) -> set[str]:
    """Every tensor name of the directory's safetensors checkpoint (empty: none there)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    names: set[str] = set()
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > _MAX_HEADER:
                    raise ValueError(f"a header of {length} bytes")
                names.update(k for k in json.loads(f.read(length)) if k != "__metadata__")
        except (OSError, ValueError, struct.error) as exc:
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None
    return names


def is_base_model(directory: Path) -> bool:
    """Whether the checkpoint is a base model's (an embedding model's decoder saved without
    its causal-LM wrapper: `embed_tokens.*`, `layers.*`, no `model.` prefix and no LM head),
    not a causal LM's (whose tied head is not stored either)."""
    names = checkpoint_tensor_names(directory)
    bare = any(n.startswith(("embed_tokens.", "layers.")) for n in names)
    return bare and not any(n.endswith("lm_head.weight") for n in names)
