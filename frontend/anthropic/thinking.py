"""Anthropic's extended thinking (`thinking` on /v1/messages) on zllm's reasoning parsers.

    {"type": "disabled"}   the template's enable_thinking false (zllm/text/template_kwargs.py),
                           so no reasoning parser: no thinking blocks
    {"type": "enabled",    enable_thinking true, and a thinking budget: after budget_tokens
     "budget_tokens": B}   reasoning tokens the engine writes the end marker itself
                           (zllm/text/thinking_budget.py); B >= 1024 and < max_tokens, as
                           Anthropic checks; needs --reasoning-parser
    {"type": "adaptive"}   the model decides how long it thinks: enable_thinking true, no
                           budget; on a server without --reasoning-parser (which could not
                           tell the thinking from the answer) the template's default, with a
                           warning in the log (Claude Code sends it with every request)
    left out               the template's and the server's defaults, as before

`display` (enabled, adaptive): "summarized" (the default) shows the thinking text, the whole
of it (this server's summary of its reasoning is the reasoning); "omitted" sends thinking
blocks with empty text and a signature of that empty text, as Anthropic omits it.

Thinking blocks carry a `signature`: base64 of an HMAC-SHA256 of the thinking text under the
server's key (--thinking-signature-key-file, or $ZLLM_CACHE/thinking-signature.key made at
first use, 0600), so a client cannot hand the model reasoning it did not write. A thinking
block sent back in an assistant turn must carry a signature that verifies, else a 400 as
Anthropic answers; a valid one is then dropped from the prompt, as Anthropic does with the
thinking of earlier turns.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from pathlib import Path
from typing import Any, Literal

import msgspec

from zllm.errors import RequestError
from zllm.kv.tier_key import make_key_file, read_key, warn_if_shared
from zllm.model.files import cache_dir
from zllm.sampling_params import ThinkingBudget
from zllm.text.thinking_budget import budget_for
from zllm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MIN_BUDGET_TOKENS = 1024  # Anthropic's floor
DEFAULT_KEY_FILE = "thinking-signature.key"
KEY_FLAG = "--thinking-signature-key-file"


Display = Literal["summarized", "omitted"]


class ThinkingEnabled(msgspec.Struct, tag="enabled", tag_field="type", kw_only=True):
    budget_tokens: int
    display: Display | None = None


class ThinkingAdaptive(msgspec.Struct, tag="adaptive", tag_field="type", kw_only=True):
    display: Display | None = None


class ThinkingDisabled(msgspec.Struct, tag="disabled", tag_field="type", kw_only=True):
    pass


ThinkingConfig = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


def check_thinking(thinking: ThinkingConfig, max_tokens: int, reasoning_parser: str | None) -> None:
    """Anthropic's rules for `thinking.enabled`, plus the parser zllm needs to find it."""
    if not isinstance(thinking, ThinkingEnabled):
        return
    if thinking.budget_tokens < MIN_BUDGET_TOKENS:
        raise RequestError(
            f"thinking.enabled.budget_tokens: Input should be greater than or equal to "
            f"{MIN_BUDGET_TOKENS}",
            param="thinking.budget_tokens",
        )
    if max_tokens <= thinking.budget_tokens:
        raise RequestError(
            "`max_tokens` must be greater than `thinking.budget_tokens`.", param="max_tokens"
        )
    if reasoning_parser is None:
        raise RequestError(
            "thinking: this server cannot tell the model's reasoning from its answer (start "
            "it with --reasoning-parser).",
            param="thinking",
        )


def template_switch(
    thinking: ThinkingConfig | None, reasoning_parser: str | None
) -> dict[str, Any]:
    """The template variable `thinking` sets (none when left out, or adaptive on a server
    with no reasoning parser: the template's default then, with a warning)."""
    if thinking is None:
        return {}
    if isinstance(thinking, ThinkingAdaptive) and reasoning_parser is None:
        logger.warning(
            "thinking.adaptive: this server has no --reasoning-parser to tell a model's "
            "thinking from its answer; the chat template's default applies"
        )
        return {}
    return {"enable_thinking": not isinstance(thinking, ThinkingDisabled)}


def omits_thinking(thinking: ThinkingConfig | None) -> bool:
    """display: "omitted": thinking blocks without their text."""
    return isinstance(thinking, ThinkingEnabled | ThinkingAdaptive) and (
        thinking.display == "omitted"
    )


def thinking_budget(
    thinking: ThinkingConfig | None, tokenizer: Tokenizer, reasoning_parser: str | None
) -> ThinkingBudget | None:
    """The engine's budget for `thinking.enabled`: the parser's markers, as token ids."""
    if not isinstance(thinking, ThinkingEnabled) or reasoning_parser is None:
        return None
    return budget_for(thinking.budget_tokens, reasoning_parser, tokenizer)


class ThinkingSigner:
    """Signs thinking text with the server's key, and checks what clients send back.

    The key is read (or made) at first use, not at start: a server whose clients never see
    a thinking block needs no key file, and a cache directory it cannot write stops nothing
    else (the first signature is then a 500 naming the flag)."""

    def __init__(self, key_file: str | None = None, key: bytes | None = None) -> None:
        self._key_file = key_file
        self._key = key

    @classmethod
    def of(cls, key_file: str | None) -> ThinkingSigner:
        """Signs with `key_file`'s key, or $ZLLM_CACHE/thinking-signature.key's."""
        return cls(key_file)

    def key(self) -> bytes:
        if self._key is None:
            path = Path(self._key_file or cache_dir() / DEFAULT_KEY_FILE).expanduser()
            try:
                if not path.exists():
                    make_key_file(path, KEY_FLAG)
                self._key = read_key(str(path), KEY_FLAG)
                warn_if_shared(path, "Thinking signature key")
            except ValueError as e:
                raise RequestError(f"Cannot sign thinking blocks: {e}", status=500) from e
        return self._key

    def sign(self, thinking: str) -> str:
        digest = hmac.new(self.key(), thinking.encode(), hashlib.sha256).digest()
        return base64.b64encode(digest).decode()

    def verify(self, thinking: str, signature: str | None) -> bool:
        # As bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500).
        if signature is None:
            return False
        return hmac.compare_digest(self.sign(thinking).encode(), signature.encode())
