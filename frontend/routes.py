"""Every route of the server, in one table: the Starlette app (frontend/app.py), the door in
front of it (frontend/access/middleware.py) and /openapi.json (frontend/openapi.py) are all made
from `ROUTES`, so they cannot disagree.

A route's handler is either an `ApiCall` (a generation API: its body becomes engine requests
through `Generation.serve`, admitted, with a tenant) or the path of an `OpenAIServer`
attribute (frontend/handlers/: "tokens.tokenize" is its token routes' handler). A route with
a `body` gets it decoded (a 400 naming the field) before its handler runs; every failure is
an error in the route's API's shape (OpenAI's or Anthropic's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from starlette.responses import Response

from zllm.config.engine import sleep_refusal
from zllm.config.serve import ServeConfig
from zllm.errors import RequestError
from zllm.frontend.access.permissions import Access
from zllm.frontend.anthropic import api as anthropic_api
from zllm.frontend.anthropic.api import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    MessagesCall,
    MessagesRequest,
)
from zllm.frontend.anthropic.output import MessagesResponse
from zllm.frontend.generate import ApiCall
from zllm.frontend.openai.api import ChatCall, CompletionsCall
from zllm.frontend.openai.embeddings import ClassifyCall, EmbeddingsCall
from zllm.frontend.openai.pooling_protocol import (
    ClassifyRequest,
    ClassifyResponse,
    EmbeddingsRequest,
    EmbeddingsResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from zllm.frontend.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeBody,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterBody,
    ModelList,
    TokenizeBody,
    TokenizeResponse,
    UnloadLoRAAdapterBody,
)
from zllm.frontend.openai.scoring import RerankCall, ScoreCall
from zllm.frontend.replies import error_response
from zllm.frontend.responses.api import RESPONSE_OBJECT, ResponsesCall, ResponsesRequest


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How one API spells an error: the response, and its schema for /openapi.json."""

    response: Callable[[RequestError], Response]
    schema: type[msgspec.Struct]


OPENAI_ERRORS = ErrorShape(error_response, ErrorResponse)
ANTHROPIC_ERRORS = ErrorShape(anthropic_api.error_response, AnthropicError)


@dataclass(frozen=True, slots=True)
class Schema:
    """A schema that is no Struct: named (a component), or inline, in a media type."""

    schema: dict[str, Any]
    name: str | None = None
    media_type: str = "application/json"


@dataclass(frozen=True, slots=True)
class Operation:
    """A route as /openapi.json describes it."""

    operation_id: str
    summary: str
    response: type[msgspec.Struct] | Schema | None = None  # None: a 200 with no body
    errors: tuple[int, ...] = ()
    stream: bool = False  # also answers server-sent events
    ok: str = "OK"  # the 200's description
    parameters: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class ApiRoute:
    path: str
    method: Literal["GET", "POST"]
    handler: type[ApiCall] | str  # a generation API, or an OpenAIServer attribute (dotted)
    body: type[msgspec.Struct] | None = None
    doc: Operation | None = None  # None: not in /openapi.json
    errors: ErrorShape = OPENAI_ERRORS
    access: Access = Access.API
    documented_if: Callable[[ServeConfig], bool] | None = None  # a feature's routes

    @property
    def generation(self) -> bool:
        return not isinstance(self.handler, str)


def _lora_on(config: ServeConfig) -> bool:
    return config.engine.lora is not None


def _sleep_on(config: ServeConfig) -> bool:
    return sleep_refusal(config.engine) is None


GENERATION_ERRORS = (400, 401, 404, 413, 503, 504)
BODY_ERRORS = (400, 401, 404, 413)
_TEXT = Schema({"type": "string"}, media_type="text/plain")
_SLEEP_LEVEL = {"name": "level", "in": "query", "schema": {"type": "integer", "enum": [1, 2]}}
_WAKE_TAGS = {  # repeatable: ?tags=weights&tags=kv_cache (none: both)
    "name": "tags",
    "in": "query",
    "schema": {"type": "array", "items": {"type": "string", "enum": ["weights", "kv_cache"]}},
}
_SLEEPING = Schema({"type": "object", "properties": {"is_sleeping": {"type": "boolean"}}})
_FLAG = {"type": "boolean", "default": False}
_RESET_TIERS = {"name": "tiers", "in": "query", "schema": _FLAG}
_RESET_EXTERNAL = {"name": "reset_external", "in": "query", "schema": _FLAG}  # vLLM's name
_RESET = Schema(
    {
        "type": "object",
        "properties": {
            "reset": {"type": "boolean"},
            "blocks_dropped": {"type": "integer"},
            "tier_blocks_dropped": {
                "type": "object",
                "properties": {"cpu": {"type": "integer"}, "disk": {"type": "integer"}},
            },
        },
    }
)

