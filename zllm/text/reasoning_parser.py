"""Reasoning models: the `<think>...</think>` part of an answer, apart from the answer.

    deepseek_r1  DeepSeek-R1 and its distills: their chat templates open the think block in
                 the prompt, so the output starts inside the reasoning (a leading `<think>`
                 is accepted and dropped); `</think>` ends it. No `</think>` at all: the
                 whole output was reasoning.
    qwen3        Qwen 3: reasoning only when the output opens with `<think>` (after
                 whitespace); then until `</think>` (or the end). Otherwise all is content
                 (thinking turned off, or a model that does not think).
    glm45, kimi_k2   GLM-4.5/4.6/4.7 and Kimi K2 Thinking: as qwen3 (the model writes
                 `<think>`; GLM's template writes an empty block when thinking is off).
    minimax_m2   MiniMax-M2: as deepseek_r1 (its template ends the prompt with `<think>`).
    gemma4       Gemma 4: as qwen3 with its own markers, `<|channel>thought` and `<channel|>`
                 (the whitespace after the opening one dropped; its template closes an empty
                 block in the prompt when thinking is off).
    openai_gptoss  gpt-oss: harmony's channels (zllm/text/tool_parsers/harmony.py), which
                 give tool calls too; the same parser as --tool-call-parser openai.

Streaming: `feed` returns what each chunk adds to `reasoning` and `content`; a chunk's tail
that could be the start of a tag is held back until the next chunk shows what it is (or
`finish`). Whitespace right after `</think>` is dropped, as the templates put a newline
there. The pieces concatenate to exactly what `parse_reasoning` returns for the whole text;
nothing is lost and nothing raises. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from zllm.text.tool_parsers.harmony import REASONING_PARSER_NAME, HarmonyParser

_START, _END = "<think>", "</think>"


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""  # goes to `reasoning_content`
    content: str = ""  # goes to `content`


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkReasoningParser:
    """Splits a streamed answer at `<think>` / `</think>` (see the module docstring), or at a
    family's own markers (START, END)."""

    START, END = _START, _END
    SKIP_SPACE_AFTER_START = False  # (Gemma 4 writes a newline after its opening marker)

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        # "opening": may still see the opening tag; "after_start": dropping the whitespace
        # after it (SKIP_SPACE_AFTER_START); "reasoning"; "after_end": dropping the
        # whitespace after </think>; "content".
        self.state = "opening"
        self.starts_in_reasoning = starts_in_reasoning
        self.pending = ""  # text held back: a possible tag, or leading whitespace
        self.saw_reasoning = starts_in_reasoning

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would be reasoning, as far as the parser knows yet (the
        Responses API counts a chunk's tokens as reasoning by it)."""
        if self.state in ("reasoning", "after_start"):
            return True
        return self.state == "opening" and self.starts_in_reasoning

    def reasoning_markers(self) -> tuple[str | None, str]:
        """(the opening marker the model writes, None where the template opens the
        reasoning; the closing marker)."""
        return (None if self.starts_in_reasoning else self.START), self.END

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self.pending += text
        while self.pending:
            if not self._step(out, final=False):
                break
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        while self.pending:
            if not self._step(out, final=True):
                break
        if self.pending:  # a held-back partial tag at the very end is plain text
            self._emit(out, self.pending)
            self.pending = ""
        return out

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self.state == "reasoning":
            out.reasoning += text
        elif self.state == "opening":
            # Never opened: reasoning for a model that starts in it, else content.
            if self.starts_in_reasoning:
                out.reasoning += text
            else:
                out.content += text
        else:
            out.content += text

    def _step(self, out: ReasoningDelta, final: bool) -> bool:
        """Consume what can be decided of `pending`; False when the rest must wait."""
        text = self.pending
        if self.state == "opening":
            stripped = text.lstrip()
            if stripped.startswith(self.START):
                self.pending = stripped[len(self.START) :]
                self.state = "after_start" if self.SKIP_SPACE_AFTER_START else "reasoning"
                self.saw_reasoning = True
                return True
            if not final and (not stripped or self.START.startswith(stripped)):
                return False  # whitespace or the start of <think>: wait
            self.state = "reasoning" if self.starts_in_reasoning else "content"
            return True
        if self.state == "reasoning":
            end = text.find(self.END)
            if end >= 0:
                out.reasoning += text[:end]
                self.pending = text[end + len(self.END) :]
                self.state = "after_end"
                return True
            keep = 0 if final else _partial_suffix(text, self.END)
            out.reasoning += text[: len(text) - keep]
            self.pending = text[len(text) - keep :]
            return False
        if self.state in ("after_start", "after_end"):  # whitespace after a marker: dropped
            stripped = text.lstrip()
            if not stripped:
                self.pending = "" if final else text
                return False
            self.pending = stripped
            self.state = "reasoning" if self.state == "after_start" else "content"
            return True
        out.content += text
        self.pending = ""
        return False


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    def __init__(self) -> None:
        super().__init__(starts_in_reasoning=True)


class Qwen3ReasoningParser(ThinkReasoningParser):
    def __init__(self) -> None:
        super().__init__(starts_in_reasoning=False)


class Gemma4ReasoningParser(ThinkReasoningParser):
    START, END = "<|channel>thought", "<channel|>"
    SKIP_SPACE_AFTER_START = True

    def __init__(self) -> None:
        super().__init__(starts_in_reasoning=False)


REASONING_PARSERS: dict[str, type[ThinkReasoningParser] | type[HarmonyParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "glm45": Qwen3ReasoningParser,
    "kimi_k2": Qwen3ReasoningParser,
    "minimax_m2": DeepSeekR1ReasoningParser,
    "gemma4": Gemma4ReasoningParser,
    REASONING_PARSER_NAME: HarmonyParser,
}


def reasoning_markers(parser_name: str) -> tuple[str | None, str]:
    """(the opening marker the model writes, None where the template opens the reasoning;
    the closing marker) of a parser's models: what a thinking budget counts from and forces."""
    return REASONING_PARSERS[parser_name]().reasoning_markers()


def parse_reasoning(parser_name: str, text: str) -> tuple[str | None, str]:
    """(reasoning, or None when the answer had none; content) of a whole answer."""
    parser = REASONING_PARSERS[parser_name]()
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning + last.reasoning
    content = first.content + last.content
    return (reasoning if parser.saw_reasoning or reasoning else None), content
