"""From OpenAI request bodies to engine requests, and from engine output deltas to OpenAI
choices, logprobs and usage. No I/O here: the HTTP layer (app.py) drives these.

A completions request with several prompts becomes one engine request per prompt; its
choices are numbered `prompt_index * n + sample_index`, as OpenAI numbers them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from zllm.errors import ParamError, RequestError
from zllm.frontend.api_models import (
    MAX_LOGPROBS,
    MAX_PROMPTS,
    ChatChoice,
    ChatCompletionRequest,
    ChatLogprob,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionStreamChoice,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    PromptLogprob,
    PromptTokensDetails,
    SamplingFields,
    ToolCallMessage,
    UsageInfo,
)
from zllm.frontend.tools import ChoiceParser
from zllm.generation_config import SamplingDefaults
from zllm.protocol import FinishReason, LogprobsLists, RequestOutputDelta
from zllm.sampling_params import SamplingParams
from zllm.structured_outputs import StructuredOutputsParams
from zllm.tokenizer import Tokenizer

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
    mapping when they are JSON) and a tool result's `tool_call_id`."""
    if not messages:
        raise RequestError("messages must not be empty.", param="messages")
    result = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise RequestError(
                        f"content parts of type {part.type!r} are not supported; "
                        "this server accepts text only.",
                        param=f"messages[{i}].content",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        result.append(message)
    return result


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
    if max_model_len is not None and max_tokens is not None and max_tokens > max_model_len:
        raise RequestError(
            f"{max_tokens_name} must be at most the model's context length "
            f"({max_model_len}), got {max_tokens}.",
            param=max_tokens_name,
        )
    kwargs: dict = defaults.overrides(with_max_tokens=False) if defaults else {}
    if body.use_beam_search:  # deterministic: the model's sampling defaults do not apply
        kwargs = {
            "use_beam_search": True,
            "beam_width": body.beam_width,
            "length_penalty": body.length_penalty,
            "early_stopping": body.early_stopping,
        }
    elif body.beam_width is not None:
        raise RequestError("beam_width needs use_beam_search.", param="beam_width")
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


# ---- logprobs ------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class LogprobText:
    """Token texts and raw bytes for logprobs, from the frontend's tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own bytes: part of a UTF-8 character decodes to U+FFFD as text."""
        if "\ufffd" in text:
            raw = self.tokenizer.backend.id_to_token(token_id) or ""
            byte = _BYTE_TOKEN.fullmatch(raw)
            if byte:  # a SentencePiece byte-fallback token
                return [int(byte.group(1), 16)]
            if raw and all(c in _UNICODE_TO_BYTE for c in raw):  # byte-level BPE
                return [_UNICODE_TO_BYTE[c] for c in raw]
        return list(text.encode("utf-8"))

    def label(self, token_id: int, text: str) -> str:
        """A token as the legacy completions API names it: part of a UTF-8 character is
        spelled as its bytes (`bytes:\\xe4\\xbd`), so different tokens keep different names."""
        if "\ufffd" not in text:
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id, text))

    def rows(
        self, lists: LogprobsLists, texts: list[list[str]] | None
    ) -> list[list[tuple[int, str, float]]]:
        """(token id, text, logprob) per position, the chosen token first."""
        result = []
        for i, (ids, lps) in enumerate(zip(lists.token_ids, lists.logprobs, strict=False)):
            row_texts = texts[i] if texts is not None and i < len(texts) else None
            if row_texts is None or len(row_texts) != len(ids):
                row_texts = [self.text(t) for t in ids]
            result.append(list(zip(ids, row_texts, lps, strict=False)))
        return result

    def prompt_logprobs(self, lists: LogprobsLists) -> list[dict[int, PromptLogprob] | None]:
        """vLLM's `prompt_logprobs`: None for the first token, then id -> candidate."""
        result: list[dict[int, PromptLogprob] | None] = [None]
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=False):
            position = {ids[0]: PromptLogprob(lps[0], rank, self.text(ids[0]))}
            for k, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=False), start=1):
                position.setdefault(tid, PromptLogprob(lp, k, self.text(tid)))
            result.append(position)
        return result


