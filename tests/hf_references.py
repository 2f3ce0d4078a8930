"""transformers' fp32 copy of a GGUF model, made once and shared by a run's workers.

transformers dequantizes a GGUF file in Python (~26 s for SmolLM2's 135M on the 2-core
machine), and each pytest-xdist worker whose tests take the reference would do it again. The
model it reads (every weight as transformers dequantized it, its config, its tokenizer) is
saved as a Hugging Face directory in $ZLLM_CACHE under a digest of the file and of
transformers' version; a run's first worker writes it under a lock, the others (and later
runs) load it from there. transformers stays the reference: the directory holds exactly the
tensors its GGUF loader made.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cached_builds import built_once

from zllm.model.files import cache_dir


def hf_copy_of_gguf(gguf_path: str, scratch: Path) -> Path:
    """The directory (config.json, model.safetensors, the tokenizer's files) of transformers'
    fp32 model and tokenizer read from `gguf_path`; `scratch`: where to write it first."""
    import transformers

    stat = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(f"{key}\0{transformers.__version__}".encode()).hexdigest()[:16]
    out = cache_dir() / "test-references" / f"{Path(gguf_path).stem}-{digest}"
    return built_once(out, scratch / out.name, lambda path: _write(gguf_path, path))


def _write(gguf_path: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    # transformers refuses to save a model it loaded from GGUF: the weights and config here.
    state = {k: v.float().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
