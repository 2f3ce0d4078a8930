"""Stop conditions the core checks on token ids (stop strings belong to the detokenizer)."""

from __future__ import annotations

from zllm.core.request import Request
from zllm.protocol import FinishReason


def check_stop(req: Request, max_model_len: int) -> bool:
    """Set `req.finish_reason` (and `stop_reason`) if its newest token ends it."""
    params = req.sampling_params
    num_output = req.num_output_tokens
    if num_output >= params.min_tokens:
        last = req.output_token_ids[-1]
        if not params.ignore_eos and last in req.eos_token_ids:
            req.finish_reason = FinishReason.STOP
            return True
        if last in params.stop_token_ids:
            req.finish_reason = FinishReason.STOP
            req.stop_reason = last
            return True
    if (params.max_tokens is not None and num_output >= params.max_tokens) or (
        req.num_tokens >= max_model_len
    ):
        req.finish_reason = FinishReason.LENGTH
        return True
    return False
