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


class RequestError(Exception):
    """A failed request: its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "InternalServerError")
