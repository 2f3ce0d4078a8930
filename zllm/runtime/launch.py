"""What `zllm serve` and `AsyncLLM` resolve before the supervisor starts a process: the
`ServeConfig` every process reads, made from `ServerArgs` and an `EngineConfig`, with what it
names made ready: the sockets' addresses (a private ipc directory, or free tcp ports), the
chat template read, the --lora-modules adapters checked.

Here rather than in zllm/config/serve.py, which declares the options and the config's shape:
making the addresses takes the host's resources (a directory, ports), which is runtime work.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

from zllm.config.engine import EngineConfig
from zllm.config.kv_transfer import check_ports
from zllm.config.serve import Endpoints, EngineEndpoints, ServeConfig, ServerArgs
from zllm.config.tls import check_tls
from zllm.lora import parse_lora_modules, read_adapter, with_digest
from zllm.model.family import Family
from zllm.model.registry import family_of
from zllm.protocol import LoRARequest
from zllm.runtime.procutil import free_ports
from zllm.text.template_kwargs import check_template_kwargs

logger = logging.getLogger(__name__)


# ServerArgs fields that serve_config_from resolves rather than copies.
_RESOLVED = frozenset(
    {
        "api_key",
        "served_model_name",
        "chat_template",
        "transport",
        "lora_modules",
        "prefix_cache_isolation",
        "protect_metrics",
        "metrics_api_key",
        "enable_auto_tool_choice",
    }
)


def serve_config_from(engine: EngineConfig, server: ServerArgs | None = None) -> ServeConfig:
    """The config every process gets. The engine config is made first (it resolves the model:
    `EngineArgs.create_engine_config`), so a caller can pass one it already has."""
    server = with_model_parsers(server or ServerArgs(), family_of(engine.arch))
    check_tls(server.ssl_keyfile, server.ssl_certfile, server.ssl_ca_certs, server.ssl_cert_reqs)
    if server.enable_auto_tool_choice and server.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser (how the model writes its "
            "calls); with a parser, tool_choice auto works without the flag"
        )
    check_template_kwargs(
        server.default_chat_template_kwargs or {}, "--default-chat-template-kwargs"
    )
    if server.otlp_traces_endpoint is not None:
        check_tracing_installed()
    if set(server.metrics_api_key) & set(server.api_key):
        raise ValueError("a --metrics-api-key must not also be an --api-key (a tenant's)")
    n = server.detokenizer_workers
    ranks = engine.executor_processes  # (Ray's actors get none: its driver relays to them)
    engine = with_consumer_engines(engine, server.data_parallel_size)
    if engine.kv_transfer is not None and engine.kv_transfer.consumes:  # it binds them
        transfer = engine.kv_transfer
        check_ports(transfer, engine.world_size, transfer.consumer_engines, server.port)
    engines = server.data_parallel_size
    copied = {
        f.name: getattr(server, f.name)
        for f in dataclasses.fields(server)
        if f.name not in _RESOLVED
    }
    return ServeConfig(
        engine=engine,
        endpoints=(
            tcp_endpoints(n, ranks, engines)
            if server.transport == "tcp"
            else ipc_endpoints(n, ranks, engines)
        ),
        api_keys=list(server.api_key),
        served_model_names=list(server.served_model_name),
        chat_template=read_chat_template(server.chat_template),
        lora_modules=start_adapters(engine, server.lora_modules),
        prefix_cache_isolation=prefix_cache_isolation(engine, server),
        # A metrics key is only asked for where metrics are protected.
        protect_metrics=server.protect_metrics or bool(server.metrics_api_key),
        metrics_api_keys=list(server.metrics_api_key),
        **copied,
    )


def with_model_parsers(server: ServerArgs, family: Family) -> ServerArgs:
    """A family whose chat format needs parsers (gpt-oss writes harmony: its channels come
    back as reasoning, tool calls and content rather than as raw text) gets its defaults
    when neither --reasoning-parser nor --tool-call-parser is named. Any parser named is
    kept."""
    if family.default_parsers is None:
        return server
    if server.reasoning_parser is not None or server.tool_call_parser is not None:
        return server
    reasoning, tools = family.default_parsers
    logger.info("%s: --reasoning-parser %s --tool-call-parser %s", family.title, reasoning, tools)
    return dataclasses.replace(server, reasoning_parser=reasoning, tool_call_parser=tools)


def check_tracing_installed() -> None:
    """--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter: say so
    at startup, not in the frontend's first request. (Finds them without importing them.)"""
    import importlib.util

    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError(f"--otlp-traces-endpoint needs {module}: pip install 'zllm[tracing]'")


