"""Logprobs as the OpenAI APIs show them: token texts, raw bytes (a token may hold part of
a UTF-8 character), the legacy completions shape and chat's, and vLLM's prompt_logprobs."""

from __future__ import annotations

import re

from zllm.frontend.openai.protocol import (
    ChatLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
)
from zllm.protocol import LogprobsLists
from zllm.text.tokenizer import Tokenizer


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
    """Token texts and raw bytes for logprobs, from the frontend's tokenizer. With
    `as_token_ids` (vLLM's return_tokens_as_token_ids) a token is named "token_id:<id>"
    instead of by its text (its `bytes` stay its text's), so a client can tell tokens that
    decode alike apart."""

    def __init__(self, tokenizer: Tokenizer, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def by_token_ids(self, as_token_ids: bool = True) -> LogprobText:
        """These names for a request that asked for token ids (or self)."""
        return LogprobText(self.tokenizer, True) if as_token_ids else self

    def name(self, token_id: int, text: str) -> str:
        """A token as chat's logprobs name it: its text, or "token_id:<id>"."""
        return f"token_id:{token_id}" if self.as_token_ids else text

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
        if self.as_token_ids:
            return f"token_id:{token_id}"
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
            token=names.name(row[0][0], row[0][1]),
            logprob=row[0][2],
            bytes=names.token_bytes(row[0][0], row[0][1]),
            top_logprobs=[
                ChatTopLogprob(
                    token=names.name(tid, t), logprob=lp, bytes=names.token_bytes(tid, t)
                )
                for tid, t, lp in row[1:]
            ],
        )
        for row in rows
    ]
