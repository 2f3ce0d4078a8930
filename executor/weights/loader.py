"""Model weights as float32 CPU tensors under Hugging Face parameter names.

Whatever the file format, the model code sees one naming scheme (HF's) and one layout (HF's),
so a GGUF file and a safetensors directory of the same model load into identical tensors.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Container, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import safe_open
from torch import nn

from zllm.model.arch_config import ModelArchConfig
from zllm.model.gguf import GGUFFile, read_gguf
from zllm.model.progress import Progress
from zllm.model.registry import family_of

logger = logging.getLogger(__name__)

# Each family's per-layer tensor names (blk.{i}.<key>.weight|bias -> HF module paths) are its
# own (Family.gguf_tensor_names, zllm/model/families/); the model-wide ones are llama.cpp's.
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that are no weight of the model: model_files reads them into ModelArchConfig.
_GGUF_NON_WEIGHTS = frozenset(
    {
        "rope_freqs.weight",  # ModelArchConfig.rope_freq_factors
        "rope_factors_long.weight",  # Phi-3's LongRoPE: ModelArchConfig.rope_scaling
        "rope_factors_short.weight",
    }
)


def load_weights(
    model_path: str,
    arch: ModelArchConfig,
    layers: Container[int] | None = None,
    skip: Container[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) one at a time, so peak memory is one tensor beyond the model.

    `layers`: only these decoder layers' tensors are read (a pipeline stage's; the others are
    neither read nor dequantized), with every tensor outside the layers; None: all. `skip`:
    tensors neither widened nor yielded (the CPU kernel reads their blocks or 16-bit rows)."""
    if os.path.isdir(model_path):
        yield from _load_safetensors(Path(model_path), arch, layers, skip)
        return
    gguf = read_gguf(model_path)
    # Bytes rather than tensors: dequantizing dominates, and the embedding alone can be a third.
    total = sum(info.nbytes for info in gguf.tensors.values())
    description = f"Loading {Path(model_path).name}"
    with Progress(description, total=total, unit="B", logger=logger) as progress:
        yield from _join_kv_b(_load_gguf(gguf, arch, progress, layers, skip))


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """--load-format dummy: random weights of the model's shapes, no file read. Matrices
    uniform in +-1/sqrt(fan-in) (a layer keeps its input's scale), norm weights 1, biases 0;
    seeded, so every load (a wake-up, another rank) draws the same values."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            bound = param.shape[-1] ** -0.5
            values = torch.rand(param.shape, generator=generator) * (2 * bound) - bound
            param.copy_(values)
        else:
            param.fill_(1.0 if "norm" in name else 0.0)


def layer_of(name: str) -> int | None:
    """The decoder layer a Hugging Face weight name belongs to (None: not a layer's)."""
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".", 3)[2])


# A vision-language checkpoint's language model under its text model's names (transformers 4
# and the Hub's Gemma 3 checkpoints: language_model.model.*; transformers 5:
# model.language_model.*; the Hub's Qwen2.5-VL checkpoints: the text model's own model.*);
# its vision encoder's tensors are executor/models/vision/'s.
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
    "model.multi_modal_projector.", "visual.", "model.visual.",
)  # fmt: skip


# A base model's checkpoint (an embedding model's decoder, saved without its causal-LM
# wrapper) names its tensors without the `model.` prefix.
_BASE_MODEL_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def language_model_name(name: str, arch: ModelArchConfig) -> str | None:
    """The text model's name of a checkpoint tensor (None: a vision encoder's, not read
    here); a text-only model's names are their own, a base model's under `model.`."""
    if not arch.lm_head and name.startswith(_BASE_MODEL_PREFIXES):
        return "model." + name
    if not arch.vision:
        return name
    if name.startswith(_VISION_PREFIXES):
        return None
    for old, new in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name if name.startswith("model.") or name == "lm_head.weight" else None


def _wanted(hf_name: str, layers: Container[int] | None) -> bool:
    layer = layer_of(hf_name)
    return layers is None or layer is None or layer in layers