def prefix_cache_isolation(engine: EngineConfig, server: ServerArgs) -> str:
    """As given, else "tenant" where tenants are configured (several API keys, or weights)."""
    if server.prefix_cache_isolation is not None:
        return server.prefix_cache_isolation
    scheduler = engine.scheduler
    tenants = len(server.api_key) > 1 or scheduler.tenant_weights or scheduler.tenant_limits
    return "tenant" if tenants else "none"


def with_consumer_engines(engine: EngineConfig, size: int) -> EngineConfig:
    """A disaggregation consumer's engine config with its engine count in its transfer
    config (its ports and the routing of marked requests follow from it). A consumer may
    give consumer_data_parallel_size too (one config shape for both sides), but only as its
    own --data-parallel-size."""
    transfer = engine.kv_transfer
    if transfer is None or not transfer.consumes or transfer.consumer_engines == size:
        return engine
    if transfer.consumer_engines != 1:
        raise ValueError(
            f"kv_transfer_config: consumer_data_parallel_size {transfer.consumer_engines} on "
            f"a consumer with --data-parallel-size {size}: a consumer's engines are its own "
            "--data-parallel-size (leave the key to the producer)"
        )
    return dataclasses.replace(
        engine, kv_transfer=dataclasses.replace(transfer, consumer_engines=size)
    )


def start_adapters(engine: EngineConfig, specs: list[str]) -> list[LoRARequest]:
    """`--lora-modules`, each adapter checked against the model now (a bad one stops the
    server before it starts), with ids 1, 2, ... in the order given."""
    modules = parse_lora_modules(specs)
    if not modules:
        return []
    if engine.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    if len(modules) > engine.lora.max_loras:
        logger.info(
            "%d LoRA adapters, at most %d in one step (--max-loras)",
            len(modules),
            engine.lora.max_loras,
        )
    adapters = []
    for i, (name, path) in enumerate(modules, start=1):
        read_adapter(path, engine.arch, engine.lora.max_lora_rank)
        adapters.append(with_digest(LoRARequest(name, i, os.path.abspath(path))))
    return adapters


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template` is a template or the path of a file holding one."""
    if value and os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def ipc_endpoints(num_detokenizers: int, num_ranks: int = 1, num_engines: int = 1) -> Endpoints:
    """ipc:// sockets in a fresh private (0700) directory."""
    d = tempfile.mkdtemp(prefix="zllm-")
    os.chmod(d, 0o700)

    def addr(name: str, engine: int = 0) -> str:
        return f"ipc://{d}/{name}" + (f"_dp{engine}" if engine else "")

    return Endpoints(
        tokenizer_in=addr("tokenizer_in"),
        detokenizer_in=[addr(f"detokenizer_in_{i}") for i in range(num_detokenizers)],
        frontend_in=addr("frontend_in"),
        supervisor_in=addr("supervisor_in"),
        engines=[
            EngineEndpoints(
                core_in=addr("core_in", e),
                executor_in=addr("executor_in", e),
                executor_out=addr("executor_out", e),
                executor_ranks=[addr(f"executor_rank_{r}", e) for r in range(1, num_ranks)],
                events=addr("events", e),
            )
            for e in range(num_engines)
        ],
        ipc_dir=d,
    )


def tcp_endpoints(
    num_detokenizers: int,
    num_ranks: int = 1,
    num_engines: int = 1,
    host: str = "127.0.0.1",
) -> Endpoints:
    """tcp:// sockets on free loopback ports (for processes that share no filesystem)."""
    per_engine = 4 + num_ranks - 1
    ports = free_ports(4 + num_detokenizers + per_engine * num_engines, host)
    addr = [f"tcp://{host}:{p}" for p in ports]
    engines = []
    for e in range(num_engines):
        own = addr[4 + num_detokenizers + e * per_engine :][:per_engine]
        engines.append(EngineEndpoints(own[0], own[1], own[2], own[4:], events=own[3]))
    return Endpoints(
        tokenizer_in=addr[0],
        frontend_in=addr[1],
        supervisor_in=addr[2],
        detokenizer_in=addr[4 : 4 + num_detokenizers],
        engines=engines,
    )
