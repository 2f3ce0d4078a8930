"""The engine options that need a capability of the model's family, refused at start when the
family lacks it (its `Family.lacks`, zllm/model/families/), each naming the option, the reason,
the capability and the family. No torch here.

One table: an option in use -> the `Feature` it asks of the family. A feature the family's
code does not run is refused here, before any process starts; a family declares what it
lacks in its own module, so no rule here names an architecture.
"""

from __future__ import annotations

from zllm.config.engine import EngineConfig
from zllm.model.family import Feature
from zllm.model.registry import code_family, family_of


def _asked(config: EngineConfig) -> list[tuple[Feature, str]]:
    """(feature, the option asking for it) for each option `config` turns on."""
    asked = []
    if config.tensor_parallel_size > 1:
        asked.append((Feature.TENSOR_PARALLEL, f"--tensor-parallel-size {config.tensor_parallel_size}"))  # fmt: skip
    if config.pipeline_parallel_size > 1:
        asked.append((Feature.PIPELINE_PARALLEL, f"--pipeline-parallel-size {config.pipeline_parallel_size}"))  # fmt: skip
    if config.cache.kv_cache_dtype is not None:
        asked.append((Feature.NARROW_KV_CACHE, f"--kv-cache-dtype {config.cache.kv_cache_dtype}"))
    if config.lora is not None:
        asked.append((Feature.LORA, "--enable-lora"))
    if config.deterministic:
        asked.append((Feature.DETERMINISTIC, "--deterministic"))
    if config.quantization == "int8":
        asked.append((Feature.QUANTIZATION, "--quantization int8"))
    if config.speculative is not None:
        asked.append((Feature.SPECULATIVE_DECODING, "--speculative-config"))
    return asked


def capability_refusals(config: EngineConfig) -> list[str]:
    """Why each option in `config` cannot run the model's family (empty: it runs as asked)."""
    family = code_family(config.arch, config.model_impl)
    reasons = [family.refusal(f, option) for f, option in _asked(config) if not family.supports(f)]
    spec = config.speculative
    if spec is not None and spec.draft_arch is not None:
        draft = family_of(spec.draft_arch)
        if not draft.supports(Feature.DRAFT_MODEL):
            reasons.append(draft.refusal(Feature.DRAFT_MODEL, "--speculative-config's draft model"))  # fmt: skip
    return reasons


def check_capabilities(config: EngineConfig) -> None:
    """Refuse (ValueError) the options the model's family cannot run with."""
    reasons = capability_refusals(config)
    if reasons:
        raise ValueError(f"{config.arch.architecture} cannot run with " + "; ".join(reasons))
