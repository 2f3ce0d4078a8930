"""What the core tells the client of one sequence after a step (`EngineCoreOutput`): new
tokens, a pooled vector, a beam-search hypothesis, or an error. The scheduler decides; these
only build the messages."""

from __future__ import annotations

import time

from zllm.core.request import Request
from zllm.protocol import EngineCoreOutput, FinishReason, LogprobsLists


def tokens_output(
    req: Request, tokens: list[int], logprobs: LogprobsLists | None, first: bool
) -> EngineCoreOutput:
    """`req`'s new `tokens` (already appended); its `first` output carries the prompt's
    logprobs and how long it queued."""
    out = EngineCoreOutput(
        req_id=req.client_req_id,
        sample_index=req.sample_index,
        new_token_ids=tokens,
        new_logprobs=logprobs,
        new_prompt_logprobs=req.prompt_logprobs if first else None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0),
    )
    if first:
        out.queue_time_s = queue_time(req)
        if req.timing is not None:  # traced: its stages so far go with it, once
            req.timing.scheduled = req.first_scheduled_time or 0.0
            req.timing.first_token = time.time()
            out.timing = req.timing
    return out


def embedding_output(req: Request, vector: list[float]) -> EngineCoreOutput:
    return EngineCoreOutput(
        req_id=req.client_req_id,
        sample_index=req.sample_index,
        new_token_ids=[],
        finish_reason=FinishReason.STOP,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        embedding=vector,
    )


def error_output(req: Request, message: str) -> EngineCoreOutput:
    """The executor could not run `req`: finish reason "error" with its message."""
    return EngineCoreOutput(
        req_id=req.client_req_id,
        sample_index=req.sample_index,
        new_token_ids=[],
        finish_reason=FinishReason.ERROR,
        stop_reason=message,
        num_prompt_tokens=req.num_prompt_tokens,
    )


def queue_time(req: Request) -> float:
    """Seconds from arrival to first scheduled (0.0 when either is unknown)."""
    if req.first_scheduled_time and req.arrival_time:
        return max(0.0, req.first_scheduled_time - req.arrival_time)
    return 0.0


def rows(logprobs: LogprobsLists | None, start: int, count: int) -> LogprobsLists | None:
    """Rows [start, start + count) of a LogprobsLists (one per position), or None."""
    if logprobs is None:
        return None
    end = start + count
    return LogprobsLists(
        token_ids=logprobs.token_ids[start:end],
        logprobs=logprobs.logprobs[start:end],
        ranks=logprobs.ranks[start:end],
    )
