"""Sampling parameters: keyword names and defaults follow vLLM's `SamplingParams`.

A msgspec Struct so the same object travels between processes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from zllm.errors import ParamError

_SAMPLING_EPS = 1e-5

# The parts of SamplingParams that are Structs of their own live here with it (vLLM's path),
# below the wire that carries them (zllm/protocol.py); their rules live in zllm/text/
# (structured_outputs.py compiles the grammar, thinking_budget.py tracks the reasoning).
_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_PARAM = "structured_outputs"  # the request field errors name


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's `StructuredOutputsParams`: set exactly one field."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # Whitespace between JSON tokens: none (compact, the default: fewer tokens, fewer ways
    # to wander) or what the model likes (True).
    whitespace_flexible: bool = False
    # zllm's own: the grammar applies only after the model emits this token (its output is
    # free until then): `</think>` for reasoning models, a tool-call opening tag for tool
    # calls. With `repeat`, once the grammar completes the output is free again until the
    # next such token (one constrained tool call per opening tag).
    after_token: int | None = None
    # The same after a sequence of tokens: harmony's `<|channel|>final<|message|>` (gpt-oss's
    # answer opens with several tokens). An empty list holds the grammar from the output's
    # first token even where a reasoning parser would make it wait (frontend/tools.py).
    after_tokens: list[int] | None = None
    repeat: bool = False

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            given = ", ".join(kinds) or "none"
            raise ParamError(
                f"structured outputs take exactly one of {', '.join(_KINDS)}; got {given}.",
                _PARAM,
            )
        if self.choice is not None and not self.choice:
            raise ParamError("choice must list at least one string.", _PARAM)
        if self.after_token is not None and self.after_tokens is not None:
            raise ParamError("set after_token or after_tokens, not both.", _PARAM)

    def trigger(self) -> tuple[int, ...]:
        """The tokens whose appearance at the output's end starts the grammar (none: it holds
        from the first token)."""
        if self.after_tokens is not None:
            return tuple(self.after_tokens)
        return () if self.after_token is None else (self.after_token,)

    def kinds(self) -> list[str]:
        # json_object=False counts as unset.
        return [k for k in _KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]


class ThinkingBudget(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Anthropic's `thinking.budget_tokens`: the end marker is forced after this many
    reasoning tokens (zllm/text/thinking_budget.py)."""

    max_tokens: int  # reasoning tokens before the end marker is forced (0: at once)
    end_token_ids: list[int]  # the end marker's encoding (`</think>`)
    # The opening marker the model writes itself (Qwen 3's `<think>`): reasoning starts after
    # it. Empty: the template opened it, so the output starts inside the reasoning.
    start_token_ids: list[int] = []


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering (vLLM accepts both)
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The answer must match this JSON schema / regex / choice / grammar (structured_outputs.py).
    structured_outputs: StructuredOutputsParams | None = None
    # Added to these tokens' logits before sampling (OpenAI's logit_bias: -100 bans, +100
    # all but forces); a structured-outputs grammar still has the last word.
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids): a mask on the logits.
    allowed_token_ids: list[int] | None = None
    # Words the output never contains (vLLM's bad_words). Their encodings, which the executor
    # bans, are filled in where a tokenizer is: the tokenizer worker, the offline LLM
    # (zllm/text/bad_words.py); the executor has none.
    bad_words: list[str] = msgspec.field(default_factory=list)
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    # Keep only the prompt's last k tokens (-1: the model's context length), cut after
    # tokenizing (zllm/inputs.py truncate_prompt); vLLM's truncate_prompt_tokens.
    truncate_prompt_tokens: int | None = None
    # Reasoning cut at this many tokens: the end marker is then forced (thinking_budget.py).
    thinking_budget: ThinkingBudget | None = None
    # A pooling request (embeddings, classification, scores): its prompt's final hidden
    # states pooled as EngineConfig.pooler says come back instead of tokens. Never served
    # from the prefix cache.
    embed: bool = False
    # Beam search (vLLM's extra parameters): keep the `beam_width` (default: n) most likely
    # sequences each step and return the best n; deterministic, so temperature and the
    # other sampling settings do not apply. length_penalty and early_stopping as in
    # transformers (score = cumulative logprob / length ** length_penalty).
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def penalizes_output(self) -> bool:
        """Whether a penalty reads the tokens generated so far (presence, frequency,
        repetition): the asynchronous executor then runs this request's steps one at a
        time (executor/async_steps.py needs_host_tokens)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def num_beams(self) -> int:
        return self.beam_width or self.n

    def beam_candidates(self, num_eos: int) -> int:
        """Beam search: the candidate next tokens each beam reports a step, as many as
        transformers keeps overall (enough to leave num_beams running after EOS ids)."""
        return max(2, 1 + num_eos) * self.num_beams

    def validate(self) -> None:
        """Raise ParamError naming the offending field; called at construction."""

        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise ParamError(message, param)

        # `not x >= 0`-style checks also refuse NaN.
        check(self.n >= 1, "n", f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}.")
        check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
        )
        check(
            self.temperature >= 0.0,
            "temperature",
            f"temperature must be non-negative, got {self.temperature}.",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        check(
            self.top_k >= 0,
            "top_k",
            f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.",
        )
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}.",
        )
        check(
            self.min_tokens >= 0,
            "min_tokens",
            f"min_tokens must be non-negative, got {self.min_tokens}.",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
            f"got {self.min_tokens}.",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or value >= 0, name, f"{name} must be non-negative, got {value}.")
        check(all(self.stop), "stop", "stop strings must not be empty.")
        self._validate_token_rules(check)
        self._validate_beam_search(check)

    def _validate_token_rules(self, check) -> None:
        """The fields that name token ids (masks, bans, biases, stops, the thinking budget)
        and the prompt truncation."""
        allowed = self.allowed_token_ids
        check(
            allowed is None or (bool(allowed) and all(t >= 0 for t in allowed)),
            "allowed_token_ids",
            "allowed_token_ids must be a non-empty list of token ids.",
        )
        check(
            all(word.strip() for word in self.bad_words),
            "bad_words",
            "bad_words must not be empty or blank.",
        )
        check(
            all(ids and min(ids) >= 0 for ids in self.bad_words_token_ids),
            "bad_words",
            "bad_words_token_ids must be non-empty lists of token ids.",
        )
        k = self.truncate_prompt_tokens
        check(
            k is None or k == -1 or k >= 1,
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be -1 (the context length) or at least 1, got {k}.",
        )
        check(
            all(t >= 0 and -100 <= b <= 100 for t, b in (self.logit_bias or {}).items()),
            "logit_bias",
            "logit_bias maps token ids to biases in [-100, 100].",
        )
        check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be non-negative token ids.",
        )
        budget = self.thinking_budget
        check(
            budget is None
            or (
                budget.max_tokens >= 0
                and bool(budget.end_token_ids)
                and all(t >= 0 for t in [*budget.end_token_ids, *budget.start_token_ids])
            ),
            "thinking_budget",
            "thinking_budget needs max_tokens >= 0 and the end marker's token ids.",
        )

    def _validate_beam_search(self, check) -> None:
        check(
            self.early_stopping in (True, False, "never"),
            "early_stopping",
            f'early_stopping must be true, false or "never", got {self.early_stopping!r}.',
        )
        if not self.use_beam_search:
            check(self.beam_width is None, "beam_width", "beam_width needs use_beam_search.")
            return
        check(
            self.beam_width is None or self.beam_width >= 1,
            "beam_width",
            f"beam_width must be at least 1, got {self.beam_width}.",
        )
        check(
            self.n <= self.num_beams,
            "n",
            f"n ({self.n}) must not exceed beam_width ({self.num_beams}).",
        )
        # What beam search here does not combine with: a clear error, not a silent drop.
        unsupported = {
            "stop": bool(self.stop),
            "stop_token_ids": bool(self.stop_token_ids),
            "min_tokens": self.min_tokens > 0,
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured_outputs": self.structured_outputs is not None,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words or self.bad_words_token_ids),
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "embed": self.embed,
        }
        for name, used in unsupported.items():
            check(not used, name, f"{name} is not supported with use_beam_search.")


@dataclass(slots=True)
class BeamSearchParams:
    """`LLM.beam_search`'s settings (vLLM's shape): every one of the `beam_width` best
    hypotheses comes back, best first."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width,
            use_beam_search=True,
            beam_width=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            temperature=0.0,
        )