def completion_logprobs(
    rows: list[list[tuple[int, str, float]]],
    text_offset: int,
    names: LogprobText,
    first_is_unscored: bool = False,
) -> CompletionLogprobs:
    """The legacy completions shape; offsets are into the returned text."""
    out = CompletionLogprobs()
    offset = text_offset
    for i, row in enumerate(rows):
        token_id, text, logprob = row[0]
        label = names.label(token_id, text)
        out.tokens.append(label)
        out.text_offset.append(offset)
        offset += len(text)
        if first_is_unscored and i == 0:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(logprob)
        top = {names.label(tid, t): lp for tid, t, lp in row[1:]}
        top.setdefault(label, logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    rows: list[list[tuple[int, str, float]]], names: LogprobText
) -> list[ChatLogprob]:
    return [
        ChatLogprob(
            token=row[0][1],
            logprob=row[0][2],
            bytes=names.token_bytes(row[0][0], row[0][1]),
            top_logprobs=[
                ChatTopLogprob(token=t, logprob=lp, bytes=names.token_bytes(tid, t))
                for tid, t, lp in row[1:]
            ],
        )
        for row in rows
    ]


# ---- outputs -------------------------------------------------------------------------------


@dataclass(slots=True)
class _ChoiceState:
    text_len: int = 0
    started: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _PromptState:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class Usage:
    """Token counts of one HTTP request: each prompt counted once, every sample's output."""

    prompts: list[_PromptState]
    num_completion_tokens: int = 0

    def add(self, prompt_index: int, delta: RequestOutputDelta, num_tokens: int) -> None:
        p = self.prompts[prompt_index]
        p.num_prompt_tokens = max(p.num_prompt_tokens, delta.num_prompt_tokens)
        p.num_cached_tokens = max(p.num_cached_tokens, delta.num_cached_tokens)
        self.num_completion_tokens += num_tokens

    def info(self) -> UsageInfo:
        prompt = sum(p.num_prompt_tokens for p in self.prompts)
        cached = sum(p.num_cached_tokens for p in self.prompts)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.num_completion_tokens,
            total_tokens=prompt + self.num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


def _check_failed(delta: RequestOutputDelta) -> None:
    if delta.finish_reason == FinishReason.ERROR:
        raise RequestError(
            f"the request failed in the engine: {delta.stop_reason or 'unknown error'}", 500
        )


def _reason(delta: RequestOutputDelta) -> str | None:
    """The finish reason as OpenAI spells it ("stop", "length", ...), or None."""
    return None if delta.finish_reason is None else str(delta.finish_reason)