def hf_name_from_gguf(name: str, layer_names: Mapping[str, str]) -> str | None:
    """A GGUF tensor's Hugging Face name under a family's per-layer names (None: neither a
    model-wide tensor nor one of the family's layer tensors)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    whole = ".".join(parts[2:])  # a key with its suffix names the whole tensor (exp_probs_b.bias)
    if len(parts) == 4 and parts[0] == "blk" and whole in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[whole]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:  # (ssm_a: no suffix)
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def decoder_end(gguf: GGUFFile, arch: ModelArchConfig) -> float:
    """The first block past the decoder in a file whose converter wrote multi-token-
    prediction blocks after it (nextn_predict_layers: Qwen3-Next's, Qwen3.5's), not read;
    infinity for any other file, whose every block is read (and checked)."""
    architecture = gguf.metadata.get("general.architecture")
    nextn = gguf.metadata.get(f"{architecture}.nextn_predict_layers")
    return arch.num_layers if nextn else math.inf


def gguf_block(name: str) -> int | None:
    """The layer a GGUF tensor belongs to (blk.N.*), None for a model-wide one."""
    parts = name.split(".", 2)
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdecimal() else None


def _load_gguf(
    gguf: GGUFFile,
    arch: ModelArchConfig,
    progress: Progress,
    layers: Container[int] | None,
    skip: Container[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    family = family_of(arch)
    heads_from = decoder_end(gguf, arch)
    for name, info in gguf.tensors.items():
        progress.advance(info.nbytes)
        if name in _GGUF_NON_WEIGHTS or (gguf_block(name) or 0) >= heads_from:
            continue  # (blocks past the decoder: a multi-token-prediction head, not run)
        hf_name = hf_name_from_gguf(name, family.gguf_tensor_names)
        if hf_name is None:
            raise ValueError(f"{gguf.path}: unexpected tensor {name!r} for a {arch.architecture}")
        if (
            (hf_name == "lm_head.weight" and arch.tie_word_embeddings)
            or not _wanted(hf_name, layers)
            or hf_name in skip
        ):
            continue
        try:
            weight = dequantize(gguf.tensor_data(name), info.ggml_type).reshape(info.shape)
        except NotImplementedError:
            raise ValueError(
                f"{gguf.path}: tensor {name!r} uses {info.ggml_type.name}, which gguf cannot "
                f"dequantize"
            ) from None
        # llama.cpp's converter permutes q/k rows for some families (Llama's, Mistral
        # checkpoints included); others keep HF's order.
        if family.gguf_permuted_qk and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            weight = unpermute_rope_rows(weight, arch.head_dim)
        if family.gguf_norms_plus_one and hf_name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norm weights as 1 + w (its norm multiplies
            # by the weight); ours, like transformers', multiplies by 1 + w.
            weight = weight - 1.0
        if family.gguf_undo is not None:
            weight = family.gguf_undo(hf_name, weight)
        if not weight.flags.writeable:  # F32 tensors come back as views of the mmap
            weight = weight.copy()
        yield hf_name, torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))


def gguf_raw_weights(
    model_path: str, arch: ModelArchConfig, layers: Container[int] | None = None
) -> dict[str, tuple[int, torch.Tensor]]:
    """HF name -> (ggml type id, the tensor's raw rows as uint8 [rows, bytes per row]).

    Only matrices, and of the decoder layers only `layers` (as in load_weights); a stack of
    experts' matrices [E, out, in] comes as its E x out rows (expert_blocks.py). q/k rows are
    put in HF's order as load_weights does: a row permutation moves whole rows, and GGUF
    blocks run along a row, so it applies to the bytes unchanged.
    """
    gguf = read_gguf(model_path)
    family = family_of(arch)
    raw: dict[str, tuple[int, torch.Tensor]] = {}
    heads_from = decoder_end(gguf, arch)
    for name, info in gguf.tensors.items():
        if (gguf_block(name) or 0) >= heads_from:
            continue  # (a multi-token-prediction head)
        hf_name = hf_name_from_gguf(name, family.gguf_tensor_names)
        matrix = len(info.shape) == 2 or (len(info.shape) == 3 and ".experts." in (hf_name or ""))
        if hf_name is None or not matrix or not _wanted(hf_name, layers):
            continue
        rows = gguf.tensor_data(name).reshape(-1, info.nbytes // math.prod(info.shape[:-1]))
        if family.gguf_permuted_qk and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            rows = unpermute_rope_rows(rows, arch.head_dim)
        raw[hf_name] = (int(info.ggml_type), torch.from_numpy(np.array(rows, dtype=np.uint8)))
    return raw


def _join_kv_b(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek-V2's split attn_k_b / attn_v_b back into Hugging Face's kv_b_proj [heads x
    (nope + v), kv_lora_rank] (per head: W_UK's rows, then W_UV's); every other tensor as is."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".self_attn.")
        if kind not in ("k_b_proj.weight", "v_b_proj.weight"):
            yield name, tensor
            continue
        pair = halves.setdefault(prefix, {})
        pair[kind] = tensor
        if len(pair) == 2:
            w_uk = pair["k_b_proj.weight"].transpose(1, 2)  # [heads, nope, kv_lora_rank]
            joined = torch.cat((w_uk, pair["v_b_proj.weight"]), dim=1)
            yield f"{prefix}.self_attn.kv_b_proj.weight", joined.reshape(-1, joined.shape[-1])
            del halves[prefix]
    if halves:
        raise ValueError(f"attn_k_b without attn_v_b (or the reverse) in {sorted(halves)}")


def unpermute_rope_rows(weight: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order, which pairs up the two halves HF's rotary rotates.

    HF's rotate_half rotates row i of a head with row i + head_dim/2; llama.cpp's rope rotates
    adjacent rows, so its converter interleaves the halves. Per head, with h = head_dim / 2:

        HF:    x0 x1 ... x(h-1) | y0 y1 ... y(h-1)
        GGUF:  x0 y0 x1 y1 ... x(h-1) y(h-1)

    Works for biases too (no trailing dimensions).
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    half = head_dim // 2
    by_pair = weight.reshape(rows // head_dim, half, 2, *rest)
    return by_pair.swapaxes(1, 2).reshape(weight.shape)


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{directory} has no *.safetensors files (pytorch_model.bin is not read; "
            f"--load-format dummy runs random weights without any)"
        )
    return files


def safetensors_dtypes(directory: str) -> dict[str, str]:
    """Each tensor's stored dtype ("BF16", "F16", "F32", ...), from the files' headers."""
    dtypes = {}
    for file in safetensors_files(Path(directory)):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                dtypes[name] = shard.get_slice(name).get_dtype()
    return dtypes


# ggml type ids of the 16-bit dtypes, as the CPU kernel reads them.
_SIXTEEN_BIT_TYPES = {torch.float16: 1, torch.bfloat16: 30}


def sixteen_bit_raw_weights(
    directory: str, arch: ModelArchConfig, layers: Container[int] | None = None
) -> dict[str, tuple[int, torch.Tensor]]:
    """HF name -> (ggml type id, the matrix's 16-bit rows as uint8 [rows, 2 x columns]) for
    every bf16/fp16 matrix of a checkpoint (of the decoder layers only `layers`), as
    gguf_raw_weights gives a GGUF file's blocks."""
    raw = {}
    for file in safetensors_files(Path(directory)):
        with safe_open(str(file), framework="pt") as shard:
            for stored in shard.keys():
                name = language_model_name(stored, arch)
                if name is None or not _wanted(name, layers):
                    continue
                if len(shard.get_slice(stored).get_shape()) != 2:
                    continue
                if name == "lm_head.weight" and arch.tie_word_embeddings:
                    continue
                tensor = shard.get_tensor(stored)
                if tensor.dtype in _SIXTEEN_BIT_TYPES:
                    # A copy: get_tensor's tensor maps the file, whose pages would then stay
                    # resident beside the model's (RSS + ~0.45 GiB on Llama-1B bf16).
                    rows = tensor.view(torch.uint8).clone()
                    raw[name] = (_SIXTEEN_BIT_TYPES[tensor.dtype], rows)
    return raw


def _load_safetensors(
    directory: Path, arch: ModelArchConfig, layers: Container[int] | None, skip: Container[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(directory)
    total = sum(_num_tensors(file) for file in files)
    description = f"Loading {directory.name}"
    with Progress(description, total=total, unit="tensors", logger=logger) as progress:
        for file in files:
            with safe_open(str(file), framework="pt") as shard:
                for stored in shard.keys():
                    progress.advance(1)
                    name = language_model_name(stored, arch)
                    if name is None or name.endswith("rotary_emb.inv_freq"):
                        continue  # a vision encoder's; a buffer old checkpoints saved
                    if name == "lm_head.weight" and arch.tie_word_embeddings:
                        continue
                    if not _wanted(name, layers) or name in skip:
                        continue  # another pipeline stage's, or read as 16-bit rows (not read)
                    tensor = shard.get_tensor(stored)
                    # uint8 tensors are packed blocks (gpt-oss's MXFP4 experts): the model
                    # reads them as they are.
                    yield name, tensor if tensor.dtype == torch.uint8 else tensor.float()


def _num_tensors(file: Path) -> int:
    with safe_open(str(file), framework="pt") as shard:
        return len(shard.keys())
