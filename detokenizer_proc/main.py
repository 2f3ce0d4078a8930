"""A detokenizer worker process (`zllm: detokenizer I`).

core ──DetokenizerBatch──► [PULL detokenizer_in[I]]   (the core sends every request whose
                                                       crc32(id) % M == I here, so its
                                                       decoding state lives in one place)
    incremental detokenization, stop strings
──FrontendBatch──► frontend          ──FinishSequence──► core (a stop string matched)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec
import zmq

from zllm.detokenizer_proc.incremental import IncrementalDetokenizer
from zllm.procutil import index_arg, report_ready, start_process
from zllm.protocol import (
    DetokenizerBatch,
    DetokRequest,
    EngineCoreOutput,
    FinishReason,
    FinishSequence,
    FrontendBatch,
    LogprobsLists,
    RequestOutputDelta,
)
from zllm.tokenizer_proc.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("zllm.detokenizer")


@dataclass(slots=True)
class _RequestState:
    info: DetokRequest
    samples: list[IncrementalDetokenizer]
    finished: set[int] = field(default_factory=set)


class Detokenizer:
    """Per-request incremental decoding for the requests one worker owns."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def process(
        self, batch: DetokenizerBatch
    ) -> tuple[list[RequestOutputDelta], list[FinishSequence]]:
        if batch.reset:
            self.requests.clear()
        for info in batch.new_requests:
            self.requests[info.req_id] = _RequestState(
                info,
                [
                    IncrementalDetokenizer(
                        self.tokenizer,
                        info.prompt_tail,
                        info.skip_special_tokens,
                        info.stop,
                        info.include_stop_str_in_output,
                    )
                    for _ in range(info.n)
                ],
            )
        deltas: list[RequestOutputDelta] = []
        stops: list[FinishSequence] = []
        for out in batch.outputs:
            delta = self._process_output(out, stops)
            if delta is not None:
                deltas.append(delta)
        return deltas, stops

    def _process_output(self, out: EngineCoreOutput, stops: list[FinishSequence]):
        state = self.requests.get(out.req_id)
        if state is None:
            return None  # failed upstream, or a token computed after its stop string
        if out.sample_index < 0:  # the whole request was aborted
            del self.requests[out.req_id]
            return None
        i = out.sample_index
        if i in state.finished:
            return None
        detok = state.samples[i]
        stop_str = detok.update(out.new_token_ids)
        finish_reason = str(out.finish_reason) if out.finish_reason is not None else None
        stop_reason = out.stop_reason
        if stop_str is not None:
            finish_reason, stop_reason = str(FinishReason.STOP), stop_str
            if out.finish_reason is None:
                stops.append(FinishSequence(out.req_id, i))
        finished = finish_reason is not None
        if finished:
            state.finished.add(i)
            if len(state.finished) == state.info.n:
                del self.requests[out.req_id]
        return RequestOutputDelta(
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
        )

    def _token_texts(self, logprobs: LogprobsLists | None) -> list[list[str]] | None:
        if logprobs is None:
            return None
        decode = self.tokenizer.decode
        return [[decode([t], skip_special_tokens=False) for t in row] for row in logprobs.token_ids]


def main() -> None:
    index = index_arg()
    config = start_process("detokenizer", index)
    detokenizer = Detokenizer(load_tokenizer(config.engine.model_path, config.chat_template))

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(config.endpoints.detokenizer_in[index])
    to_frontend = ctx.socket(zmq.PUSH)
    to_frontend.connect(config.endpoints.frontend_in)
    to_core = ctx.socket(zmq.PUSH)
    to_core.connect(config.endpoints.core_in)
    decoder = msgspec.msgpack.Decoder(DetokenizerBatch)
    encoder = msgspec.msgpack.Encoder()
    report_ready(config, "detokenizer", index)
    while True:
        data = inbox.recv()
        try:
            batch = decoder.decode(data)
        except msgspec.DecodeError as e:
            logger.error("dropping a malformed batch (%d bytes): %s", len(data), e)
            continue
        deltas, stops = detokenizer.process(batch)
        for stop in stops:
            to_core.send(encoder.encode(stop))
        if deltas:
            to_frontend.send(encoder.encode(FrontendBatch(deltas)))


if __name__ == "__main__":
    main()
