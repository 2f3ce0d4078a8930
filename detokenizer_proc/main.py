"""A detokenizer worker process (`zllm: detokenizer I`).

core ──DetokenizerBatch──► [PULL detokenizer_in[I]]   (the core sends every request whose
                                                       crc32(id) % M == I here, so its
                                                       decoding state lives in one place)
    Detokenizer: incremental detokenization, stop strings
──FrontendBatch──► frontend          ──FinishSequence──► core (a stop string matched; the
                                                        core of the engine that sent it)
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from zllm.detokenizer_proc.detokenizer import Detokenizer
from zllm.protocol import DetokenizerBatch, FrontendBatch, ProcessRole
from zllm.runtime.messaging import receive, send_nowait
from zllm.runtime.procutil import index_arg, report_ready, start_process
from zllm.text.tokenizer import load_tokenizer

logger = logging.getLogger("zllm.detokenizer")


def main() -> None:
    index = index_arg()
    config = start_process(ProcessRole.DETOKENIZER, index)
    detokenizer = Detokenizer(load_tokenizer(config.engine.tokenizer_path, config.chat_template))

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(config.endpoints.detokenizer_in[index])
    to_frontend = ctx.socket(zmq.PUSH)
    to_frontend.connect(config.endpoints.frontend_in)
    to_cores = []
    for engine in config.endpoints.engines:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(engine.core_in)
        to_cores.append(sock)
    encoder = msgspec.msgpack.Encoder()
    report_ready(config, ProcessRole.DETOKENIZER, index)
    for batch in receive(inbox, msgspec.msgpack.Decoder(DetokenizerBatch), logger):
        deltas, stops = detokenizer.process(batch)
        for stop in stops:
            # Not blocking: a dead engine's core must not stall the other engines' outputs
            # (its requests are failed, so the stop no longer matters).
            send_nowait(to_cores[batch.engine], encoder, stop, logger)
        if deltas:
            to_frontend.send(encoder.encode(FrontendBatch(deltas)))


if __name__ == "__main__":
    main()
