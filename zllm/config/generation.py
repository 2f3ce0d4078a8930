"""The model's `generation_config.json`, read as `vllm serve --generation-config` reads it.

Two things come from it: more ids that end generation (`eos_token_id`, an int or a list:
chat models often end a turn with a token other than the tokenizer's EOS), and the
sampling values the model's authors recommend, which become the defaults of requests that
leave them unset. The choice (`EngineArgs.generation_config`):

    auto    the file in the model's directory (a GGUF file has none: nothing)
    vllm    zllm's own sampling defaults; the model's file still adds its eos ids (as vLLM)
    <dir>   the generation_config.json in that directory instead

No torch and no transformers: `EngineArgs.create_engine_config` reads it once with the
stdlib, and every process gets the result inside its `EngineConfig`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from zllm.errors import ParamError
from zllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
CHOICES_HELP = "auto, vllm, or a directory holding a generation_config.json"

# The file's keys that are sampling defaults -> SamplingParams' names (vLLM reads the same).
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_INT_KEYS = ("top_k", "max_new_tokens")


@dataclass(slots=True)
class SamplingDefaults:
    """What a request that leaves a field unset gets (None: zllm's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens

    def overrides(self, *, with_max_tokens: bool = True) -> dict[str, Any]:
        """The fields set, as SamplingParams keywords."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if not with_max_tokens:
            del values["max_tokens"]
        return {name: value for name, value in values.items() if value is not None}


@dataclass(slots=True)
class GenerationConfig:
    """What zllm took from a generation_config.json (empty when it read none)."""

    path: str | None = None  # the file read
    eos_token_ids: list[int] = field(default_factory=list)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


def read_generation_config(model_path: str, choice: str, vocab_size: int) -> GenerationConfig:
    """The generation config `choice` names for the model at `model_path`; ValueError (with
    the file's path) for a file that is not valid, or a directory without one."""
    if choice not in ("auto", "vllm"):
        path = Path(choice) / FILE_NAME
        if not path.is_file():
            raise ValueError(f"generation_config: no {FILE_NAME} in {choice!r} ({CHOICES_HELP}).")
        return _parse(path, vocab_size, with_defaults=True)
    if not os.path.isdir(model_path):
        return GenerationConfig()  # a GGUF file: its metadata holds its eos ids
    path = Path(model_path) / FILE_NAME
    if not path.is_file():
        return GenerationConfig()
    return _parse(path, vocab_size, with_defaults=choice == "auto")


def merge_eos_token_ids(*groups: Iterable[int | None]) -> list[int]:
    """Every id of `groups`, in order, once. The first is the primary EOS (what the
    tokenizer and chat template write); the others stop generation too."""
    return list(dict.fromkeys(t for group in groups for t in group if t is not None))


def default_max_tokens(
    default: int, min_tokens: int, num_prompt_tokens: int, max_model_len: int
) -> int:
    """max_tokens for a request that set none, from the model's max_new_tokens: cut to the
    room its prompt leaves (vLLM takes the same minimum), so a default never fails a request."""
    return min(max(default, min_tokens), max_model_len - num_prompt_tokens)


def log_generation_config(config: GenerationConfig, choice: str, eos_token_ids: list[int]) -> None:
    """One line at startup: which sampling defaults come from where, and what stops."""
    overrides = config.defaults.overrides()
    if overrides:
        logger.info(
            "sampling defaults from %s: %s (requests that set these fields keep theirs; "
            "--generation-config vllm turns these defaults off)",
            config.path,
            ", ".join(f"{name}={value}" for name, value in overrides.items()),
        )
    elif config.path is not None:
        why = " (--generation-config vllm)" if choice == "vllm" else ""
        logger.info("sampling defaults: zllm's own%s; %s read for its eos ids", why, config.path)
    logger.info(
        "end-of-sequence ids the model declares: %s (the tokenizer's EOS stops too)",
        eos_token_ids or "none",
    )


def _parse(path: Path, vocab_size: int, *, with_defaults: bool) -> GenerationConfig:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}.")
    return GenerationConfig(
        path=str(path),
        eos_token_ids=_eos_token_ids(path, data.get("eos_token_id"), vocab_size),
        defaults=_sampling_defaults(path, data) if with_defaults else SamplingDefaults(),
    )


def _eos_token_ids(path: Path, value: Any, vocab_size: int) -> list[int]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for t in ids:
        # bool is an int to Python, not a token id.
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(
                f"{path}: eos_token_id must be a token id or a list of them in "
                f"[0, {vocab_size}), got {value!r}."
            )
    return merge_eos_token_ids(ids)


def _sampling_defaults(path: Path, data: dict[str, Any]) -> SamplingDefaults:
    values: dict[str, Any] = {}
    for key, name in _SAMPLING_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        kinds = (int,) if key in _INT_KEYS else (int, float)
        if not isinstance(value, kinds) or isinstance(value, bool):
            kind = "an integer" if key in _INT_KEYS else "a number"
            raise ValueError(f"{path}: {key} must be {kind}, got {value!r}.")
        values[name] = value if key in _INT_KEYS else float(value)
    try:
        SamplingParams(**values)  # the ranges a request's own values must be in
    except ParamError as e:
        key = next(k for k, n in _SAMPLING_KEYS.items() if n == e.param)
        raise ValueError(f"{path}: {key}: {e}") from None
    return SamplingDefaults(**values)