ROUTES: tuple[ApiRoute, ...] = (
    ApiRoute(
        "/v1/completions",
        "POST",
        CompletionsCall,
        CompletionRequest,
        Operation(
            "createCompletion",
            "Complete prompts (JSON, or server-sent events with `stream`).",
            CompletionResponse,
            GENERATION_ERRORS,
            stream=True,
        ),
    ),
    ApiRoute(
        "/v1/chat/completions",
        "POST",
        ChatCall,
        ChatCompletionRequest,
        Operation(
            "createChatCompletion",
            "Answer a conversation (JSON, or server-sent events with `stream`).",
            ChatCompletionResponse,
            GENERATION_ERRORS,
            stream=True,
        ),
    ),
    ApiRoute(
        "/v1/embeddings",
        "POST",
        EmbeddingsCall,
        EmbeddingsRequest,
        Operation(
            "createEmbedding",
            "The prompts' final hidden states, pooled and normalised as the model says "
            "(its sentence-transformers files, --pooling, --pooler-config).",
            EmbeddingsResponse,
            GENERATION_ERRORS,
        ),
    ),
    ApiRoute(
        "/classify",
        "POST",
        ClassifyCall,
        ClassifyRequest,
        Operation(
            "classify",
            "vLLM's: each input's label probabilities from a sequence-classification model's "
            "head (softmax over its labels; one label: a sigmoid score).",
            ClassifyResponse,
            GENERATION_ERRORS,
        ),
    ),
    ApiRoute(
        "/score",
        "POST",
        ScoreCall,
        ScoreRequest,
        Operation(
            "score",
            "vLLM's: how well text_1 goes with each text_2, by a cross-encoder (its sigmoid score) or an embedding model (the cosine of the two vectors).",
            ScoreResponse,
            GENERATION_ERRORS,
        ),
    ),
    ApiRoute(
        "/v1/score",
        "POST",
        ScoreCall,
        ScoreRequest,
        Operation(
            "scoreV1",
            "/score under /v1 (vLLM serves both).",
            ScoreResponse,
            GENERATION_ERRORS,
        ),
    ),
    ApiRoute(
        "/rerank",
        "POST",
        RerankCall,
        RerankRequest,
        Operation(
            "rerank",
            "Jina's and Cohere's: the documents ranked by relevance to the query (scored as /score), the best top_n.",
            RerankResponse,
            GENERATION_ERRORS,
        ),
    ),
    ApiRoute(
        "/v1/rerank",
        "POST",
        RerankCall,
        RerankRequest,
        Operation(
            "rerankV1",
            "/rerank under /v1 (vLLM serves both).",
            RerankResponse,
            GENERATION_ERRORS,
        ),
    ),
    ApiRoute(
        "/v1/responses",
        "POST",
        ResponsesCall,
        ResponsesRequest,
        Operation(
            "createResponse",
            "OpenAI's Responses API, stateless (JSON, or its server-sent events with "
            "`stream`): function tools, tool_choice, function_call / function_call_output "
            "items, text.format, reasoning items; previous_response_id, store true and "
            "fields zllm does not implement are 400s naming them.",
            Schema(RESPONSE_OBJECT, name="ResponseObject"),
            GENERATION_ERRORS,
            stream=True,
        ),
    ),
    ApiRoute(
        "/v1/messages",
        "POST",
        MessagesCall,
        MessagesRequest,
        Operation(
            "createMessage",
            "Anthropic's Messages API (JSON, or Anthropic's server-sent events with "
            "`stream`); errors in Anthropic's shape.",
            MessagesResponse,
            GENERATION_ERRORS,
            stream=True,
        ),
        ANTHROPIC_ERRORS,
    ),
    ApiRoute(
        "/v1/messages/count_tokens",
        "POST",
        "tokens.count_tokens",
        CountTokensRequest,
        Operation(
            "countMessageTokens",
            "The prompt tokens a Messages request would have.",
            CountTokensResponse,
            BODY_ERRORS,
        ),
        ANTHROPIC_ERRORS,
    ),
    ApiRoute(
        "/v1/models",
        "GET",
        "models",
        doc=Operation("listModels", "The served model names.", ModelList, (401,)),
    ),
    ApiRoute(
        "/tokenize",
        "POST",
        "tokens.tokenize",
        TokenizeBody,
        Operation(
            "tokenize",
            "Token ids of a prompt or of chat messages.",
            TokenizeResponse,
            BODY_ERRORS,
        ),
    ),
    ApiRoute(
        "/detokenize",
        "POST",
        "tokens.detokenize",
        DetokenizeBody,
        Operation("detokenize", "Text of token ids.", DetokenizeResponse, BODY_ERRORS),
    ),
    ApiRoute(
        "/health",
        "GET",
        "health",
        doc=Operation(
            "health",
            "200 when every process is up and the engine answers, else 503.",
            errors=(503,),
            ok="Healthy.",
        ),
        access=Access.PUBLIC,
    ),
    ApiRoute(
        "/version",
        "GET",
        "version",
        doc=Operation("version", "The server's version.", ok="The version."),
        access=Access.OBSERVABILITY,
    ),
    ApiRoute("/metrics", "GET", "metrics", access=Access.OBSERVABILITY),
    ApiRoute("/dashboard", "GET", "prometheus.dashboard.page", access=Access.OBSERVABILITY),
    ApiRoute("/dashboard/stats", "GET", "prometheus.dashboard.stats", access=Access.OBSERVABILITY),
    ApiRoute("/openapi.json", "GET", "openapi"),
    # vLLM's run-time LoRA routes (with --enable-lora); they answer in plain text.
    ApiRoute(
        "/v1/load_lora_adapter",
        "POST",
        "control.load_lora_adapter",
        LoadLoRAAdapterBody,
        Operation(
            "loadLoraAdapter",
            "Check a PEFT LoRA adapter against the base model and serve it under lora_name.",
            _TEXT,
            (400, 401),
        ),
        documented_if=_lora_on,
    ),
    ApiRoute(
        "/v1/unload_lora_adapter",
        "POST",
        "control.unload_lora_adapter",
        UnloadLoRAAdapterBody,
        Operation(
            "unloadLoraAdapter",
            "Stop serving an adapter (its running requests finish).",
            _TEXT,
            (400, 401, 404),
        ),
        documented_if=_lora_on,
    ),
    ApiRoute(
        "/reset_prefix_cache",
        "POST",
        "control.reset_prefix_cache",
        doc=Operation(
            "resetPrefixCache",
            "Forget every cached prefix block no running request holds (pins released), on "
            "every engine, while serving; tiers=1 empties the cpu and disk KV tiers too.",
            _RESET,
            errors=(400, 401),
            parameters=(_RESET_TIERS, _RESET_EXTERNAL),
        ),
    ),
    # Sleep mode's routes (with --enable-sleep-mode), as vLLM names them.
    ApiRoute(
        "/sleep",
        "POST",
        "control.sleep",
        doc=Operation(
            "sleep",
            "Release the KV cache (level 1; the weights stay in host memory) or the weights "
            "too (level 2) while idle (400 while requests run).",
            errors=(400, 401),
            ok="Done.",
            parameters=(_SLEEP_LEVEL,),
        ),
        documented_if=_sleep_on,
    ),
    ApiRoute(
        "/wake_up",
        "POST",
        "control.wake_up",
        doc=Operation(
            "wakeUp",
            "Restore what sleep released, or the parts tags name; the engine serves once both "
            "are back and the prefix cache starts empty.",
            errors=(400, 401),
            ok="Done.",
            parameters=(_WAKE_TAGS,),
        ),
        documented_if=_sleep_on,
    ),
    ApiRoute(
        "/is_sleeping",
        "GET",
        "control.is_sleeping",
        doc=Operation("isSleeping", "Whether the engine sleeps.", _SLEEPING),
        documented_if=_sleep_on,
    ),
)
