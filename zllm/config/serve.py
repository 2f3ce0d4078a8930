"""What every serving process is told at start: the engine config, the socket addresses,
and the server options. The supervisor writes it once (JSON) into its private directory.

`ServerArgs` declares the options of `zllm serve` (each field is its flag, see
`zllm.config.arg_utils`); `serve_config_from` (zllm/runtime/launch.py) resolves them, with an
`EngineConfig`, into the `ServeConfig` the processes read.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec

from zllm.config.arg_utils import (
    format_size,
    non_negative_int,
    option,
    parse_json_object,
    parse_size,
    positive_float,
    positive_int,
)
from zllm.config.engine import EngineConfig
from zllm.protocol import LoRARequest


class EngineEndpoints(msgspec.Struct):
    """One engine's addresses: a core and its executor ranks (one data-parallel replica).

    core_in        core binds PULL; tokenizers, frontend, detokenizers, supervisor PUSH
    executor_in    executor binds PULL; core PUSHes SchedulerOutput
    executor_out   the answering executor rank (rank 0; with pipeline stages the last
                   stage's first rank) binds PUSH; core PULLs ModelRunnerOutput
    executor_ranks tensor or pipeline parallel: one per rank from 1, executor rank 0 binds
                   PUSH and forwards each step's SchedulerOutput; that rank PULLs
    events         data parallel: core binds PUB (heartbeats, KV cache events); tokenizer
                   workers SUB, to route by prefix and load
    """

    core_in: str
    executor_in: str
    executor_out: str
    executor_ranks: list[str] = []
    events: str = ""


class Endpoints(msgspec.Struct):
    """ZeroMQ addresses. The side named `binds` owns the address; the others connect.

    tokenizer_in   frontend binds PUSH; tokenizer workers PULL (ZeroMQ load-balances them)
    detokenizer_in one per worker, each worker binds PULL; cores PUSH to crc32(req_id) % M
    frontend_in    frontend binds PULL; detokenizers, tokenizers, cores, supervisor PUSH
    supervisor_in  supervisor binds PULL; children report ready
    engines        one EngineEndpoints per data-parallel replica
    """

    tokenizer_in: str
    detokenizer_in: list[str]
    frontend_in: str
    supervisor_in: str
    engines: list[EngineEndpoints]
    ipc_dir: str | None = None


class ServeConfig(msgspec.Struct, kw_only=True):
    engine: EngineConfig
    endpoints: Endpoints
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = []
    served_model_names: list[str] = []
    tokenizer_workers: int = 1
    detokenizer_workers: int = 1
    chat_template: str | None = None
    drain_timeout: float = 30.0
    on_engine_failure: str = "restart"  # or "exit"
    heartbeat_timeout: float = 5.0
    # A step that takes longer than this, with work pending, counts as a dead executor.
    executor_timeout: float = 60.0
    # Seconds without a heartbeat from the core before the supervisor treats it as hung.
    engine_hang_timeout: float = 30.0
    enable_log_requests: bool = False
    disable_log_stats: bool = False
    # Admission control: generation requests admitted and not yet finished, counted in
    # engine requests (one per prompt), are capped at max_num_seqs + max_waiting_requests;
    # beyond that new ones get 503 with Retry-After at once.
    max_waiting_requests: int = 1024
    # Seconds a request may run before it is aborted and the client gets a 504 (None: never).
    request_timeout: float | None = None
    max_request_body_bytes: int = 8 << 20
    # Seconds uvicorn keeps an idle HTTP/1.1 connection open for the client's next request.
    timeout_keep_alive: int = 5
    # Put /metrics, /dashboard (and its stats) and /version behind a key too (/health stays
    # open, for load balancers): an --api-key, which under tenant isolation shows its own
    # tenant's series only (frontend/access/permissions.py), or a metrics key, which shows
    # every tenant's.
    protect_metrics: bool = False
    metrics_api_keys: list[str] = []
    # CORS: origins allowed to call the API from a browser (none by default: CORS off).
    allowed_origins: list[str] = []
    # Accept a `chat_template` in request bodies (a template is code: off by default).
    trust_request_chat_template: bool = False
    # Template variables every chat request gets unless it sets them in chat_template_kwargs
    # (zllm/text/template_kwargs.py), e.g. {"enable_thinking": false}.
    default_chat_template_kwargs: dict[str, Any] | None = None
    # The key that signs Anthropic thinking blocks (frontend/anthropic/thinking.py); None:
    # $ZLLM_CACHE/thinking-signature.key, made at first use.
    thinking_signature_key_file: str | None = None
    # How the model writes tool calls (zllm/text/tool_parsers/); None: no tool_choice "auto".
    tool_call_parser: str | None = None
    # How the model writes its reasoning (zllm/text/reasoning_parser.py); None: all is content.
    reasoning_parser: str | None = None
    # LoRA adapters served from the start (--lora-modules), checked, with ids 1, 2, ...
    lora_modules: list[LoRARequest] = []
    # Data parallelism: engines (core + executor ranks) serving behind the one frontend, and
    # how the tokenizer workers pick one for each request (tokenizer_proc/router.py).
    data_parallel_size: int = 1
    data_parallel_routing: str = "cache_aware"
    # "tenant": each tenant's prefix-cache blocks are its own (zllm/kv/block_hash.py); "none".
    prefix_cache_isolation: str = "none"
    # Per-tenant limits at the door (frontend/access/tenant_limits.py): 429 beyond them.
    tenant_max_concurrency: int | None = None
    tenant_max_requests_per_second: float | None = None
    # HTTPS (zllm/config/tls.py): the server's key and certificate, and the CAs whose client
    # certificates it accepts (ssl_cert_reqs: ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    # OpenTelemetry: where the frontend exports one span tree per request (OTLP over HTTP,
    # frontend/observability/tracing.py); None: no tracing, and no process imports OpenTelemetry.
    otlp_traces_endpoint: str | None = None
    # Which engine a core or executor process belongs to (the supervisor's command line
    # sets it; the shared processes keep 0 and look at every engine).
    engine_index: int = 0

    @property
    def engine_endpoints(self) -> EngineEndpoints:
        """This engine's addresses (a core's or executor rank's own)."""
        return self.endpoints.engines[self.engine_index]

    @property
    def max_in_flight(self) -> int:
        """The admission limit, in engine requests."""
        return self.engine.scheduler.max_num_seqs + self.max_waiting_requests

    @property
    def model_names(self) -> list[str]:
        return self.served_model_names or [self.engine.model]

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"


def parse_origins(text: str) -> list[str]:
    """One `--allowed-origins` value: a comma-separated list or a JSON list."""
    text = text.strip()
    if text.startswith("["):
        return [str(o) for o in json.loads(text)]
    return [o.strip() for o in text.split(",") if o.strip()]


@dataclasses.dataclass(slots=True)
class ServerArgs:
    """The options of `zllm serve` beyond the engine's, as the user gives them."""

    host: str = option("127.0.0.1", help="bind address; 0.0.0.0 exposes the server")
    port: int = option(8000, help="HTTP port")
    api_key: list[str] = option(
        default_factory=list, help="require this key (repeatable)", action="append"
    )
    served_model_name: list[str] = option(
        default_factory=list,
        help="the model names the API answers to (default: the model argument)",
        nargs="+",
    )
    tokenizer_workers: int = option(1, help="tokenizer processes", parse=positive_int)
    detokenizer_workers: int = option(1, help="detokenizer processes", parse=positive_int)
    chat_template: str | None = option(None, help="a Jinja template, or a file holding one")
    transport: str = option(
        "ipc",
        help="sockets between the processes: ipc (private directory) or tcp (loopback)",
        choices=("ipc", "tcp"),
    )
    drain_timeout: float = option(
        30.0, help="seconds in-flight requests may run on after SIGTERM before they fail"
    )
    on_engine_failure: str = option(
        "restart",
        help="when the core or executor dies: restart them, or exit",
        choices=("restart", "exit"),
    )
    executor_timeout: float = option(
        60.0,
        help="seconds a step may take, with work pending, before the executor counts as dead",
    )
    engine_hang_timeout: float = option(
        30.0,
        help="seconds without a heartbeat from the engine core before the supervisor treats "
        "it as hung: it fails in-flight requests with 503 and restarts the engine like a "
        "dead core",
        parse=positive_float,
    )
    enable_log_requests: bool = option(
        False,
        help="log each request (prompts are never logged without this)",
        aliases=("--log-requests",),
    )
    disable_log_stats: bool = option(False, help="no periodic log line of engine statistics")
    max_waiting_requests: int = option(
        1024,
        help="requests that may wait beyond --max-num-seqs (in engine requests, one per "
        "prompt); more get 503 with Retry-After",
        parse=non_negative_int,
    )
    request_timeout: float | None = option(
        None,
        help="seconds a request may run before it is aborted with a 504 (default: no limit)",
        parse=positive_float,
    )
    max_request_body_bytes: int = option(
        8 << 20,
        help="largest request body (suffixes K/M/G); larger ones get 413",
        parse=parse_size,
        show_default=format_size,
    )
    timeout_keep_alive: int = option(
        5,
        help="seconds an idle HTTP keep-alive connection stays open (vLLM's "
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE); set it above the idle timeout of the clients' "
        "connection pools (httpx's: 5) or of a load balancer in front, so the server never "
        "closes a connection just as a client reuses it",
        parse=positive_int,
    )
    protect_metrics: bool = option(
        False,
        help="require a key for /metrics, /dashboard and /version too (/health stays open): "
        "an --api-key, which under --prefix-cache-isolation tenant sees its own tenant's "
        "series only, or a --metrics-api-key",
    )
    metrics_api_key: list[str] = option(
        default_factory=list,
        help="a key that reads /metrics, /dashboard and /version with every tenant's series, "
        "and nothing else (a scraper's; repeatable); implies --protect-metrics",
        action="append",
    )
    allowed_origins: list[str] = option(
        default_factory=list,
        help="enable CORS for these origins (comma-separated or a JSON list, repeatable; "
        "'*' for any); CORS is off by default",
        parse=parse_origins,
        action="extend",
    )
    trust_request_chat_template: bool = option(
        False, help="accept a chat_template in request bodies (a template is code to run)"
    )
    default_chat_template_kwargs: dict | None = option(
        None,
        help="template variables for every chat request, as a JSON object, e.g. "
        "'{\"enable_thinking\": false}' (Qwen 3 without thinking); a request's "
        "chat_template_kwargs override them key by key",
        parse=parse_json_object,
    )
    thinking_signature_key_file: str | None = option(
        None,
        help="the key (32+ bytes) whose HMAC signs the thinking blocks of /v1/messages "
        "answers and checks those sent back (default: $ZLLM_CACHE/thinking-signature.key, "
        "made at first use, owner-only)",
    )
    tool_call_parser: str | None = option(
        None,
        help='how the model writes tool calls, for tool_choice "auto" (hermes: Qwen 2.5/3 '
        "<tool_call> JSON; llama3_json: Llama 3.1/3.2 JSON; mistral: [TOOL_CALLS]; pythonic: "
        "Llama 3.2/4 [f(x=1)] (llama4_pythonic; llama4_json: llama3_json's); qwen3_xml: "
        "Qwen3-Coder <function=...>; deepseek_v3 / deepseek_v31: DeepSeek-V3.x; kimi_k2: Kimi "
        "K2; glm45 / glm47: GLM-4.5 to 4.7 "
        "<arg_key>/<arg_value>; minimax_m2: MiniMax-M2 <invoke>; gemma4: Gemma 4 "
        "<|tool_call>call:f{...}; openai: gpt-oss's harmony channels, its reasoning too); "
        "required and named tool choices need none",
        choices=(
            "hermes",
            "llama3_json",
            "mistral",
            "pythonic",
            "llama4_pythonic",
            "llama4_json",
            "qwen3_xml",
            "deepseek_v3",
            "deepseek_v31",
            "kimi_k2",
            "glm45",
            "glm47",
            "minimax_m2",
            "gemma4",
            "openai",
        ),
    )
    enable_auto_tool_choice: bool = option(
        False,
        help='accepted as vLLM spells it: tool_choice "auto" works wherever --tool-call-parser '
        "is given (this flag changes nothing); without --tool-call-parser it is refused",
    )
    lora_modules: list[str] = option(
        default_factory=list,
        help="LoRA adapters to serve from the start, as name=path (PEFT directories; needs "
        "--enable-lora); a request names an adapter as its model",
        nargs="+",
    )
    reasoning_parser: str | None = option(
        None,
        help="separate <think>...</think> reasoning into reasoning_content (deepseek_r1 and "
        "minimax_m2: the prompt opens it; qwen3, glm45, kimi_k2: the model does); structured "
        "outputs then apply after the reasoning; gemma4: Gemma 4's <|channel>thought ... "
        "<channel|>; openai_gptoss: gpt-oss's harmony channels (analysis as reasoning, tool "
        "calls too)",
        choices=(
            "deepseek_r1",
            "qwen3",
            "glm45",
            "kimi_k2",
            "minimax_m2",
            "gemma4",
            "openai_gptoss",
        ),  # fmt: skip
    )
    data_parallel_size: int = option(
        1,
        help="engines (a core and its executor ranks each, a whole copy of the model) behind "
        "the one endpoint; the tokenizer workers route each request to one",
        parse=positive_int,
    )
    data_parallel_routing: str = option(
        "cache_aware",
        help="how a request's engine is picked with --data-parallel-size above 1: "
        "cache_aware (the engine holding most of its prompt's prefix, unless it is much "
        "busier) or load (the least busy: waiting x 4 + running)",
        choices=("cache_aware", "load"),
    )
    prefix_cache_isolation: str | None = option(
        None,
        help="tenant: each tenant's prompts share cached KV blocks only with its own, so no "
        "tenant can tell from its TTFT what another sent; none: one shared prefix cache "
        "(default: tenant with several --api-key or --tenant-weights, else none); under tenant, "
        "an --api-key reading protected metrics sees its own tenant's series only",
        choices=("none", "tenant"),
    )
    tenant_max_concurrency: int | None = option(
        None,
        help="generation requests one tenant may have in flight; more get 429 with "
        "Retry-After (default: no limit)",
        parse=positive_int,
    )
    tenant_max_requests_per_second: float | None = option(
        None,
        help="generation requests one tenant may start per second (a burst of max(1, R)); "
        "more get 429 with Retry-After (default: no limit)",
        parse=positive_float,
    )
    ssl_keyfile: str | None = option(None, help="HTTPS: the server's private key (PEM)")
    ssl_certfile: str | None = option(
        None, help="HTTPS: the server's certificate chain (PEM); serving is HTTPS with it"
    )
    ssl_ca_certs: str | None = option(
        None, help="HTTPS: CA certificates (PEM) that client certificates are checked against"
    )
    ssl_cert_reqs: int = option(
        0,
        help="client certificates, as Python's ssl module numbers them: 0 not asked for, 1 "
        "checked when given, 2 required (needs --ssl-ca-certs)",
        choices=(0, 1, 2),
    )
    otlp_traces_endpoint: str | None = option(
        None,
        help="OpenTelemetry: export a span per request (with queue, tokenize, prefill, "
        "decode and detokenize spans under it) to this OTLP/HTTP traces URL, e.g. "
        "http://127.0.0.1:4318/v1/traces; a client's traceparent header is honoured "
        "(needs zllm[tracing])",
    )


def encode_config(config: ServeConfig) -> bytes:
    return msgspec.json.encode(config)


def decode_config(data: bytes) -> ServeConfig:
    return msgspec.json.decode(data, type=ServeConfig)
