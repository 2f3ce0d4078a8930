"""Per-request incremental detokenization for the requests one detokenizer worker owns.

A plain class (no sockets): the worker process feeds it the core's batches, and the offline
`LLM` runs one in-process the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from zllm.protocol import (
    DetokenizerBatch,
    DetokRequest,
    EngineCoreOutput,
    FinishReason,
    FinishSequence,
    LogprobsLists,
    RequestOutputDelta,
    RequestTiming,
)
from zllm.text.incremental_detokenizer import IncrementalDetokenizer
from zllm.text.tokenizer import Tokenizer


@dataclass(slots=True)
class _RequestState:
    info: DetokRequest
    samples: list[IncrementalDetokenizer]
    engine: int  # the data-parallel engine that runs it
    finished: set[int] = field(default_factory=set)
    timing: RequestTiming | None = None  # a traced request's, from its first output


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def process(
        self, batch: DetokenizerBatch
    ) -> tuple[list[RequestOutputDelta], list[FinishSequence]]:
        """The text deltas of this batch's outputs, and the samples a stop string ended
        (which the core must finish: it does not know yet)."""
        if batch.reset:  # only the restarted engine's requests: the others run on
            for req_id in [r for r, st in self.requests.items() if st.engine == batch.engine]:
                del self.requests[req_id]
        for info in batch.new_requests:
            self.requests[info.req_id] = _RequestState(
                info, [self._sample_decoder(info) for _ in range(info.n)], batch.engine
            )
        deltas: list[RequestOutputDelta] = []
        stops: list[FinishSequence] = []
        received = time.time()  # once a batch: a traced request's stage times
        for out in batch.outputs:
            delta = self._process_output(out, stops, received)
            if delta is not None:
                deltas.append(delta)
        for req_id in batch.aborted:
            self.requests.pop(req_id, None)
        return deltas, stops

    def _sample_decoder(self, info: DetokRequest) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer,
            info.prompt_tail,
            info.skip_special_tokens,
            info.stop,
            info.include_stop_str_in_output,
        )

    def _process_output(
        self, out: EngineCoreOutput, stops: list[FinishSequence], received: float
    ) -> RequestOutputDelta | None:
        state = self.requests.get(out.req_id)
        i = out.sample_index
        if state is None or i in state.finished:
            return None  # failed upstream, or a token computed after its stop string
        detok = state.samples[i]
        if out.timing is not None:
            state.timing = out.timing
            state.timing.detokenize_start = received
        stop_str = detok.update(self._text_ids(out, state.info))
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if stop_str is not None:
            finish_reason, stop_reason = FinishReason.STOP, stop_str
            if out.finish_reason is None:
                stops.append(FinishSequence(out.req_id, i))
        finished = finish_reason is not None
        timing = None
        if finished:
            state.finished.add(i)
            # An error fails the whole request (the frontend answers it 500 on the first
            # one), and a request that failed before its n samples forked has only sample
            # 0 to end: waiting for the others would keep its state for good (issue 56).
            if len(state.finished) == state.info.n or finish_reason == FinishReason.ERROR:
                del self.requests[out.req_id]
                timing = state.timing
        delta = RequestOutputDelta(
            req_id=out.req_id,
            index=i,
            text=detok.take_delta(finished),
            token_ids=out.new_token_ids,
            logprobs=out.new_logprobs,
            logprob_tokens=self._token_texts(out.new_logprobs),
            prompt_logprobs=out.new_prompt_logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            queue_time_s=out.queue_time_s,
            embedding=out.embedding,
            cumulative_logprob=out.cumulative_logprob,
        )
        if timing is not None:  # the request's final delta: its decode and ours end
            timing.last_output = received
            timing.detokenize_end = time.time()
            delta.timing = timing
        return delta

    def _text_ids(self, out: EngineCoreOutput, info: DetokRequest) -> list[int]:
        """The new tokens that make text. With special tokens kept (skip_special_tokens
        false, or a tool parser that needs Mistral's [TOOL_CALLS]), the special token that
        ended the sample (EOS, a stop token id) is not text, as in vLLM."""
        ids = out.new_token_ids
        if (
            info.skip_special_tokens
            or info.include_stop_str_in_output
            or out.finish_reason != FinishReason.STOP
            or isinstance(out.stop_reason, str)
            or not ids
            or self.tokenizer.decode(ids[-1:], skip_special_tokens=True)
        ):
            return ids
        return ids[:-1]

    def _token_texts(self, logprobs: LogprobsLists | None) -> list[list[str]] | None:
        if logprobs is None:
            return None
        decode = self.tokenizer.decode
        return [[decode([t], skip_special_tokens=False) for t in row] for row in logprobs.token_ids]
