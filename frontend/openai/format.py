"""From OpenAI request bodies to what the engine runs: the prompts of a completions
request, chat messages as the template sees them, and SamplingParams (a bad value is a 400
naming the request's own field). No I/O here: frontend/openai/api.py drives these, and the
answers go back through frontend/openai/choices.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from zllm.config.generation import SamplingDefaults
from zllm.errors import ParamError, RequestError
from zllm.frontend.openai.protocol import (
    MAX_LOGPROBS,
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    ToolCallMessage,
)
from zllm.sampling_params import SamplingParams, StructuredOutputsParams

# ---- requests ------------------------------------------------------------------------------


@dataclass(slots=True)
class PromptInput:
    text: str | None = None
    token_ids: list[int] | None = None


def prompt_inputs(prompt: str | list) -> list[PromptInput]:
    """The prompts of a completions request: text, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [PromptInput(text=prompt)]
    if not prompt:
        raise RequestError("prompt must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [PromptInput(token_ids=list(prompt))]
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(
            f"A request may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}.",
            param="prompt",
        )
    if all(isinstance(p, str) for p in prompt):
        return [PromptInput(text=p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise RequestError("prompt must not contain an empty token list.", param="prompt")
        return [PromptInput(token_ids=p) for p in prompt]
    raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists (not a mix).",
        param="prompt",
    )


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: text content (parts are joined), and, as
    transformers' templates expect them, an assistant turn's `tool_calls` (arguments as a
    mapping when they are JSON) and a tool result's `tool_call_id`. An assistant turn's
    reasoning goes in as `reasoning` and `reasoning_content` (vLLM's names: Qwen 3's
    templates read the latter) and as `thinking` (gpt-oss's template renders it as the
    analysis before a tool call)."""
    if not messages:
        raise RequestError("messages must not be empty.", param="messages")
    result = []
    for i, m in enumerate(messages):
        content: str | list[dict[str, str]]
        if isinstance(m.content, list):
            parts: list[dict[str, str]] = []
            for j, part in enumerate(m.content):
                if part.type == "text" and part.text is not None:
                    parts.append({"type": "text", "text": part.text})
                elif part.type == "image_url" and part.image_url is not None:
                    parts.append({"type": "image"})  # where the template puts the image
                elif part.type == "image_url":
                    raise RequestError(
                        "an image_url part needs image_url: {url: a data:, http(s): or file: URL}.",
                        param=f"messages[{i}].content[{j}].image_url",
                    )
                else:
                    raise RequestError(
                        f"content parts of type {part.type!r} are not supported; zllm takes "
                        "text and image_url parts.",
                        param=f"messages[{i}].content[{j}]",
                    )
            if all(p["type"] == "text" for p in parts):  # text only: one string, as before
                content = "\n".join(p["text"] for p in parts)
            else:  # images: the parts in order, as transformers' chat templates take them
                content = parts
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None and m.role == "assistant":
            message.update(reasoning=reasoning, reasoning_content=reasoning, thinking=reasoning)
        result.append(message)
    return result


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image a chat request names: its URL (data:, http(s): or file:) and its part's path
    in the request (for errors)."""

    url: str
    where: str


def chat_images(messages: list[ChatMessage]) -> list[ImageRef]:
    """Every image part of the conversation, in the order the prompt holds them."""
    images = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type != "image_url" or part.image_url is None:
                continue
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            where = getattr(part, "where", "") or f"messages[{i}].content[{j}]"
            images.append(ImageRef(url, where))
    return images


def _template_tool_call(call: ToolCallMessage) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments  # not JSON: the template gets the text
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "allowed_token_ids",  # vLLM's extras: checked against the vocabulary by the tokenizer
    "bad_words",  # worker, which also encodes the bad words and cuts the prompt
    "truncate_prompt_tokens",
)


def sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    max_tokens_name: str = "max_tokens",
    logprobs_name: str = "logprobs",
    max_model_len: int | None = None,
    defaults: SamplingDefaults | None = None,
) -> SamplingParams:
    """SamplingParams from a request body; a bad value is a 400 naming the field. A field
    the body leaves unset takes the model's generation_config default (`defaults`), else
    zllm's; the default max_tokens is the tokenizer worker's (it needs the prompt length)."""
    for name, value in ((logprobs_name, logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value > MAX_LOGPROBS:
            raise RequestError(f"{name} must be at most {MAX_LOGPROBS}, got {value}.", param=name)
    _check_max_tokens(max_tokens, max_tokens_name, max_model_len)
    kwargs = _defaults_or_beam(body, defaults)
    kwargs |= {
        "n": body.n,
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": body.skip_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
    }
    if body.stop is not None:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.store:
        raise RequestError(
            "store: zllm keeps no record of responses; send store false or leave it out.",
            param="store",
        )
    if body.modalities is not None and body.modalities != ["text"]:
        raise RequestError(
            "unsupported parameter: modalities (zllm answers in text only)", param="modalities"
        )
    kwargs["structured_outputs"] = structured_outputs(body)
    if body.logit_bias:
        kwargs["logit_bias"] = _logit_bias(body.logit_bias)
    for name in _SAMPLING_FIELDS:
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ParamError as e:  # the request's own name for the field, where it differs
        param = {"max_tokens": max_tokens_name, "logprobs": logprobs_name}.get(e.param, e.param)
        raise RequestError(str(e), param=param) from None


def _defaults_or_beam(body: SamplingFields, defaults: SamplingDefaults | None) -> dict[str, Any]:
    """The model's sampling defaults, or beam search's settings (deterministic: the model's
    sampling defaults do not apply)."""
    if body.use_beam_search:
        return {
            "use_beam_search": True,
            "beam_width": body.beam_width,
            "length_penalty": body.length_penalty,
            "early_stopping": body.early_stopping,
        }
    if body.beam_width is not None:
        raise RequestError("beam_width needs use_beam_search.", param="beam_width")
    return defaults.overrides(with_max_tokens=False) if defaults else {}


def _check_max_tokens(max_tokens: int | None, name: str, max_model_len: int | None) -> None:
    if max_model_len is not None and max_tokens is not None and max_tokens > max_model_len:
        raise RequestError(
            f"{name} must be at most the model's context length ({max_model_len}), "
            f"got {max_tokens}.",
            param=name,
        )


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise RequestError("logit_bias keys must be token ids.", param="logit_bias") from None


def structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """What the answer must match: `structured_outputs` as given, or OpenAI's
    response_format (json_object: any JSON object; json_schema: that schema)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return body.structured_outputs
    if body.structured_outputs is not None:
        raise RequestError(
            "Set response_format or structured_outputs, not both.", param="response_format"
        )
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise RequestError(
            "response_format of type json_schema needs json_schema.schema.",
            param="response_format.json_schema",
        )
    return StructuredOutputsParams(json=fmt.json_schema.schema)


def completion_params(
    req: CompletionRequest,
    max_model_len: int | None = None,
    defaults: SamplingDefaults | None = None,
) -> tuple[SamplingParams, bool]:
    """SamplingParams of a completions request, and whether it only echoes the prompt.

    `echo` with `max_tokens=0` (scoring a prompt, as evaluation harnesses do) runs one
    token and drops it, since the engine always samples at least one.
    """
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError(
            f"best_of must equal n ({req.n}): zllm draws no extra candidates to rank.",
            param="best_of",
        )
    echo_only = req.echo and req.max_tokens == 0
    logprobs = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if req.echo and logprobs is not None:  # the echoed prompt carries logprobs too
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    params = sampling_params(
        req,
        max_tokens=1 if echo_only else req.max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        max_model_len=max_model_len,
        defaults=defaults,
    )
    return params, echo_only


def chat_params(
    req: ChatCompletionRequest,
    max_model_len: int | None = None,
    defaults: SamplingDefaults | None = None,
) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    use_completion_name = req.max_completion_tokens is not None
    return sampling_params(
        req,
        max_tokens=req.max_completion_tokens if use_completion_name else req.max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        max_tokens_name="max_completion_tokens" if use_completion_name else "max_tokens",
        logprobs_name="top_logprobs",
        max_model_len=max_model_len,
        defaults=defaults,
    )
