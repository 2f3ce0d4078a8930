"""The tokenizer worker's job without its sockets: a TokenizeRequest in, an EngineCoreRequest
(or why it cannot run) out.

It applies the chat template, tokenizes, cuts the prompt to truncate_prompt_tokens, encodes
the bad_words, checks the prompt and the token ids its sampling names (zllm.inputs), compiles
any structured-outputs grammar, and adds the ids that end generation and the model's default
max_tokens. The offline `LLM` runs this same code on its prompts (`prompt_of` and `check`),
so a bad prompt gets one message whether it is sent to `zllm serve` or to `LLM.generate`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from zllm.config.generation import default_max_tokens, merge_eos_token_ids
from zllm.errors import ParamError
from zllm.inputs import check_prompt, check_token_params, truncate_prompt
from zllm.kv.state_layout import check_sequences_fit
from zllm.media.placeholders import place_images
from zllm.model.image_tokens import ImagePlaceholders
from zllm.protocol import (
    CachePin,
    EngineCoreRequest,
    PlacedImage,
    RequestOptions,
    RequestRejected,
    TokenizeRequest,
)
from zllm.sampling_params import SamplingParams
from zllm.text.bad_words import with_bad_words_ids
from zllm.text.structured_outputs import check_structured_outputs
from zllm.text.tokenizer import Tokenizer


class RequestTokenizer:
    """Turns a TokenizeRequest into an EngineCoreRequest, or says why it cannot run."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        max_new_tokens: int | None = None,
        placeholders: ImagePlaceholders | None = None,
        embed_prompt: str = "",
        pooling_only: bool = False,
        state_slots: int = 0,
    ) -> None:
        """`eos_token_ids`: the model's (ModelArchConfig.eos_token_ids), which stop besides
        the tokenizer's EOS; `max_new_tokens`: generation_config's, for requests without
        max_tokens; `placeholders`: a vision model's image tokens (zllm/media/placeholders.py);
        `embed_prompt`: the instruction an embeddings request's text prompt is prefixed with
        (zllm/config/pooler.py); `pooling_only`: the model runs as a pooling model (--runner
        pooling), which answers embeddings requests only."""
        self.placeholders = placeholders
        self.embed_prompt = embed_prompt
        self.pooling_only = pooling_only
        self.state_slots = state_slots
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = merge_eos_token_ids([tokenizer.eos_token_id], eos_token_ids)
        self.max_new_tokens = max_new_tokens

    def __call__(self, req: TokenizeRequest) -> EngineCoreRequest | RequestRejected:
        if req.timing is not None:
            req.timing.tokenize_start = time.time()
        try:
            _, ids = self.prompt_of(req)
            request = self.check(req, ids)
        except ParamError as e:
            return RequestRejected.of(req.req_id, e)
        if req.timing is not None:
            req.timing.tokenize_end = time.time()
        return request

    def prompt_of(self, req: TokenizeRequest) -> tuple[str | None, list[int]]:
        """The prompt's text (the rendered chat template for messages; the request's own
        `prompt`, if any, for token ids) and its token ids. ParamError if it cannot be built
        (a template error, bad messages: the client's problem)."""
        param = "messages" if req.messages is not None else "prompt"
        if req.prompt_token_ids is not None:
            if req.images:
                raise ParamError("images go with a text prompt or chat messages", param)
            return req.prompt, list(req.prompt_token_ids)
        try:
            if req.messages is None:
                text = self._with_images(req.prompt or "", req)
                if req.sampling_params.embed:
                    text = self.embed_prompt + text
                return text, self.tokenizer.encode(text, req.add_special_tokens)
            text = self.tokenizer.apply_chat_template(
                req.messages,
                req.add_generation_prompt,
                chat_template=req.chat_template,
                continue_final_message=req.continue_final_message,
                **_template_extra(req),
            )
            text = self._with_images(text, req)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        except ParamError:
            raise
        except Exception as e:
            raise ParamError(f"Could not build the prompt: {e}", param) from e

    def _with_images(self, text: str, req: TokenizeRequest) -> str:
        """The prompt with each image's marker expanded to its tokens."""
        if not req.images:
            return text
        param = "messages" if req.messages is not None else "prompt"
        if self.placeholders is None:
            raise ParamError("this model does not take image input (a text-only model)", param)
        try:
            return self.placeholders.expand(text, self.placeholders.counts(req.images))
        except ValueError as e:
            raise ParamError(str(e), param) from None

    def check(self, req: TokenizeRequest, ids: list[int]) -> EngineCoreRequest:
        """The request for the core, its prompt `ids` cut and checked; ParamError (naming the
        field at fault) if it cannot run."""
        param = "messages" if req.messages is not None else "prompt"
        if self.pooling_only and not req.sampling_params.embed:
            raise ParamError(
                "this model runs as a pooling model (--runner pooling: an embedding model or a "
                "classifier): it answers /v1/embeddings or /classify, /score and /rerank, not "
                "generation",
                "model",
            )
        params = with_bad_words_ids(req.sampling_params, self.tokenizer)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        check_prompt(
            ids,
            max_tokens=params.max_tokens,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            param=param,
            pooling=params.embed,
        )
        check_token_params(params, self.vocab_size)
        if self.state_slots:
            check_sequences_fit(params, self.state_slots)
        placed: list[PlacedImage] = []
        if req.images:
            assert self.placeholders is not None  # (prompt_of refused them otherwise)
            try:
                placed = place_images(ids, req.images, self.placeholders)
            except ValueError as e:
                raise ParamError(str(e), param) from None
        if params.structured_outputs is not None:
            # Compiled here, off the core's and executor's loops: a grammar that cannot
            # compile is a 400 before anything is scheduled.
            check_structured_outputs(params.structured_outputs)
        return EngineCoreRequest(
            req_id=req.req_id,
            prompt_token_ids=ids,
            sampling_params=self._with_max_tokens(params, len(ids)),
            arrival_time=req.arrival_time,
            eos_token_ids=self.eos_token_ids,
            client_id=req.client_id,
            options=self._with_pin_tokens(req, ids),
            timing=req.timing,
            images=placed,
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


def _template_extra(req: TokenizeRequest) -> dict[str, Any]:
    """What the chat template gets beside the messages: the request's chat_template_kwargs
    (checked by the frontend: no reserved names) and its tools."""
    extra = dict(req.chat_template_kwargs or {})
    if req.tools:
        extra["tools"] = req.tools
    return extra
