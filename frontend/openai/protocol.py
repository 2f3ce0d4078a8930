"""OpenAI-compatible request and response bodies, as msgspec Structs.

Requests are decoded with a typed decoder, so a wrong type is a 400 that names the field.
Unknown fields are ignored (msgspec's default); `decode_body` reports them so the server can
log a warning, as vLLM does. Sampling fields follow vLLM's names and extensions.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from zllm.errors import RequestError
from zllm.sampling_params import StructuredOutputsParams

# ---- limits --------------------------------------------------------------------------------
# Each is part of a field's type, so a request beyond it is a 400 naming the field, and the
# OpenAPI schema (/openapi.json) states it. `max_tokens` is also checked against the
# model's context length, which only the running server knows.

MAX_LOGPROBS = 20  # top logprobs per position (vLLM's default `max_logprobs`)
MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 256
_INT64_MAX = 2**63 - 1

# Integers that fit the wire format (msgpack: 64 bits) and torch's int64.
Int64 = Annotated[int, Meta(ge=-(2**63), le=_INT64_MAX)]
NonNegative = Annotated[int, Meta(ge=0, le=_INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=_INT64_MAX)]  # the vocabulary is checked later
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenIds = Annotated[list[TokenId], Meta(min_length=1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


# ---- requests ------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format.json_schema`. The schema is enforced whether or not
    `strict` is set: the answer always parses and matches."""

    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """The sampling fields the two generation endpoints share (None: the engine default)."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=_INT64_MAX)] | None = None  # 0 or -1: off
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_tokens: NonNegative = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs (json,
    # json_object, regex, choice, grammar); at most one of the two.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Token id (as a string, OpenAI's JSON) -> bias added to its logit, in [-100, 100].
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    # vLLM's extra parameters: only these tokens may be sampled; words the output never
    # contains (zllm/text/bad_words.py); the prompt cut to its last k tokens (-1: the
    # context length); logprobs naming tokens "token_id:<id>" instead of their text.
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    bad_words: Annotated[list[str], Meta(max_length=MAX_BAD_WORDS)] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=_INT64_MAX)] | None = None
    return_tokens_as_token_ids: bool = False
    # OpenAI fields that hold here as they are: labels for the caller's own records, a
    # cache hint (prefix caching is automatic), a tier (one tier here).
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Beam search (vLLM's extra parameters): the beam_width (default n) best hypotheses are
    # kept each step and the best n returned, scored as transformers does.
    use_beam_search: bool = False
    beam_width: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # vLLM's extra parameter: with --scheduling-policy priority, lower values are served
    # first (a 400 under fcfs unless 0).
    priority: Int64 = 0
    # zllm's extra parameter (Anthropic's shape): {"type": "ephemeral", "ttl": "5m"} keeps
    # the prompt's KV blocks cached for ttl after it is computed (zllm/kv/cache_control.py).
    cache_control: dict[str, Any] | None = None
    # vLLM's extra parameter for prefill/decode disaggregation, set by `zllm proxy`:
    # {"do_remote_decode": true} (to a prefill instance: send the prompt's KV on),
    # {"do_remote_prefill": true} (to a decode instance: wait for it). Other keys (vLLM's
    # NIXL fields) are ignored.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's extra parameter: this request's KV blocks are shared (prefix cache, KV tiers)
    # only with requests that give the same salt.
    cache_salt: str | None = None
    # Only what zllm does: nothing stored (true is a 400), text out (anything else a 400).
    store: bool = False
    modalities: list[str] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # Fields of OpenAI's completions schema zllm does not implement: a 400 naming them.
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("suffix",)

    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    # (msgspec allows one array type per union, so the list's items are checked by hand.)
    prompt: str | Annotated[list[str | TokenId | TokenIds], Meta(min_length=1)]
    max_tokens: NonNegative | None = 16  # 0 only with echo: score the prompt
    logprobs: NumLogprobs | None = None
    echo: bool = False
    prompt_logprobs: NumLogprobs | None = None
    add_special_tokens: bool = True
    # Candidates to rank: only n itself (vLLM's V1 engine draws no extra ones either).
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None


class ImageURL(msgspec.Struct, kw_only=True):
    url: str
    detail: str | None = None  # OpenAI's low/high/auto: the model's processor decides here


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None  # type "image_url" (a bare string taken too)


class SourcedImagePart(ContentPart, kw_only=True):
    """An image part another API's request became (an Anthropic image block, a Responses
    input_image): `where` is its path in that request, for errors. Built in code, never
    decoded from a request."""

    where: str = ""


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallMessage(msgspec.Struct, kw_only=True):
    """A tool call in an assistant message (the request's history, or a response)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    # An assistant turn's reasoning, sent back as this server returned it (vLLM takes both
    # names); the chat template gets it (frontend/openai/format.py).
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, kw_only=True):
    # Fields of OpenAI's chat schema zllm does not implement: a 400 naming them.
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "audio",
        "function_call",
        "functions",
        "moderation",
        "prediction",
        "prompt_cache_options",
        "prompt_cache_retention",
        "verbosity",
        "web_search_options",
    )

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[Tool] | None = None
    # none / auto (needs --tool-call-parser) / required / one named function; default: auto
    # when tools are given, else none.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # A template variable, as vLLM passes it (gpt-oss-style templates set the model's
    # reasoning level from it; a template that does not read it is unchanged).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: at most this many reasoning tokens, then the end marker (frontend/options.py).
    thinking_token_budget: Annotated[int, Meta(ge=1)] | None = None
    max_tokens: NonNegative | None = None
    max_completion_tokens: NonNegative | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    prompt_logprobs: NumLogprobs | None = None
    chat_template: str | None = None
    # Extra variables for the chat template (vLLM's field), e.g. {"enable_thinking": false};
    # over the server's --default-chat-template-kwargs (zllm/text/template_kwargs.py).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message (an assistant's) is left open for the model to continue,
    # rendered without a generation prompt (zllm/text/continue_final.py).
    continue_final_message: bool = False
    # vLLM's: documents for a RAG template, passed to it as `documents`.
    documents: list[dict[str, Any]] | None = None
    # The chat template already writes the special tokens it wants.
    add_special_tokens: bool = False


