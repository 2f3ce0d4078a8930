"""A detokenizer worker process (`zllm: detokenizer I`).

core ──DetokenizerBatch──► [PULL detokenizer_in[I]]   (the core sends every request whose
                                                       crc32(id) % M == I here, so its
                                                       decoding state lives in one place)
    Detokenizer: incremental detokenization, stop strings
──FrontendBatch──► frontend          ──FinishSequence──► core (a stop string matched)
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from zllm.detokenizer_proc.detokenizer import Detokenizer
from zllm.messaging import receive
from zllm.procutil import index_arg, report_ready, start_process
from zllm.protocol import DetokenizerBatch, FrontendBatch, ProcessRole
from zllm.tokenizer import load_tokenizer

logger = logging.getLogger("zllm.detokenizer")


def main() -> None:
    index = index_arg()
    config = start_process(ProcessRole.DETOKENIZER, index)
    detokenizer = Detokenizer(load_tokenizer(config.engine.model_path, config.chat_template))

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(config.endpoints.detokenizer_in[index])
    to_frontend = ctx.socket(zmq.PUSH)
    to_frontend.connect(config.endpoints.frontend_in)
    to_core = ctx.socket(zmq.PUSH)
    to_core.connect(config.endpoints.core_in)
    encoder = msgspec.msgpack.Encoder()
    report_ready(config, ProcessRole.DETOKENIZER, index)
    for batch in receive(inbox, msgspec.msgpack.Decoder(DetokenizerBatch), logger):
        deltas, stops = detokenizer.process(batch)
        for stop in stops:
            to_core.send(encoder.encode(stop))
        if deltas:
            to_frontend.send(encoder.encode(FrontendBatch(deltas)))


if __name__ == "__main__":
    main()
