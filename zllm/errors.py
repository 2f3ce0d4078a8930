"""The two exceptions a user of zllm meets, shared by every layer.

- `ParamError` (a `ValueError`): a value the caller passed is invalid, and `param` names it
  (`SamplingParams(top_p=0)` -> param "top_p"; an over-long prompt -> "prompt"). The offline
  API raises it as is; the server turns it into a 400 whose `param` is that name.
- `RequestError`: a request failed as a client sees it, with the HTTP status and OpenAI's
  error fields (`param`, `code`). The frontend raises it for bad HTTP input, `EngineClient`
  (and so `AsyncLLM`) for a request the engine refused or lost.
"""

from __future__ import annotations

# OpenAI's error `type` for each status the server sends.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class ParamError(ValueError):
    """An invalid argument; `param` is the name of the field it came from."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextOverflow(ParamError):
    """A prompt and its `max_tokens` that together exceed the context: the three numbers
    travel with the message, so an API whose clients parse their own wording of it
    (Anthropic's "input length and `max_tokens` exceed context limit: A + B > C", which
    Claude Code reads to retry with a smaller max_tokens) can write it."""

    def __init__(
        self, message: str, param: str | None, input_tokens: int, max_tokens: int, limit: int
    ) -> None:
        super().__init__(message, param)
        self.numbers = (input_tokens, max_tokens, limit)


class RequestError(Exception):
    """A failed request: its HTTP status and OpenAI's error fields; `context_overflow`
    (input tokens, max_tokens, context length) when it is a ContextOverflow."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        context_overflow: tuple[int, int, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers
        self.context_overflow = context_overflow

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "InternalServerError")
