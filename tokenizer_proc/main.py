"""A tokenizer worker process (`zllm: tokenizer I`).

frontend ──TokenizeRequest──► [PULL tokenizer_in] (ZeroMQ load-balances the N workers)
    RequestTokenizer (request_tokenizer.py, which the offline LLM runs too): apply the chat
    template, tokenize, cut the prompt to truncate_prompt_tokens and encode the bad_words,
    check the prompt (zllm.inputs) and compile any structured-outputs grammar (a 400 if it
    cannot), add the ids that end generation and the model's default max_tokens
──EngineCoreRequest──► core            or   ──RequestRejected──► frontend

With --data-parallel-size N, each worker also subscribes to every core's [PUB events]
(heartbeats, KV cache events) and picks the core of each request (router.py): the request
goes to that engine's core, and a RequestRouted tells the frontend which engine it is on.
A disaggregation consumer's request marked do_remote_prefill goes to the engine its blocks
are sent to (zllm/config/kv_transfer.py `consumer_engine`).
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from zllm.config.kv_transfer import consumer_engine
from zllm.config.serve import ServeConfig
from zllm.kv.block_hash import BlockHash, cache_salt, hash_full_blocks, with_image_words
from zllm.kv.state_layout import num_state_slots
from zllm.media.placeholders import model_placeholders
from zllm.protocol import (
    EngineCoreRequest,
    ProcessRole,
    RequestRejected,
    RequestRouted,
    RouterInput,
    TokenizeRequest,
)
from zllm.runtime.messaging import receive, receive_nowait
from zllm.runtime.procutil import index_arg, report_ready, start_process
from zllm.text.tokenizer import load_tokenizer
from zllm.tokenizer_proc.request_tokenizer import RequestTokenizer
from zllm.tokenizer_proc.router import Router

logger = logging.getLogger("zllm.text.tokenizer")


class EngineSender:
    """Sends each tokenized request to a core: the one engine's, or with several engines
    the one the router picks, telling the frontend which."""

    def __init__(self, ctx: zmq.Context, config: ServeConfig) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.block_size = config.engine.cache.block_size
        self.prefix_caching = config.engine.cache.enable_prefix_caching
        transfer = config.engine.kv_transfer
        self.consumes = transfer is not None and transfer.consumes
        self.to_frontend = ctx.socket(zmq.PUSH)
        self.to_frontend.connect(config.endpoints.frontend_in)
        self.to_cores = []
        for engine in config.endpoints.engines:
            sock = ctx.socket(zmq.PUSH)
            # Several engines: queue nothing for a core that is not connected (a dead one),
            # so a send to it fails at once and the request goes to another.
            sock.setsockopt(zmq.IMMEDIATE, len(config.endpoints.engines) > 1)
            sock.connect(engine.core_in)
            self.to_cores.append(sock)
        self.router: Router | None = None
        self.events: zmq.Socket | None = None
        if len(self.to_cores) > 1:
            self.router = Router(len(self.to_cores), config.data_parallel_routing)
            self.events = ctx.socket(zmq.SUB)
            self.events.setsockopt(zmq.SUBSCRIBE, b"")
            for engine in config.endpoints.engines:
                self.events.connect(engine.events)

    def send(self, result: EngineCoreRequest | RequestRejected) -> None:
        if isinstance(result, RequestRejected):
            self.to_frontend.send(self.encoder.encode(result))
        elif self.router is None:
            self.to_cores[0].send(self.encoder.encode(result))
        else:
            self._route(result)

    def _route(self, req: EngineCoreRequest) -> None:
        assert self.router is not None
        hashes = []
        if self.prefix_caching:
            salt = cache_salt(req.options)
            ids = req.prompt_token_ids  # (an image's tokens hash as the image: block_hash.py)
            if req.images:
                ids = with_image_words(ids, req.images)
            hashes = hash_full_blocks(ids, self.block_size, salt=salt)
        pinned = self._remote_engine(req, hashes)
        data = self.encoder.encode(req)
        tried: list[int] = []
        while (engine := self.router.choose(hashes, tried, pinned)) is not None:
            if pinned is not None and engine != pinned:  # its blocks' engine is down
                req, pinned = unmarked(req), None
                data = self.encoder.encode(req)
            try:
                self.to_cores[engine].send(data, flags=zmq.NOBLOCK)
            except zmq.Again:  # its core is gone (or not keeping up): try another
                logger.warning("engine %d is not taking requests; routing around it", engine)
                self.router.mark_down(engine)
                tried.append(engine)
                continue
            self.router.routed(engine, hashes)
            self.to_frontend.send(self.encoder.encode(RequestRouted(req.req_id, engine)))
            return
        message = "no engine is serving right now (all are restarting); retry shortly"
        self.to_frontend.send(self.encoder.encode(RequestRejected(req.req_id, message, 503)))

    def _remote_engine(self, req: EngineCoreRequest, hashes: list[BlockHash]) -> int | None:
        """A disaggregation consumer's request marked do_remote_prefill: the engine its
        producer sends its blocks to (None: not one, or no full block to send)."""
        params = req.options.kv_transfer
        if not self.consumes or params is None or not params.do_remote_prefill:
            return None
        return consumer_engine(hashes, len(self.to_cores))


def unmarked(req: EngineCoreRequest) -> EngineCoreRequest:
    """`req` without do_remote_prefill: it computes its prompt without waiting for blocks."""
    params = req.options.kv_transfer
    assert params is not None
    params = msgspec.structs.replace(params, do_remote_prefill=False)
    options = msgspec.structs.replace(req.options, kv_transfer=params)
    return msgspec.structs.replace(req, options=options)


def main() -> None:
    index = index_arg()
    config = start_process(ProcessRole.TOKENIZER, index)
    engine = config.engine
    tokenizer = load_tokenizer(engine.tokenizer_path, config.chat_template)
    handle = RequestTokenizer(
        tokenizer,
        engine.scheduler.max_model_len,
        engine.arch.vocab_size,
        engine.arch.eos_token_ids,
        engine.generation_config.defaults.max_tokens,
        model_placeholders(engine.model_path, engine.arch.vision, tokenizer.token_text),
        engine.pooler.prompt,
        engine.runner == "pooling",
        num_state_slots(engine.arch, engine.scheduler.max_num_seqs),
    )

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(config.endpoints.tokenizer_in)
    sender = EngineSender(ctx, config)
    report_ready(config, ProcessRole.TOKENIZER, index)
    requests = msgspec.msgpack.Decoder(TokenizeRequest)
    if sender.events is None:
        for req in receive(inbox, requests, logger):
            sender.send(handle(req))
    router, events = sender.router, sender.events
    assert router is not None
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(events, zmq.POLLIN)
    engine_news = msgspec.msgpack.Decoder(RouterInput)
    while True:
        ready = dict(poller.poll())
        if events in ready:  # first: route with the freshest view
            for msg in receive_nowait(events, engine_news, logger):
                router.on_message(msg)
        if inbox in ready:
            for req in receive_nowait(inbox, requests, logger):
                sender.send(handle(req))


if __name__ == "__main__":
    main()
