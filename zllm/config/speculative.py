"""`--speculative-config '{...}'` / `LLM(speculative_config={...})`: vLLM's JSON shape, checked
into a `SpeculativeConfig` (zllm/config/engine.py). No torch here."""

from __future__ import annotations

from typing import Any

from zllm.config.arg_utils import check_config_dict
from zllm.config.engine import SPECULATIVE_METHODS, SpeculativeConfig
from zllm.model.arch import read_model_arch
from zllm.model.arch_config import ModelArchConfig
from zllm.model.files import resolve_model
from zllm.model.impl import choose_model_impl

_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "disable_by_batch_size",
}
MAX_SPECULATIVE_TOKENS = 16


def speculative_config_from(
    spec: dict[str, Any] | None, target: ModelArchConfig
) -> SpeculativeConfig | None:
    """Check the user's dict against the target model; a clear ValueError for anything off."""
    if spec is None:
        return None
    check_config_dict("speculative_config", spec, _KEYS)
    method = spec.get("method")
    if method is None:  # vLLM: a model means a draft model
        method = "draft_model" if spec.get("model") else "ngram"
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
            f"got {method!r}"
        )
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            "speculative_config: num_speculative_tokens must be an integer in "
            f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
        )
    config = SpeculativeConfig(method=method, num_speculative_tokens=k)
    disable = spec.get("disable_by_batch_size")
    if disable is not None:
        if not isinstance(disable, int) or disable < 1:
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be a positive integer, "
                f"got {disable!r}"
            )
        config.disable_by_batch_size = disable
    if method == "ngram":
        _check_ngram(spec, config)
    else:
        _load_draft(spec, config, target)
    return config


def _check_ngram(spec: dict[str, Any], config: SpeculativeConfig) -> None:
    if spec.get("model"):
        raise ValueError("speculative_config: method 'ngram' takes no model")
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    # One of them given: the other follows it, as in vLLM.
    lo = lo if lo is not None else (min(hi, config.prompt_lookup_min) if hi else None)
    hi = hi if hi is not None else (max(lo, config.prompt_lookup_max) if lo else None)
    lo = config.prompt_lookup_min if lo is None else lo
    hi = config.prompt_lookup_max if hi is None else hi
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(
            "speculative_config: need integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
            f"got {lo!r} and {hi!r}"
        )
    config.prompt_lookup_min, config.prompt_lookup_max = lo, hi


def _load_draft(spec: dict[str, Any], config: SpeculativeConfig, target: ModelArchConfig) -> None:
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in spec:
            raise ValueError(f"speculative_config: {key} is an ngram setting")
    name = spec.get("model")
    if not name:
        raise ValueError("speculative_config: method 'draft_model' needs a model")
    path = resolve_model(name)
    impl = choose_model_impl(path, "zllm")
    draft = read_model_arch(path, impl)
    # The draft's proposals are the target's token ids: one tokenizer, one vocabulary.
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens) "
            f"differs from the target's ({target.vocab_size}); they must share a tokenizer"
        )
    if draft.layer_types and "sliding_attention" in draft.layer_types:
        raise ValueError("speculative_config: a draft model with sliding-window layers")
    config.model, config.draft_model_path, config.draft_arch = name, path, draft
