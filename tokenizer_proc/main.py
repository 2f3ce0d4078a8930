"""A tokenizer worker process (`zllm: tokenizer I`).

frontend ──TokenizeRequest──► [PULL tokenizer_in] (ZeroMQ load-balances the N workers)
    apply the chat template, tokenize, check the prompt fits the context
──EngineCoreRequest──► core            or   ──RequestError──► frontend
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from zllm.procutil import index_arg, report_ready, start_process
from zllm.protocol import EngineCoreRequest, RequestError, TokenizeRequest
from zllm.tokenizer_proc.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("zllm.tokenizer")


class RequestTokenizer:
    """Turns a TokenizeRequest into an EngineCoreRequest, or says why it cannot."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def __call__(self, req: TokenizeRequest) -> EngineCoreRequest | RequestError:
        try:
            ids, param = self._token_ids(req)
        except Exception as e:  # a template error, bad messages: the client's problem
            return RequestError(req.req_id, f"Could not build the prompt: {e}", 400, "messages")
        if not ids:
            return RequestError(req.req_id, "The prompt is empty.", 400, param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return RequestError(
                req.req_id,
                f"Token id {bad} is out of vocabulary range [0, {self.vocab_size}).",
                400,
                param,
            )
        max_tokens = req.sampling_params.max_tokens or 0
        if len(ids) >= self.max_model_len or len(ids) + max_tokens > self.max_model_len:
            where = "messages" if req.messages is not None else "prompt"
            return RequestError(
                req.req_id,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {len(ids) + max_tokens} tokens ({len(ids)} in the "
                f"{where}, {max_tokens} in the completion). Please reduce the length of the "
                f"{where} or completion.",
                400,
                param,
            )
        return EngineCoreRequest(
            req_id=req.req_id,
            prompt_token_ids=ids,
            sampling_params=req.sampling_params,
            arrival_time=req.arrival_time,
            eos_token_id=self.tokenizer.eos_token_id,
        )

    def _token_ids(self, req: TokenizeRequest) -> tuple[list[int], str]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids), "prompt"
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(
                req.messages, req.add_generation_prompt, chat_template=req.chat_template
            )
            return self.tokenizer.encode(text, add_special_tokens=False), "messages"
        return self.tokenizer.encode(req.prompt or "", req.add_special_tokens), "prompt"


def main() -> None:
    index = index_arg()
    config = start_process("tokenizer", index)
    engine = config.engine
    tokenizer = load_tokenizer(engine.model_path, config.chat_template)
    handle = RequestTokenizer(tokenizer, engine.scheduler.max_model_len, engine.arch.vocab_size)

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(config.endpoints.tokenizer_in)
    to_core = ctx.socket(zmq.PUSH)
    to_core.connect(config.endpoints.core_in)
    to_frontend = ctx.socket(zmq.PUSH)
    to_frontend.connect(config.endpoints.frontend_in)
    decoder = msgspec.msgpack.Decoder(TokenizeRequest)
    encoder = msgspec.msgpack.Encoder()
    report_ready(config, "tokenizer", index)
    while True:
        data = inbox.recv()
        try:
            req = decoder.decode(data)
        except msgspec.DecodeError as e:
            logger.error("dropping a malformed request (%d bytes): %s", len(data), e)
            continue
        result = handle(req)
        target = to_core if isinstance(result, EngineCoreRequest) else to_frontend
        target.send(encoder.encode(result))


if __name__ == "__main__":
    main()
