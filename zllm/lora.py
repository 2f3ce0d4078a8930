"""LoRA adapters: what names one (`LoRARequest`, a wire struct of zllm/protocol.py, imported
here under vLLM's name) and what its files must hold (`read_adapter`).

An adapter is a directory in PEFT's format: `adapter_config.json` (r, lora_alpha, target
modules, use_rslora) and `adapter_model.safetensors` with, per adapted projection,

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight

(a vision-language model's: `model.language_model.layers.{i}`; its vision encoder is not
adapted)
(A is [r, in_features], B is [out_features, r]; the layer computes W x + scaling * B A x).
`read_adapter` checks all of it against the base model's shapes from the config and the
safetensors header alone, without torch, so the frontend can refuse a bad adapter (400)
before anything changes, and the executor only reads tensors that are known to fit.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass

import msgspec

from zllm.errors import ParamError
from zllm.model.arch_config import ModelArchConfig
from zllm.protocol import LoRARequest  # on the wire; `zllm.lora.LoRARequest` is vLLM's path

# The projections an adapter may target, by PEFT's module names, and where they sit (with
# multi-head latent attention's own: DeepSeek-V2/V3's query and latent projections).
LATENT_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", *LATENT_TARGETS, "gate_proj", "up_proj", "down_proj",
)  # fmt: skip
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
_BLOCK |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_BLOCK |= dict.fromkeys(LATENT_TARGETS, "self_attn")
# Why a module a model has is not adapted.
_NOT_ADAPTED = {
    "kv_b_proj": "the latent attention folds kv_b_proj into each head's query and output "
    "(absorbed decode), where an adapter's update to it would not reach",
}
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight"
)
# A vision-language model's adapter names its language model's layers as transformers holds
# them: `model.language_model.layers` (transformers 5), `language_model.model.layers`
# (transformers 4.5x's Gemma 3), or the text model's own `model.layers` (Qwen2.5-VL's).
_VISION_MODEL_TENSOR_NAME = re.compile(
    r"base_model\.model\.(?:model\.(?:language_model\.)?|language_model\.model\.)layers\."
    r"(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight"
)
_VISION_NAMES = ("visual.", "vision_tower.", "multi_modal_projector.")
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is not an adapter's
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_digest(path: str) -> bytes:
    """The first 16 bytes of the SHA-256 of an adapter's config and weight files' bytes: as
    wide as a block key (zllm/kv/block_hash.py), since its blocks are salted with it."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.digest()[:16]


def with_digest(lora: LoRARequest) -> LoRARequest:
    """The request with its files' digest filled in (read_adapter has checked them)."""
    return msgspec.structs.replace(lora, lora_digest=adapter_digest(lora.lora_path))


class LoRAError(ParamError):
    """An adapter that cannot be served, with why (the frontend answers 400)."""


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapted projection: where its A and B tensors are, and their shapes."""

    layer: int
    module: str  # a TARGET_MODULES name
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    a_name: str
    b_name: str


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """What `read_adapter` found: the adapter's rank and its modules, checked."""

    path: str
    rank: int  # the largest rank of any module
    modules: tuple[LoRAModule, ...]

    @property
    def weights_file(self) -> str:
        return os.path.join(self.path, WEIGHTS_FILE)