class TokenizeBody(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: either `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ---- responses -----------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    # A string, as OpenAI's schema has it: a named code ("invalid_api_key"), else the status.
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(msgspec.Struct):
    """One candidate at one prompt position (vLLM's `prompt_logprobs` extension)."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    # Left out: OpenAI's schema has a string or nothing, and zllm has no fingerprint.
    system_fingerprint: str | msgspec.UnsetType = msgspec.UNSET


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprob] | None = None
    refusal: None = None  # OpenAI's schema requires the key; zllm's models never refuse


class ChatResponseMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = None
    refusal: None = None  # OpenAI's schema requires the key; zllm's models never refuse
    # Left out of the JSON unless set: the thinking (--reasoning-parser), the tools called.
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCallMessage] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # Left out: OpenAI's schema has a string or nothing, and zllm has no fingerprint.
    system_fingerprint: str | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed tool call: the first carries id, type and the name; the
    arguments' JSON text follows in pieces that concatenate to valid JSON."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class KVTransferCard(msgspec.Struct, kw_only=True):
    """A disaggregated server's part (--kv-transfer-config), on its model's cards: what
    `zllm proxy` checks at start (zllm/proxy/pairing.py). KV blocks pass only between
    servers of the same weights (zllm/model/fingerprint.py)."""

    role: str  # kv_producer or kv_consumer
    weights_fingerprint: str


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "zllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    kv_transfer: KVTransferCard | None = None  # (zllm's own; the base model's cards only)


class LoadLoRAAdapterBody(msgspec.Struct, kw_only=True):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterBody(msgspec.Struct, kw_only=True):
    """vLLM's POST /v1/unload_lora_adapter (lora_int_id is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


# ---- decoding ------------------------------------------------------------------------------

_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
# A run of 19+ digits may be an integer beyond 64 bits (2**63 has 19 digits): only then is
# the body walked for one, so ordinary requests pay one fast scan.
_LONG_DIGITS = re.compile(rb"\d{19,}")
_WIRE_INT_MIN, _WIRE_INT_MAX = -(2**63), 2**64 - 1  # what msgpack carries
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def _invalid_json(error: msgspec.DecodeError) -> str:
    if "UTF-8" in str(error):
        return f"The request body is not valid UTF-8: {error}"
    return f"Invalid JSON in the request body: {error}"


def decode_body(body: bytes, cls: type[msgspec.Struct]) -> tuple[msgspec.Struct, list[str]]:
    """Decode a JSON request body into `cls`; returns it and the unknown top-level keys.

    Raises RequestError (400) for invalid JSON or a value of the wrong type, naming the field.
    """
    try:
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        raise RequestError("The request body must be a JSON object.") from None
    except msgspec.DecodeError as e:
        raise RequestError(_invalid_json(e)) from None
    except UnicodeDecodeError as e:  # msgspec checks UTF-8 only where it decodes a string
        raise RequestError(f"The request body is not valid UTF-8: {e}") from None
    except RecursionError:
        raise RequestError("The request body is nested too deeply.") from None
    try:
        request = msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        raise RequestError(f"Invalid request: {e}", param=error_param(str(e))) from None
    except msgspec.DecodeError as e:  # msgspec 0.23: a string's bad UTF-8 (was UnicodeDecodeError)
        raise RequestError(_invalid_json(e)) from None
    except UnicodeDecodeError as e:
        raise RequestError(f"The request body is not valid UTF-8: {e}") from None
    except RecursionError:
        raise RequestError("The request body is nested too deeply.") from None
    if _LONG_DIGITS.search(body):
        try:
            _refuse_wide_ints(msgspec.json.decode(body), "")
        except RecursionError:
            raise RequestError("The request body is nested too deeply.") from None
    for name in getattr(cls, "UNSUPPORTED", ()):
        if name in keys and bytes(keys[name]) != b"null":
            raise RequestError(f"unsupported parameter: {name}", param=name)
    unknown = sorted(set(keys) - set(cls.__struct_fields__))
    return request, unknown


def _refuse_wide_ints(value: Any, path: str) -> None:
    """Raise RequestError naming the first integer the wire cannot carry. Typed integer
    fields are bounded by their types; this finds the free-form ones (tool parameters,
    JSON schemas, template arguments), which would otherwise fail on the way to the
    tokenizer."""
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_wide_ints(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_wide_ints(item, f"{path}[{index}]")
    elif isinstance(value, int) and not _WIRE_INT_MIN <= value <= _WIRE_INT_MAX:
        raise RequestError(
            f"The integer at `{path}` is outside the 64-bit range this server accepts.",
            param=path or None,
        )


def error_param(message: str) -> str | None:
    """The field a msgspec validation message points at, as a dotted path."""
    match = _PATH.search(message)
    path = match.group("path") if match else ""
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing.group('field')}" if path else missing.group("field")
    return path or None
