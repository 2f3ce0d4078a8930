"""The token routes: POST /tokenize and /detokenize (vLLM's shapes) and Anthropic's
/v1/messages/count_tokens, with the frontend's tokenizer and chat template; a chat's images
count as the tokens the model gives them (the model's image placeholders, built here)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from zllm.config.serve import ServeConfig
from zllm.errors import ParamError, RequestError
from zllm.frontend import options
from zllm.frontend.anthropic import api as anthropic_api
from zllm.frontend.images import load_images
from zllm.frontend.lora_adapters import LoRAAdapters
from zllm.frontend.openai.format import ImageRef, chat_images, chat_messages
from zllm.frontend.openai.protocol import (
    DetokenizeBody,
    DetokenizeResponse,
    TokenizeBody,
    TokenizeResponse,
)
from zllm.frontend.replies import json_response
from zllm.inputs import check_vocabulary
from zllm.media.images import ImageError, require_vision
from zllm.media.placeholders import model_placeholders
from zllm.text.tokenizer import Tokenizer

# Tokenize or detokenize this much in a worker thread, not on the event loop.
_BIG_INPUT = 16384


class TokenRoutes:
    """The handlers that turn text into tokens and back, without the engine."""

    def __init__(self, config: ServeConfig, tokenizer: Tokenizer, adapters: LoRAAdapters) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.max_model_len = config.engine.scheduler.max_model_len
        # A vision model's image tokens, for the routes that count a prompt's tokens here.
        engine = config.engine
        self.placeholders = model_placeholders(
            engine.model_path, engine.arch.vision, tokenizer.token_text
        )

    async def count_tokens(
        self, request: Request, body: anthropic_api.CountTokensRequest
    ) -> Response:
        model, _ = self.adapters.resolve(body.model)
        chat = anthropic_api.as_chat_request(body)
        images = chat_images(chat.messages)
        tools = [msgspec.to_builtins(t) for t in chat.tools or []] or None
        kwargs = options.template_kwargs(
            body.chat_template_kwargs, self.config.default_chat_template_kwargs
        )
        try:
            text = self.tokenizer.apply_chat_template(
                chat_messages(chat.messages),
                add_generation_prompt=True,
                **kwargs,
                **({"tools": tools} if tools else {}),
            )
        except Exception as e:  # jinja errors, or a model without a template
            raise RequestError(f"Could not apply the chat template: {e}", param="messages") from e
        text = await self._with_image_tokens(text, images, model)
        tokens = await _maybe_in_thread(len(text), self.tokenizer.encode, text, False)
        return json_response(anthropic_api.CountTokensResponse(len(tokens)))

    async def tokenize(self, request: Request, body: TokenizeBody) -> Response:
        model, _ = self.adapters.resolve(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("Give exactly one of prompt and messages.", param="prompt")
        images: list[ImageRef] = []
        if body.messages is not None:
            images = chat_images(body.messages)
            kwargs = options.template_kwargs(
                body.chat_template_kwargs, self.config.default_chat_template_kwargs, body.documents
            )
            continue_final = options.continue_final_message(
                body.continue_final_message, body.add_generation_prompt
            )
            if body.chat_template is not None and not self.config.trust_request_chat_template:
                raise RequestError(  # as chat completions answers (frontend/openai/api.py)
                    "This server does not accept a chat_template in requests "
                    "(start it with --trust-request-chat-template to allow it).",
                    param="chat_template",
                )
            try:
                text = self.tokenizer.apply_chat_template(
                    chat_messages(body.messages),
                    add_generation_prompt=body.add_generation_prompt,
                    chat_template=body.chat_template,
                    continue_final_message=continue_final,
                    **kwargs,
                )
            except Exception as e:  # jinja errors, or a model without a template
                raise RequestError(
                    f"Could not apply the chat template: {e}", param="messages"
                ) from e
            add_special = bool(body.add_special_tokens)
            text = await self._with_image_tokens(text, images, model)
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        tokens = await _maybe_in_thread(len(text), self.tokenizer.encode, text, add_special)
        token_strs = None
        if body.return_token_strs:
            token_strs = [self.tokenizer.backend.id_to_token(t) or "" for t in tokens]
        return json_response(
            TokenizeResponse(
                count=len(tokens),
                max_model_len=self.max_model_len,
                tokens=tokens,
                token_strs=token_strs,
            )
        )

    async def _with_image_tokens(self, text: str, images: list[ImageRef], model: str) -> str:
        """The rendered prompt with its images' tokens in place; a model that takes none says
        so. A model whose images take a fixed count of tokens (Gemma 3) needs only their
        number; one whose count follows the image's size (Qwen2.5-VL) has them read, as a
        generation would (each checked the same way)."""
        if not images:
            return text
        try:
            require_vision(self.config.engine.arch.vision, model)
        except ImageError as exc:
            raise RequestError(str(exc), param=images[0].where) from None
        assert self.placeholders is not None
        if self.placeholders.grid is None:
            counts = [self.placeholders.tokens_per_image] * len(images)
        else:
            loaded = await load_images(images, self.config.engine.media, True, model)
            counts = []
            for ref, image in zip(images, loaded, strict=True):
                try:
                    counts.append(self.placeholders.count(image.width, image.height))
                except ValueError as exc:
                    raise RequestError(f"{ref.where}: {exc}", param=ref.where) from None
        try:
            return self.placeholders.expand(text, counts)
        except ValueError as exc:
            raise RequestError(str(exc), param="messages") from None

    async def detokenize(self, request: Request, body: DetokenizeBody) -> Response:
        self.adapters.resolve(body.model)
        try:
            check_vocabulary(body.tokens, self.tokenizer.vocab_size, "tokens")
        except ParamError as e:
            raise RequestError(str(e), param=e.param) from None
        text = await _maybe_in_thread(len(body.tokens), self.tokenizer.decode, body.tokens, False)
        return json_response(DetokenizeResponse(prompt=text))


async def _maybe_in_thread(size: int, fn: Callable, *args: Any) -> Any:
    if size > _BIG_INPUT:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
