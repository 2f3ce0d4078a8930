"""What a model family is to the engine: the names it answers to, how its files are read into
a `ModelArchConfig`, its GGUF tensor names, where its model code lives, and what it can do.

Each family fills one `Family` in its own module (zllm/model/families/) and takes one row in
zllm/model/registry.py; every engine feature asks a family what it supports (`lacks`,
`traits`) rather than checking which architecture or class a model is. No torch here: the
supervisor, the core and the tokenizer workers read families too; the executor imports the
model class by the name given here (`model_class`), only when it builds the model.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zllm.model.arch_config import ModelArchConfig
    from zllm.model.gguf import GGUFFile
    from zllm.model.image_tokens import ImagePlaceholders


class Feature(enum.Enum):
    """An engine feature a family's model code may lack (`Family.lacks` says why)."""

    FUSED_CPU_DECODE = "the fused CPU decode step"
    CUDA_GRAPHS = "CUDA graphs"
    PIECEWISE_CUDA_GRAPHS = "piecewise CUDA graphs over prefills"
    TENSOR_PARALLEL = "tensor parallelism"
    PIPELINE_PARALLEL = "pipeline parallelism"
    LORA = "LoRA adapters"
    NARROW_KV_CACHE = "narrow KV cache dtypes"
    DETERMINISTIC = "batch-invariant (--deterministic) arithmetic"
    DRAFT_MODEL = "running as a speculative draft model"
    TRANSFORMERS_IMPL = "transformers' modeling code"
    CLASSIFIER_HEAD = "a sequence-classification head"
    QUANTIZATION = "zllm's own quantized matmuls"
    SPECULATIVE_DECODING = "speculative decoding"


class Trait(enum.Enum):
    """What a family's models hold or do, for the features that must know."""

    SLIDING_WINDOW = "sliding-window layers"
    ATTENTION_SINKS = "attention sinks"
    MLA = "multi-head latent attention"
    MOE = "mixture-of-experts layers"
    VISION = "images"
    # Image tokens attend to each other both ways (each image prefilled in one step).
    BIDIRECTIONAL_IMAGES = "image tokens that attend both ways"
    # Every token attends to its whole prompt: a prompt is computed in one step and pools.
    ENCODER = "an encoder"
    # Layers that keep a recurrent state per sequence beside the KV cache (arch.state).
    RECURRENT_STATE = "a recurrent state per sequence"


@dataclass(frozen=True, slots=True)
class ImageRules:
    """How a vision-language family's prompts hold images and which encoder reads them."""

    # (model_path, config.json, token id -> its text) -> the placeholders a prompt holds.
    placeholders: Callable[[str, dict, Callable[[int], str | None]], ImagePlaceholders]
    # (model_path, config.json) -> the most tokens one usual image takes.
    max_tokens: Callable[[str, dict], int]
    # "module:Class" of the executor's image encoder (imported by the executor only).
    encoder: str


HfReader = Callable[[dict[str, Any], Path], "ModelArchConfig"]
GgufReader = Callable[["GGUFFile"], "ModelArchConfig"]


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture family, described once (its module in zllm/model/families/)."""

    name: str  # the registry key; ModelArchConfig.family
    title: str  # for messages: "Qwen 3", "DeepSeek-V2"
    # What it answers to: config.json's model_type values and GGUF general.architecture.
    model_types: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    # config.json -> the engine's record (None: the family has no config.json form here).
    read_hf: HfReader | None = None
    # A GGUF file's header -> the engine's record (None: its GGUF files are not read).
    read_gguf: GgufReader | None = None
    # Where several families share a GGUF name (Mixtral's files are "llama" files with
    # experts): whether this file is this family's.
    claims_gguf: Callable[[GGUFFile], bool] | None = None
    # llama.cpp's per-layer tensor keys (blk.N.<key>.weight|bias) -> Hugging Face module
    # paths under model.layers.N.
    gguf_tensor_names: Mapping[str, str] = field(default_factory=dict)
    # How llama.cpp's converter changed this family's tensors: q/k rows permuted for its
    # rotary layout (undone at load); norms stored as 1 + weight (Gemma's).
    gguf_permuted_qk: bool = False
    gguf_norms_plus_one: bool = False
    # Anything else the converter changed, undone at load: (Hugging Face name, the tensor as
    # a float32 numpy array) -> the checkpoint's tensor (None: nothing).
    gguf_undo: Callable[[str, Any], Any] | None = None
    # Phi-3's checkpoints store qkv_proj and gate_up_proj fused, in the engine's order.
    fused_checkpoint: bool = False
    # Why transformers' GGUF reader would run another model than this file holds (None: it
    # reads the file as it is), for --model-impl transformers on a GGUF file.
    transformers_gguf_problem: Callable[[GGUFFile], str | None] | None = None
    # "module:Class" of the model; zllm.executor's modules are imported by the executor only.
    model_class: str = ""
    # Whose modeling code runs it: "zllm" (executor/models/) or "transformers" (the
    # transformers backend, executor/models/transformers/).
    code: str = "zllm"
    traits: frozenset[Trait] = frozenset()
    # The engine features its code does not run, each with the physical reason.
    lacks: Mapping[Feature, str] = field(default_factory=dict)
    images: ImageRules | None = None
    # The record of what only this family reads (ModelArchConfig.family_fields), if any.
    fields: type | None = None
    # The parsers its chat format needs when the user names none: (reasoning, tool call).
    default_parsers: tuple[str, str] | None = None

    def supports(self, feature: Feature) -> bool:
        return feature not in self.lacks

    def has(self, trait: Trait) -> bool:
        return trait in self.traits

    def refusal(self, feature: Feature, option: str) -> str:
        """Why `option` (the engine option asking for `feature`) cannot run this family, naming
        the capability and the family: "--enable-lora: adapters target q/k/v projections
        this model lacks (the DeepSeek-V2/V3 family (deepseek_v2) has no LoRA adapters)"."""
        return (
            f"{option}: {self.lacks[feature]} (the {self.title} family ({self.name}) has no "
            f"{feature.value})"
        )
