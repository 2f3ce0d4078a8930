"""The model families zllm runs, one row each (a family describes itself in its module under
zllm/model/families/; docs/adding-a-model.md). Everything else finds a model's family here,
by the names in its files, and asks the family what it needs. No torch here."""

from __future__ import annotations

from zllm.model.arch_config import ModelArchConfig
from zllm.model.families import (
    bert,
    deepseek_v2,
    gemma3,
    glm4_moe,
    gpt_oss,
    granite_hybrid,
    llama,
    llama4,
    llava,
    minimax_m2,
    mixtral,
    nemotron_h,
    olmo2,
    phi3,
    qwen2,
    qwen2_5_vl,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    smollm3,
    transformers,
)
from zllm.model.family import Family, Feature, Trait
from zllm.model.gguf import GGUFFile

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    smollm3.FAMILY,
    llama4.FAMILY,
    mixtral.FAMILY,
    qwen2.FAMILY,
    qwen2_moe.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    glm4_moe.FAMILY,
    minimax_m2.FAMILY,
    qwen3_next.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5.MOE_FAMILY,
    granite_hybrid.FAMILY,
    nemotron_h.FAMILY,
    phi3.FAMILY,
    gemma3.FAMILY,
    olmo2.FAMILY,
    qwen2_5_vl.FAMILY,
    gpt_oss.FAMILY,
    deepseek_v2.FAMILY,
    llava.FAMILY,
    bert.FAMILY,
)
# Any architecture no family claims, on transformers' modeling code.
TRANSFORMERS = transformers.FAMILY

_BY_NAME = {family.name: family for family in (*FAMILIES, TRANSFORMERS)}
_BY_MODEL_TYPE = {name: family for family in FAMILIES for name in family.model_types}


def family_named(name: str) -> Family:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"no model family {name!r} (zllm has {', '.join(_BY_NAME)})") from None


def family_of(arch: ModelArchConfig) -> Family:
    """The family whose code runs `arch` (its reader set it)."""
    return family_named(arch.family)


def code_family(arch: ModelArchConfig, model_impl: str) -> Family:
    """The family whose code runs `arch` under `model_impl`: its own, or the transformers
    backend's where transformers' code runs a native family (--model-impl transformers).
    What the code can do (fused decode, graphs, ...) is this family's; what the model is
    (its tensor names, its traits) stays its own family's (family_of)."""
    family = family_of(arch)
    if model_impl == "transformers" and family.code == "zllm":
        return TRANSFORMERS
    return family


def family_for_config(cfg: dict) -> Family | None:
    """The family a config.json's model_type belongs to (None: no family claims it)."""
    return _BY_MODEL_TYPE.get(str(cfg.get("model_type")))


def family_for_gguf(gguf: GGUFFile) -> Family | None:
    """The family a GGUF file's general.architecture belongs to (None: no family claims it);
    where families share the name, the one that claims the file."""
    arch = gguf.metadata.get("general.architecture")
    for family in FAMILIES:
        if arch in family.gguf_architectures and (
            family.claims_gguf is None or family.claims_gguf(gguf)
        ):
            return family
    return None


def native_model_types() -> list[str]:
    """config.json model types zllm's own model code runs."""
    return sorted(t for f in FAMILIES if f.code == "zllm" for t in f.model_types)


def native_gguf_architectures() -> list[str]:
    """GGUF architectures zllm's own model code runs."""
    return sorted({a for f in FAMILIES if f.code == "zllm" for a in f.gguf_architectures})


def transformers_gguf_spelling(arch: str) -> list[str]:
    """The names transformers' GGUF reader may know a llama.cpp architecture by: its own,
    and its family's model types (transformers names most of them so)."""
    names = [arch, transformers.GGUF_SPELLINGS.get(arch, arch)]
    return names + [t for f in FAMILIES if arch in f.gguf_architectures for t in f.model_types]


def vision_families_text() -> str:
    """The vision-language families, for messages: which run natively, which through
    transformers."""
    vision = [f for f in FAMILIES if f.has(Trait.VISION)]
    native = [f"{f.title} (model_type {f.model_types[-1]!r})" for f in vision if f.code == "zllm"]
    backend = [t for f in vision if f.code == "transformers" for t in f.model_types]
    return f"{' and '.join(native)} natively and {', '.join(backend)} through transformers"


def classifier_families_text() -> str:
    """The families whose code carries a sequence-classification head, for messages."""
    heads = [f for f in FAMILIES if f.supports(Feature.CLASSIFIER_HEAD)]
    own = [t for f in heads if f.code == "zllm" for t in f.model_types]
    encoders = [t for f in heads if f.has(Trait.ENCODER) for t in f.model_types]
    return f"its own models ({', '.join(own)}) and on encoders ({', '.join(encoders)})"
