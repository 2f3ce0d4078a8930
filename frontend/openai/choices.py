"""From engine output deltas to OpenAI choices and usage: completions (several prompts,
echo, legacy logprobs) and chat (tool calls and reasoning through frontend/tools.py), as
stream chunks or whole. No I/O here: frontend/generate.py drives these.

A completions request with several prompts becomes one engine request per prompt; its
choices are numbered `prompt_index * n + sample_index`, as OpenAI numbers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zllm.frontend.openai.format import PromptInput
from zllm.frontend.openai.logprobs import LogprobText, chat_logprobs, completion_logprobs
from zllm.frontend.openai.protocol import (
    ChatChoice,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionStreamChoice,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    PromptTokensDetails,
    ToolCallMessage,
    UsageInfo,
)
from zllm.frontend.replies import check_failed
from zllm.frontend.tools import ChoiceParser
from zllm.protocol import LogprobsLists, RequestOutputDelta


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


def _reason(delta: RequestOutputDelta) -> str | None:
    """The finish reason as OpenAI spells it ("stop", "length", ...), or None."""
    return None if delta.finish_reason is None else str(delta.finish_reason)


class _Fragments:
    """Non-streaming: each delta's fragment (`add`) is kept, by choice, for `finish`."""

    _parts: list[list[Any]]

    def add(self, prompt_index: int, delta: RequestOutputDelta) -> Any: ...

    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        fragment = self.add(prompt_index, delta)
        if fragment is not None:
            self._parts[fragment.index].append(fragment)


@dataclass
class CompletionAssembler(_Fragments):
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
        check_failed(delta)
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

    def finish(self) -> list[CompletionChoice]:
        """Whole choices from the collected fragments (non-streaming)."""
        return [
            CompletionChoice(
                index=index,
                text="".join(p.text for p in parts),
                logprobs=self._whole_logprobs(parts),
                finish_reason=self.choices[index].finish_reason,
                stop_reason=self.choices[index].stop_reason,
                prompt_logprobs=self.prompt_logprobs.get(index // self.n),
            )
            for index, parts in enumerate(self._parts)
        ]

    def _whole_logprobs(self, parts: list[CompletionStreamChoice]) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        logprobs = CompletionLogprobs()
        for p in parts:
            if p.logprobs is not None:
                logprobs = _concat(logprobs, p.logprobs)
        return logprobs


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
class ChatAssembler(_Fragments):
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
        check_failed(delta)
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

    def finish(self) -> list[ChatChoice]:
        """Whole choices from the collected fragments (non-streaming)."""
        return [
            ChatChoice(
                index=index,
                message=_whole_message(parts),
                logprobs=ChatLogprobs(
                    content=[c for p in parts if p.logprobs for c in p.logprobs.content or []]
                )
                if self.want_logprobs
                else None,
                finish_reason=self.choices[index].finish_reason,
                stop_reason=self.choices[index].stop_reason,
            )
            for index, parts in enumerate(self._parts)
        ]


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
