"""A tokenizer worker process (`zllm: tokenizer I`).

frontend ──TokenizeRequest──► [PULL tokenizer_in] (ZeroMQ load-balances the N workers)
    RequestTokenizer: apply the chat template, tokenize, cut the prompt to
    truncate_prompt_tokens and encode the bad_words, check the prompt (zllm.inputs) and
    compile any structured-outputs grammar (a 400 if it cannot), add the ids that end
    generation and the model's default max_tokens
──EngineCoreRequest──► core            or   ──RequestRejected──► frontend

With --data-parallel-size N, each worker also subscribes to every core's [PUB events]
(heartbeats, KV cache events) and picks the core of each request (router.py): the request
goes to that engine's core, and a RequestRouted tells the frontend which engine it is on.
A disaggregation consumer's request marked do_remote_prefill goes to the engine its blocks
are sent to (zllm/config/kv_transfer.py `consumer_engine`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from zllm.config.generation import default_max_tokens, merge_eos_token_ids
from zllm.config.kv_transfer import consumer_engine
from zllm.config.serve import ServeConfig
from zllm.errors import ParamError
from zllm.inputs import check_prompt, check_token_params, truncate_prompt
from zllm.kv.block_hash import BlockHash, cache_salt, hash_full_blocks
from zllm.protocol import (
    CachePin,
    EngineCoreRequest,
    ProcessRole,
    RequestOptions,
    RequestRejected,
    RequestRouted,
    RouterInput,
    TokenizeRequest,
)
from zllm.runtime.messaging import receive, receive_nowait
from zllm.runtime.procutil import index_arg, report_ready, start_process
from zllm.sampling_params import SamplingParams
from zllm.text.bad_words import with_bad_words_ids
from zllm.text.structured_outputs import check_structured_outputs
from zllm.text.tokenizer import Tokenizer, load_tokenizer
from zllm.tokenizer_proc.router import Router

logger = logging.getLogger("zllm.text.tokenizer")


class RequestTokenizer:
    """Turns a TokenizeRequest into an EngineCoreRequest, or says why it cannot run."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        max_new_tokens: int | None = None,
    ) -> None:
        """`eos_token_ids`: the model's (ModelArchConfig.eos_token_ids), which stop besides
        the tokenizer's EOS; `max_new_tokens`: generation_config's, for requests without
        max_tokens."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = merge_eos_token_ids([tokenizer.eos_token_id], eos_token_ids)
        self.max_new_tokens = max_new_tokens

    def __call__(self, req: TokenizeRequest) -> EngineCoreRequest | RequestRejected:
        if req.timing is not None:
            req.timing.tokenize_start = time.time()
        param = "messages" if req.messages is not None else "prompt"
        try:
            ids = self._token_ids(req)
        except Exception as e:  # a template error, bad messages: the client's problem
            return RequestRejected(req.req_id, f"Could not build the prompt: {e}", 400, param)
        params = with_bad_words_ids(req.sampling_params, self.tokenizer)
        try:
            ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
            check_prompt(
                ids,
                max_tokens=params.max_tokens,
                max_model_len=self.max_model_len,
                vocab_size=self.vocab_size,
                param=param,
            )
            check_token_params(params, self.vocab_size)
            if params.structured_outputs is not None:
                # Compiled here, off the core's and executor's loops: a grammar that cannot
                # compile is a 400 before anything is scheduled.
                check_structured_outputs(params.structured_outputs)
        except ParamError as e:
            return RequestRejected(req.req_id, str(e), 400, e.param)
        if req.timing is not None:
            req.timing.tokenize_end = time.time()
        return EngineCoreRequest(
            req_id=req.req_id,
            prompt_token_ids=ids,
            sampling_params=self._with_max_tokens(params, len(ids)),
            arrival_time=req.arrival_time,
            eos_token_ids=self.eos_token_ids,
            client_id=req.client_id,
            options=self._with_pin_tokens(req, ids),
            timing=req.timing,
        )

    def _with_pin_tokens(self, req: TokenizeRequest, ids: list[int]) -> RequestOptions:
        if req.options.cache_pin is None:
            return req.options
        return msgspec.structs.replace(req.options, cache_pin=self._cache_pin(req, ids))

    def _cache_pin(self, req: TokenizeRequest, ids: list[int]) -> CachePin | None:
        """The pin with its token count: the whole prompt, or the tokens that the first
        `num_messages` chat messages render to (the longest run of the prompt's tokens that
        rendering them alone also gives; 0 if the template will not render them alone)."""
        pin = req.options.cache_pin
        if pin is None:
            return None
        num_tokens = len(ids)
        if req.messages is not None and 0 <= pin.num_messages < len(req.messages):
            prefix = req.messages[: pin.num_messages]
            try:
                text = self.tokenizer.apply_chat_template(
                    prefix, False, chat_template=req.chat_template, **_template_extra(req)
                )
                prefix_ids = self.tokenizer.encode(text, add_special_tokens=False)
            except Exception:  # a template that needs a user turn, say: no pin
                prefix_ids = []
            num_tokens = next(
                (i for i, (a, b) in enumerate(zip(prefix_ids, ids, strict=False)) if a != b),
                min(len(prefix_ids), len(ids)),
            )
        return CachePin(ttl_s=pin.ttl_s, num_tokens=num_tokens)

    def _with_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A request without max_tokens gets the model's max_new_tokens. Applied here, not in
        the frontend, because it is cut to the room the prompt leaves, known only once
        tokenized."""
        if params.max_tokens is not None or self.max_new_tokens is None:
            return params
        max_tokens = default_max_tokens(
            self.max_new_tokens, params.min_tokens, num_prompt_tokens, self.max_model_len
        )
        return msgspec.structs.replace(params, max_tokens=max_tokens)

    def _token_ids(self, req: TokenizeRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(
                req.messages,
                req.add_generation_prompt,
                chat_template=req.chat_template,
                continue_final_message=req.continue_final_message,
                **_template_extra(req),
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(req.prompt or "", req.add_special_tokens)


def _template_extra(req: TokenizeRequest) -> dict[str, Any]:
    """What the chat template gets beside the messages: the request's chat_template_kwargs
    (checked by the frontend: no reserved names) and its tools."""
    extra = dict(req.chat_template_kwargs or {})
    if req.tools:
        extra["tools"] = req.tools
    return extra


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
            hashes = hash_full_blocks(req.prompt_token_ids, self.block_size, salt=salt)
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
    tokenizer = load_tokenizer(engine.model_path, config.chat_template)
    handle = RequestTokenizer(
        tokenizer,
        engine.scheduler.max_model_len,
        engine.arch.vocab_size,
        engine.arch.eos_token_ids,
        engine.generation_config.defaults.max_tokens,
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
