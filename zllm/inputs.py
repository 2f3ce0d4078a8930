"""The one set of checks a prompt passes before it may run, with one set of messages.

The tokenizer workers run them (so a chat request's error talks about its messages), the
engine core runs them again on every request it admits (the executor must never see an
out-of-vocabulary id, whoever sent the request), and the offline `LLM` runs them before
queueing anything. The context-length wording is vLLM's, so clients that parse it keep
working.
"""

from __future__ import annotations

from collections.abc import Sequence

from zllm.errors import ContextOverflow, ParamError
from zllm.sampling_params import SamplingParams


def check_prompt(
    token_ids: Sequence[int],
    *,
    max_tokens: int | None,
    max_model_len: int,
    vocab_size: int,
    param: str = "prompt",
    pooling: bool = False,
) -> None:
    """Raise ParamError (naming `param`) unless the prompt can run to `max_tokens` outputs.

    `max_tokens=None` asks for as many tokens as fit, so only one free position is needed.
    `param` is "messages" for a chat request, whose text says so. `pooling`: an embedding,
    classification or score request, which samples nothing: its prompt may fill the context
    (a sentence-transformers model's 256-token limit takes 256-token inputs).
    """
    if not token_ids:
        raise ParamError("The prompt is empty; it must contain at least one token.", param)
    check_vocabulary(token_ids, vocab_size, param)
    num_tokens = len(token_ids)
    where = "messages" if param == "messages" else "prompt"
    if pooling:
        if num_tokens > max_model_len:
            raise ParamError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_tokens} tokens in the input for embedding generation. Please "
                f"reduce the length of the input (or set truncate_prompt_tokens).",
                param,
            )
        return
    if max_tokens is not None and num_tokens + max_tokens > max_model_len:
        raise ContextOverflow(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_tokens + max_tokens} tokens ({num_tokens} in the {where}, "
            f"{max_tokens} in the completion). Please reduce the length of the {where} or "
            "completion.",
            param,
            num_tokens,
            max_tokens,
            max_model_len,
        )
    if num_tokens >= max_model_len:  # (max_tokens=None: as many as fit, at least one)
        raise ParamError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_tokens} input tokens, leaving no room for output. Please "
            f"reduce the length of the {where}.",
            param,
        )


def truncate_prompt(
    token_ids: list[int], keep: int | None, max_model_len: int, param: str = "prompt"
) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: the context
    length; None: all). A `keep` beyond the context length is a ParamError, since no prompt
    that long could run; the cut is from the left, so the end the model continues stays."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise ParamError(
            f"truncate_prompt_tokens ({keep}) must be at most the model's context length "
            f"({max_model_len}).",
            "truncate_prompt_tokens",
        )
    return token_ids[-keep:]


def check_vocabulary(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Raise ParamError (naming `param`) if any id is outside the vocabulary."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ParamError(f"Token id {bad} is out of vocabulary range [0, {vocab_size}).", param)


def check_token_params(params: SamplingParams, vocab_size: int) -> None:
    """The token ids a request's sampling names (logit_bias keys, stop_token_ids,
    allowed_token_ids, bad words' encodings) index the logits: each must be in the
    vocabulary."""
    if params.logit_bias:
        check_vocabulary(list(params.logit_bias), vocab_size, "logit_bias")
    check_vocabulary(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_vocabulary(params.allowed_token_ids or [], vocab_size, "allowed_token_ids")
    for ids in params.bad_words_token_ids:
        check_vocabulary(ids, vocab_size, "bad_words")
    if params.allowed_token_ids:
        always_banned = {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
        if always_banned.issuperset(params.allowed_token_ids):
            raise ParamError(
                "Every token in allowed_token_ids is a one-token bad word: no token could be "
                "sampled.",
                "allowed_token_ids",
            )
    if params.thinking_budget is not None:
        budget = params.thinking_budget
        markers = [*budget.end_token_ids, *budget.start_token_ids]
        check_vocabulary(markers, vocab_size, "thinking_budget")