def projection_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """Each target module's (in_features, out_features) in a layer of this architecture."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    mlp = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    mla = arch.mla
    if mla is not None:  # the query whole or through its low rank; keys and values a latent
        query = arch.num_heads * mla.qk_head_dim
        q_proj = (
            {"q_proj": (hidden, query)}
            if mla.q_lora_rank is None
            else {"q_a_proj": (hidden, mla.q_lora_rank), "q_b_proj": (mla.q_lora_rank, query)}
        )
        attention = {
            **q_proj,
            "kv_a_proj_with_mqa": (hidden, mla.latent_width),
            "o_proj": (arch.num_heads * mla.v_head_dim, hidden),
        }
        return {**attention, **mlp}
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    attention = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
    return {**attention, "o_proj": (q, hidden), **mlp}


def read_adapter(path: str, arch: ModelArchConfig, max_lora_rank: int) -> LoRAAdapter:
    """Check a PEFT adapter directory against the base model; raise LoRAError saying why not."""
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {path!r} is not a directory", "lora_path")
    config = _read_config(path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoRAError(f"{CONFIG_FILE} needs a positive integer r and a numeric lora_alpha")
    _check_supported(config)
    tensors = _read_safetensors_header(os.path.join(path, WEIGHTS_FILE))
    shapes = projection_shapes(arch)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name, (dtype, shape) in tensors.items():
        match = (_VISION_MODEL_TENSOR_NAME if arch.vision else _TENSOR_NAME).fullmatch(name)
        if match is None and arch.vision and any(part in name for part in _VISION_NAMES):
            raise LoRAError(
                f"LoRA adapter tensor {name!r} adapts the vision encoder: zllm applies "
                f"adapters to a vision-language model's language model only"
            )
        if match is None:
            raise LoRAError(
                f"LoRA adapter tensor {name!r} adapts no module zllm can serve (supported: "
                f"{', '.join(TARGET_MODULES)} of the decoder layers)"
            )
        layer, block, module, kind = int(match[1]), match[2], match[3], match[4]
        if module in _NOT_ADAPTED:
            raise LoRAError(f"LoRA adapter targets {block}.{module}: {_NOT_ADAPTED[module]}")
        if module not in shapes or _BLOCK[module] != block:
            raise LoRAError(f"LoRA adapter targets {block}.{module}, which the base model lacks")
        if layer >= arch.num_layers:
            raise LoRAError(
                f"LoRA adapter tensor {name!r} is for layer {layer}; the base model has "
                f"{arch.num_layers} layers"
            )
        if block == "mlp" and arch.is_moe_layer(layer):
            raise LoRAError(
                f"LoRA adapter targets mlp.{module} of layer {layer}, a mixture-of-experts "
                f"layer: zllm adapts its attention only"
            )
        if dtype not in _DTYPES or len(shape) != 2:
            raise LoRAError(f"LoRA adapter tensor {name!r} is {dtype} {shape}, not a 2-D float")
        pairs.setdefault((layer, module), {})[kind] = name
    if not pairs:
        raise LoRAError("LoRA adapter has no lora_A/lora_B weights")
    modules = []
    for (layer, module), names in sorted(pairs.items()):
        if set(names) != {"A", "B"}:
            raise LoRAError(
                f"LoRA adapter has only one of lora_A/lora_B for layer {layer} {module}"
            )
        a_shape, b_shape = tensors[names["A"]][1], tensors[names["B"]][1]
        in_features, out_features = shapes[module]
        r = a_shape[0]
        if a_shape != [r, in_features] or b_shape != [out_features, r]:
            raise LoRAError(
                f"LoRA adapter's layer {layer} {module} has A {a_shape} and B {b_shape}; the "
                f"base model needs A [r, {in_features}] and B [{out_features}, r]"
            )
        if r > max_lora_rank:
            raise LoRAError(
                f"LoRA adapter rank {r} exceeds --max-lora-rank {max_lora_rank}", "max_lora_rank"
            )
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules.append(LoRAModule(layer, module, r, float(scale), names["A"], names["B"]))
    targets = config.get("target_modules")
    if isinstance(targets, list):
        refused = sorted(set(targets) & set(_NOT_ADAPTED))
        if refused:
            raise LoRAError(f"LoRA adapter's target_modules {refused}: {_NOT_ADAPTED[refused[0]]}")
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise LoRAError(
                f"LoRA adapter's target_modules {unknown} do not exist in the base model "
                f"(it has {', '.join(TARGET_MODULES)})"
            )
    return LoRAAdapter(path, max(m.rank for m in modules), tuple(modules))


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter {path!r} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter's {CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter's {CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"adapter's peft_type is {peft_type!r}; zllm serves LORA adapters")
    return config


def _check_supported(config: dict) -> None:
    """Refuse the PEFT options whose arithmetic zllm does not implement."""
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained embeddings or heads)",
        "alpha_pattern": "alpha_pattern",
        "fan_in_fan_out": "fan_in_fan_out",
        "lora_bias": "lora_bias",
        "use_qalora": "QA-LoRA",
        "use_bdlora": "BD-LoRA",
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trainable_token_indices",
        "target_parameters": "target_parameters",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"LoRA adapter uses {what}, which zllm does not serve")
    if config.get("bias", "none") != "none":
        raise LoRAError("LoRA adapter trains biases (bias != 'none'), which zllm does not serve")


def _read_safetensors_header(file: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from a safetensors file, checking that its data is all there.

    The format: an 8-byte little-endian header length, a JSON header mapping each tensor to
    its dtype, shape and [begin, end) byte offsets in the data that follows.
    """
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, _MAX_HEADER):
                raise ValueError("header length exceeds the file")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter has no {WEIGHTS_FILE}") from None
    except (OSError, ValueError, struct.error) as e:
        raise LoRAError(f"LoRA adapter's {WEIGHTS_FILE} is malformed: {e}") from None
    if not isinstance(header, dict):
        raise LoRAError(f"LoRA adapter's {WEIGHTS_FILE} is malformed: its header is no object")
    data_size = size - 8 - length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            expected = _DTYPES.get(dtype, 0) * math.prod(shape)
            if not 0 <= begin <= end <= data_size or (expected and end - begin != expected):
                raise ValueError(f"tensor {name!r} lies outside the file's data")
        except (KeyError, TypeError, ValueError) as e:
            raise LoRAError(f"LoRA adapter's {WEIGHTS_FILE} is malformed: {e}") from None
        tensors[name] = (dtype, list(shape))
    return tensors


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` (vLLM's spelling; a JSON object with name and path
    also works) -> [(name, path)]."""
    modules = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                obj = json.loads(spec)
                name, path = obj["name"], obj["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"--lora-modules {spec!r}: a JSON entry needs name and path"
                ) from None
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {spec!r}: expected name=path")
        modules.append((name, path))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names repeat: {names}")
    return modules
