"""A generation request's own engine options (`RequestOptions`, zllm/protocol.py) from the
API fields that set them: priority, prefix pinning (`cache_control`), prefill/decode
disaggregation (`kv_transfer_params`) and the prefix cache's `cache_salt`; the adapter (the model name) and the tenant (the
gate's finding) are added by `Generation.serve`. Each field is parsed here, whichever API
it came through; a bad value is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import msgspec

from zllm.config.engine import SchedulerConfig, check_cache_salt, check_priority
from zllm.errors import ParamError, RequestError
from zllm.kv.cache_control import parse_cache_control
from zllm.protocol import CachePin, KVTransferParams
from zllm.sampling_params import SamplingParams
from zllm.text.template_kwargs import merge_template_kwargs, with_fields
from zllm.text.thinking_budget import budget_for


def priority(value: int, scheduler: SchedulerConfig) -> int:
    try:
        check_priority(value, scheduler)
    except ParamError as e:
        raise RequestError(str(e), param=e.param) from None
    return value


def cache_pin(cache_control: dict[str, Any] | None) -> CachePin | None:
    """The pin a request's `cache_control` extra asks for (its whole prompt), or None."""
    if cache_control is None:
        return None
    try:
        return parse_cache_control(cache_control)
    except ParamError as e:
        raise RequestError(str(e), param=e.param) from None


def cache_salt(value: str | None) -> str | None:
    """A request's `cache_salt`, checked (non-empty, bounded)."""
    try:
        check_cache_salt(value)
    except ParamError as e:
        raise RequestError(str(e), param=e.param) from None
    return value


def template_kwargs(
    given: dict[str, Any] | None,
    defaults: dict[str, Any] | None,
    documents: list[dict[str, Any]] | None = None,
    reasoning_effort: str | None = None,
) -> dict[str, Any]:
    """A request's `chat_template_kwargs` over the server's defaults, with its `documents`
    and `reasoning_effort`; a reserved name (one the server passes to the template itself),
    or a field given twice, is a 400 naming it."""
    try:
        merged = merge_template_kwargs(defaults, given)
        return with_fields(merged, given, documents=documents, reasoning_effort=reasoning_effort)
    except ParamError as e:
        raise RequestError(str(e), param=e.param) from None


def continue_final_message(continue_final: bool, add_generation_prompt: bool) -> bool:
    """vLLM's `continue_final_message`, checked: a generation prompt would open a new turn
    after the message to continue, so both true is a 400 (add_generation_prompt defaults
    to true: a client continuing a message sets it false, as with vLLM)."""
    if continue_final and add_generation_prompt:
        raise RequestError(
            "continue_final_message and add_generation_prompt cannot both be true: set "
            "add_generation_prompt to false to continue the final message.",
            param="continue_final_message",
        )
    return continue_final


def kv_transfer(params: dict[str, Any] | None) -> KVTransferParams | None:
    """A request's `kv_transfer_params` (prefill/decode disaggregation), or None."""
    if not params:
        return None
    flags = {}
    for key in ("do_remote_decode", "do_remote_prefill"):
        value = params.get(key, False)
        if not isinstance(value, bool):
            raise RequestError(
                f"kv_transfer_params.{key} must be true or false", param="kv_transfer_params"
            )
        flags[key] = value
    return KVTransferParams(**flags) if any(flags.values()) else None


def with_thinking_budget(
    params: SamplingParams,
    num_tokens: int | None,
    server_parser: str | None,
    request_parser: str | None,
    tokenizer,
) -> SamplingParams:
    """`thinking_token_budget` (vLLM's name; Anthropic's budget_tokens is the same budget):
    after that many reasoning tokens the engine writes the end marker itself. It needs the
    server's reasoning parser to know the markers (else a 400 naming it: the budget would
    silently do nothing); with thinking turned off in the template there is none to cut."""
    if num_tokens is None:
        return params
    if server_parser is None:
        raise RequestError(
            "thinking_token_budget: this server cannot tell the model's reasoning from its "
            "answer (start it with --reasoning-parser).",
            param="thinking_token_budget",
        )
    if request_parser is None:
        return params
    budget = budget_for(num_tokens, request_parser, tokenizer)
    return msgspec.structs.replace(params, thinking_budget=budget)