@dataclass
class CompletionAssembler:
    """Turns the deltas of a completions request into choices (stream chunks or whole)."""

    n: int
    prompts: list[PromptInput]
    echo: bool
    echo_only: bool
    want_logprobs: bool
    want_prompt_logprobs: bool
    names: LogprobText
    choices: list[_ChoiceState] = field(init=False)
    usage: Usage = field(init=False)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    _prompt_lists: dict[int, LogprobsLists] = field(default_factory=dict)
    _parts: list[list[CompletionStreamChoice]] = field(init=False)

    def __post_init__(self) -> None:
        num_choices = self.n * len(self.prompts)
        self.choices = [_ChoiceState() for _ in range(num_choices)]
        self._parts = [[] for _ in range(num_choices)]
        self.usage = Usage([_PromptState() for _ in self.prompts])

    def add(self, prompt_index: int, delta: RequestOutputDelta) -> CompletionStreamChoice | None:
        """This delta as a choice fragment; None when it carries nothing to send."""
        _check_failed(delta)
        index = prompt_index * self.n + delta.index
        state = self.choices[index]
        num_tokens = 0 if self.echo_only else len(delta.token_ids)
        self.usage.add(prompt_index, delta, num_tokens)
        text = "" if self.echo_only else delta.text
        if delta.prompt_logprobs is not None:
            self._prompt_lists.setdefault(prompt_index, delta.prompt_logprobs)
        logprobs = None
        if self.want_logprobs:
            rows = [] if self.echo_only or delta.logprobs is None else self._rows(delta)
            logprobs = completion_logprobs(rows, state.text_len, self.names)
        if self.echo and not state.started:
            echo_text, echo_lp = self._echo(prompt_index)
            if logprobs is not None and echo_lp is not None:
                _shift(logprobs, len(echo_text))
                logprobs = _concat(echo_lp, logprobs)
            text = echo_text + text
        if self.want_prompt_logprobs and prompt_index not in self.prompt_logprobs:
            lists = self._prompt_lists.get(prompt_index)
            if lists is not None:
                self.prompt_logprobs[prompt_index] = self.names.prompt_logprobs(lists)
        state.started = True
        state.text_len += len(text)
        if delta.finish_reason is not None:
            state.finish_reason = "length" if self.echo_only else _reason(delta)
            state.stop_reason = None if self.echo_only else delta.stop_reason
        if not text and delta.finish_reason is None and not (logprobs and logprobs.tokens):
            return None
        return CompletionStreamChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=state.finish_reason if delta.finish_reason is not None else None,
            stop_reason=state.stop_reason if delta.finish_reason is not None else None,
        )

    def _rows(self, delta: RequestOutputDelta):
        return self.names.rows(delta.logprobs, delta.logprob_tokens)

    def _echo(self, prompt_index: int) -> tuple[str, CompletionLogprobs | None]:
        prompt = self.prompts[prompt_index]
        if prompt.text is not None:
            text = prompt.text
        else:
            text = self.names.tokenizer.decode(prompt.token_ids or [], skip_special_tokens=False)
        lists = self._prompt_lists.get(prompt_index)
        if not self.want_logprobs or lists is None:
            return text, None
        if prompt.token_ids is not None:
            first = prompt.token_ids[0]
        else:  # the same encoding the tokenizer workers did
            first = self.names.tokenizer.encode(text)[0]
        head = [[(first, self.names.text(first), 0.0)]]
        return text, completion_logprobs(head + self.names.rows(lists, None), 0, self.names, True)

    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        """Non-streaming: keep this delta's fragment for `finish`."""
        fragment = self.add(prompt_index, delta)
        if fragment is not None:
            self._parts[fragment.index].append(fragment)

    def finish(self) -> list[CompletionChoice]:
        """Whole choices from the collected fragments (non-streaming)."""
        choices = []
        for index, parts in enumerate(self._parts):
            state = self.choices[index]
            logprobs = None
            if self.want_logprobs:
                logprobs = CompletionLogprobs()
                for p in parts:
                    if p.logprobs is not None:
                        logprobs = _concat(logprobs, p.logprobs)
            choices.append(
                CompletionChoice(
                    index=index,
                    text="".join(p.text for p in parts),
                    logprobs=logprobs,
                    finish_reason=state.finish_reason,
                    stop_reason=state.stop_reason,
                    prompt_logprobs=self.prompt_logprobs.get(index // self.n),
                )
            )
        return choices


def _shift(logprobs: CompletionLogprobs, by: int) -> None:
    logprobs.text_offset = [o + by for o in logprobs.text_offset]


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


@dataclass
class ChatAssembler:
    """Turns the deltas of a chat request into choices (stream chunks or whole)."""

    n: int
    want_logprobs: bool
    want_prompt_logprobs: bool
    names: LogprobText
    # One per choice when tools or a reasoning parser shape the text (frontend/tools.py).
    parsers: list[ChoiceParser] | None = None
    choices: list[_ChoiceState] = field(init=False)
    usage: Usage = field(init=False)
    prompt_logprobs: list | None = None
    _parts: list[list[ChatStreamChoice]] = field(init=False)

    def __post_init__(self) -> None:
        self.choices = [_ChoiceState() for _ in range(self.n)]
        self._parts = [[] for _ in range(self.n)]
        self.usage = Usage([_PromptState()])

    def add(self, prompt_index: int, delta: RequestOutputDelta) -> ChatStreamChoice | None:
        """This delta as a choice fragment; None when it carries nothing to send. (A chat
        request has one prompt: `prompt_index` is 0.)"""
        _check_failed(delta)
        state = self.choices[delta.index]
        self.usage.add(0, delta, len(delta.token_ids))
        if delta.prompt_logprobs is not None and self.want_prompt_logprobs:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = self.names.prompt_logprobs(delta.prompt_logprobs)
        logprobs = None
        if self.want_logprobs and delta.logprobs is not None:
            rows = self.names.rows(delta.logprobs, delta.logprob_tokens)
            logprobs = ChatLogprobs(content=chat_logprobs(rows, self.names))
        message = self._message(delta)
        if delta.finish_reason is not None:
            state.finish_reason = self._finish_reason(delta)
            state.stop_reason = delta.stop_reason
        has_text = message.content or message.reasoning_content or message.tool_calls
        if not has_text and delta.finish_reason is None and logprobs is None:
            return None
        return ChatStreamChoice(
            index=delta.index,
            delta=message,
            logprobs=logprobs,
            finish_reason=state.finish_reason if delta.finish_reason is not None else None,
            stop_reason=delta.stop_reason,
        )

    def _message(self, delta: RequestOutputDelta) -> DeltaMessage:
        """The delta's text as content, or split by the choice's parser into reasoning,
        content and tool-call pieces (flushed when the choice finishes)."""
        if self.parsers is None:
            return DeltaMessage(content=delta.text)
        parser = self.parsers[delta.index]
        piece = parser.feed(delta.text)
        if delta.finish_reason is not None:
            rest = parser.finish()
            piece.content += rest.content
            piece.reasoning += rest.reasoning
            piece.tool_calls += rest.tool_calls
        return DeltaMessage(
            content=piece.content,
            reasoning_content=piece.reasoning or None,
            tool_calls=piece.tool_calls or None,
        )

    def _finish_reason(self, delta: RequestOutputDelta) -> str | None:
        """OpenAI's "tool_calls" when the model called tools of its choice (auto, required);
        a named tool_choice ends with "stop", as OpenAI's does."""
        reason = _reason(delta)
        if self.parsers is None or reason != "stop":
            return reason
        parser = self.parsers[delta.index]
        if parser.called_tools and parser.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        """Non-streaming: keep this delta's fragment for `finish`."""
        fragment = self.add(prompt_index, delta)
        if fragment is not None:
            self._parts[fragment.index].append(fragment)

    def finish(self) -> list[ChatChoice]:
        choices = []
        for index, parts in enumerate(self._parts):
            state = self.choices[index]
            logprobs = None
            if self.want_logprobs:
                content = [c for p in parts if p.logprobs for c in p.logprobs.content or []]
                logprobs = ChatLogprobs(content=content)
            choices.append(
                ChatChoice(
                    index=index,
                    message=_whole_message(parts),
                    logprobs=logprobs,
                    finish_reason=state.finish_reason,
                    stop_reason=state.stop_reason,
                )
            )
        return choices


def _whole_message(parts: list[ChatStreamChoice]) -> ChatResponseMessage:
    """A choice's streamed pieces joined: content, reasoning, and each tool call's id, name
    and concatenated arguments."""
    content = "".join(p.delta.content or "" for p in parts)
    reasoning = "".join(p.delta.reasoning_content or "" for p in parts)
    calls: dict[int, ToolCallMessage] = {}
    for p in parts:
        for d in p.delta.tool_calls or []:
            fn = d.function or FunctionCallDelta()
            call = calls.get(d.index)
            if call is None:
                call = calls[d.index] = ToolCallMessage(
                    id=d.id or "", function=FunctionCall(name=fn.name or "", arguments="")
                )
            call.function.arguments += fn.arguments or ""
    # With tool calls and nothing else to say, content is null, as OpenAI sends it.
    message = ChatResponseMessage(content=None if calls and not content.strip() else content)
    if reasoning:
        message.reasoning_content = reasoning
    if calls:
        message.tool_calls = [calls[i] for i in sorted(calls)]
    return message
