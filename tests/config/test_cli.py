"""The `zllm` flags are generated from `EngineArgs` and `ServerArgs`: every option has its flag,
and parsed flags come back as the same dataclass and `ServeConfig`. Nothing here loads a
model's weights or starts a server."""

from __future__ import annotations

import argparse
import shutil
from dataclasses import fields

import pytest
import trustme
from tiny_models import write_lora_adapter

from zllm.cli import build_parser, serve_config_from_args
from zllm.config.arg_utils import flag_name, flag_of, format_size, parse_size
from zllm.config.engine_args import EngineArgs, engine_args_from
from zllm.config.serve import ServeConfig, ServerArgs
from zllm.config.tenants import TenantPolicy
from zllm.lora import LoRARequest, with_digest
from zllm.runtime.launch import serve_config_from

# Every engine option away from its default, and the flags that say so.
ENGINE = EngineArgs(
    model="tiny",
    revision="v2",
    download_dir="/tmp/hf-cache",
    tokenizer="org/tokenizer",
    tokenizer_revision="v3",
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    enable_chunked_prefill=False,
    scheduling_policy="fair",
    tenant_weights={
        "key-1": TenantPolicy(weight=3.0, max_concurrency=2),
        "alice": TenantPolicy(weight=1.5),
    },
    block_size=32,
    kv_cache_memory_bytes=64 << 20,
    gpu_memory_utilization=0.5,
    num_gpu_blocks_override=12,
    enable_prefix_caching=False,
    kv_offload_bytes=1 << 30,
    kv_offload_dir="/tmp/zllm-kv",
    kv_offload_key_file="/tmp/zllm-kv.key",
    kv_offload_disk_bytes=8 << 30,
    max_pinned_bytes=16 << 20,
    hybrid_kv_cache=False,
    seed=7,
    dtype="bfloat16",
    device="cpu",
    quantization="int8",
    load_format="dummy",
    kv_cache_dtype="bf16",
    enforce_eager=True,
    cudagraph_mode="full_and_piecewise",
    async_executor="off",
    generation_config="vllm",
    model_impl="transformers",
    pooling="last",
    pooler_config='{"normalize": false}',
    runner="pooling",
    hf_overrides={"classifier_from_token": ["no", "yes"]},
    speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    deterministic=True,
    enable_lora=True,
    max_loras=3,
    max_lora_rank=32,
    tensor_parallel_size=2,
    pipeline_parallel_size=3,
    kv_transfer_config={"kv_role": "kv_consumer", "kv_port": 15000},
    distributed_executor_backend="ray",
    ray_placement_strategy="STRICT_SPREAD",
    enable_sleep_mode=True,
    limit_mm_per_prompt={"image": 3},
    max_image_pixels=1 << 20,
    max_image_bytes=1 << 20,
    allowed_media_domains=["a.example", "b.example"],
    allowed_local_media_path="/srv/images",
    media_fetch_timeout=2.5,
)
ENGINE_ARGV = [
    "--revision", "v2",
    "--download-dir", "/tmp/hf-cache",
    "--tokenizer", "org/tokenizer",
    "--tokenizer-revision", "v3",
    "--max-model-len", "256",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "64",
    "--no-enable-chunked-prefill",
    "--scheduling-policy", "fair",
    "--tenant-weights", '{"key-1": {"weight": 3, "max_concurrency": 2}, "alice": 1.5}',
    "--block-size", "32",
    "--kv-cache-memory-bytes", "64M",
    "--gpu-memory-utilization", "0.5",
    "--num-gpu-blocks-override", "12",
    "--no-enable-prefix-caching",
    "--kv-offload-bytes", "1G",
    "--kv-offload-dir", "/tmp/zllm-kv",
    "--kv-offload-key-file", "/tmp/zllm-kv.key",
    "--kv-offload-disk-bytes", "8G",
    "--max-pinned-bytes", "16M",
    "--no-hybrid-kv-cache",
    "--seed", "7",
    "--dtype", "bfloat16",
    "--device", "cpu",
    "--quantization", "int8",
    "--load-format", "dummy",
    "--kv-cache-dtype", "bf16",
    "--enforce-eager",
    "--cudagraph-mode",
    "full_and_piecewise",
    "--async-executor",
    "off",
    "--generation-config", "vllm",
    "--model-impl", "transformers",
    "--pooling", "last",
    "--pooler-config", '{"normalize": false}',
    "--runner", "pooling",
    "--hf-overrides", '{"classifier_from_token": ["no", "yes"]}',
    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
    "--deterministic",
    "--enable-lora",
    "--max-loras", "3",
    "--max-lora-rank", "32",
    "--tensor-parallel-size", "2",
    "--pipeline-parallel-size", "3",
    "--kv-transfer-config", '{"kv_role": "kv_consumer", "kv_port": 15000}',
    "--distributed-executor-backend", "ray",
    "--ray-placement-strategy", "STRICT_SPREAD",
    "--enable-sleep-mode",
    "--limit-mm-per-prompt", '{"image": 3}',
    "--max-image-pixels", "1048576",
    "--max-image-bytes", "1M",
    "--allowed-media-domains", "a.example,B.example",
    "--allowed-local-media-path", "/srv/images",
    "--media-fetch-timeout", "2.5",
]  # fmt: skip

# Every server option away from its default (the model comes first, positionally).
SERVER_ARGV = [
    "--host", "0.0.0.0",
    "--port", "9001",
    "--api-key", "k1",
    "--api-key", "k2",
    "--served-model-name", "a", "b",
    "--tokenizer-workers", "2",
    "--detokenizer-workers", "3",
    "--chat-template", "CHAT_TEMPLATE_FILE",
    "--transport", "tcp",
    "--drain-timeout", "5",
    "--on-engine-failure", "exit",
    "--executor-timeout", "7.5",
    "--engine-hang-timeout", "12.5",
    "--log-requests",
    "--disable-log-stats",
    "--max-waiting-requests", "0",
    "--request-timeout", "90",
    "--max-request-body-bytes", "1.5K",
    "--timeout-keep-alive", "30",
    "--protect-metrics",
    "--metrics-api-key", "m1",
    "--allowed-origins", "https://a.example, https://b.example",
    "--allowed-origins", '["https://c.example"]',
    "--trust-request-chat-template",
    "--default-chat-template-kwargs", '{"enable_thinking": false}',
    "--thinking-signature-key-file", "/keys/thinking.key",
    "--tool-call-parser", "hermes",
    "--enable-auto-tool-choice",
    "--reasoning-parser", "qwen3",
    "--lora-modules", "x=LORA_DIR",
    "--data-parallel-size", "2",
    "--data-parallel-routing", "load",
    "--prefix-cache-isolation", "none",
    "--tenant-max-concurrency", "3",
    "--tenant-max-requests-per-second", "2.5",
    "--ssl-keyfile", "SSL_KEY",
    "--ssl-certfile", "SSL_CERT",
    "--ssl-ca-certs", "SSL_CA",
    "--ssl-cert-reqs", "2",
    "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces",
]  # fmt: skip

ENGINE_COMMANDS = [
    ["serve", "tiny"],
    ["generate", "hello", "--model", "tiny"],
    ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "tiny"],
    ["bench", "throughput", "--model", "tiny"],
    ["bench", "accuracy", "--model", "tiny"],
    ["bench", "prefix", "--model", "tiny"],
]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def fields_set(cls: type, argv: list[str]) -> set[str]:
    """The fields of `cls` that an argv sets, through their flags (aliases and --no- too)."""
    field_of = {}
    for f in fields(cls):
        flag = flag_of(f)
        for name in (flag_name(f), *flag.aliases) if flag else ():
            field_of[name] = f.name
    return {field_of[a.replace("--no-", "--")] for a in argv if a.startswith("--")}


def test_every_engine_option_is_a_flag_and_the_round_trip_moves_it():
    options = [f for f in fields(EngineArgs) if f.name != "model"]
    assert all(flag_of(f) is not None for f in options)
    assert fields_set(EngineArgs, ENGINE_ARGV) == {f.name for f in options}
    assert all(getattr(ENGINE, f.name) != f.default for f in fields(EngineArgs))


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_engine_flags_round_trip(command):
    assert engine_args_from(parse(*command, *ENGINE_ARGV)) == ENGINE
    assert engine_args_from(parse(*command)) == EngineArgs(model="tiny")


def test_python_api_checks_the_choices_the_flags_check():
    with pytest.raises(
        ValueError,
        match="quantization must be one of 'gguf', 'gguf-float', 'gguf-int8', 'int8', "
        "'compressed-tensors', 'gptq', 'awq', 'fp8', 'none'",
    ):
        EngineArgs(model="/nonexistent", quantization="bogus").create_engine_config()
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(model="/nonexistent", dtype="fp8").create_engine_config()


@pytest.mark.parametrize("method", ["gguf", "gguf-float", "gguf-int8", "int8"])
def test_cpu_quantization_methods_refuse_a_gpu(tiny_llama_dir, method):
    args = EngineArgs(model=tiny_llama_dir, quantization=method, device="cuda")
    with pytest.raises(ValueError, match=f"--quantization {method} runs on CPU only"):
        args.create_engine_config()


@pytest.mark.parametrize("method", ["compressed-tensors", "gptq", "awq"])
def test_checkpoint_methods_on_a_gpu_need_a_quantized_checkpoint(tiny_llama_dir, method):
    """A quantized checkpoint's blocks have GPU kernels (csrc/block_gemv.cu); a plain one is
    refused for what it lacks, on any device."""
    args = EngineArgs(model=tiny_llama_dir, quantization=method, device="cuda")
    with pytest.raises(ValueError, match="has no quantization_config"):
        args.create_engine_config()


@pytest.mark.parametrize("method", ["gguf-int8", "gguf"])
def test_deterministic_mode_refuses_arithmetic_that_depends_on_the_batch(tmp_path, method):
    from gguf import GGMLQuantizationType as T
    from gguf_files import write_llama_gguf

    path = tmp_path / "q4k.gguf"
    write_llama_gguf(path, lambda name: T.Q4_K)
    args = EngineArgs(model=str(path), quantization=method, deterministic=True, device="cpu")
    with pytest.raises(ValueError, match=f"deterministic execution cannot use {method} "):
        args.create_engine_config()


def test_every_server_option_is_a_flag_set_below():
    assert all(flag_of(f) is not None for f in fields(ServerArgs))
    assert fields_set(ServerArgs, SERVER_ARGV) == {f.name for f in fields(ServerArgs)}


def test_serve_flags_make_the_serve_config(tiny_llama_dir, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    adapter = write_lora_adapter(tmp_path / "adapter", tiny_llama_dir)
    argv = [str(template) if a == "CHAT_TEMPLATE_FILE" else a for a in SERVER_ARGV]
    argv = [f"x={adapter}" if a == "x=LORA_DIR" else a for a in argv]
    ca = trustme.CA()  # the --ssl-* files must load
    leaf = ca.issue_cert("127.0.0.1")
    tls = {"SSL_KEY": tmp_path / "key.pem", "SSL_CERT": tmp_path / "cert.pem",
           "SSL_CA": tmp_path / "ca.pem"}  # fmt: skip
    leaf.private_key_pem.write_to_path(str(tls["SSL_KEY"]))
    leaf.cert_chain_pems[0].write_to_path(str(tls["SSL_CERT"]))
    ca.cert_pem.write_to_path(str(tls["SSL_CA"]))
    argv = [str(tls[a]) if a in tls else a for a in argv]
    engine_argv = ["--max-num-seqs", "8", "--kv-cache-memory-bytes", "64M", "--enable-lora"]
    args = parse("serve", tiny_llama_dir, *argv, *engine_argv, "--no-enable-prefix-caching")

    config = serve_config_from_args(args)

    engine = EngineArgs(
        model=tiny_llama_dir,
        max_num_seqs=8,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False,
        enable_lora=True,
    ).create_engine_config()
    assert config == ServeConfig(
        engine=engine,
        endpoints=config.endpoints,
        host="0.0.0.0",
        port=9001,
        api_keys=["k1", "k2"],
        served_model_names=["a", "b"],
        tokenizer_workers=2,
        detokenizer_workers=3,
        chat_template="{{ messages[0]['content'] }}",
        drain_timeout=5.0,
        on_engine_failure="exit",
        executor_timeout=7.5,
        engine_hang_timeout=12.5,
        enable_log_requests=True,
        disable_log_stats=True,
        max_waiting_requests=0,
        request_timeout=90.0,
        max_request_body_bytes=1536,
        timeout_keep_alive=30,
        protect_metrics=True,
        metrics_api_keys=["m1"],
        allowed_origins=["https://a.example", "https://b.example", "https://c.example"],
        trust_request_chat_template=True,
        default_chat_template_kwargs={"enable_thinking": False},
        thinking_signature_key_file="/keys/thinking.key",
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        lora_modules=[with_digest(LoRARequest("x", 1, str(adapter)))],
        data_parallel_size=2,
        data_parallel_routing="load",
        prefix_cache_isolation="none",
        tenant_max_concurrency=3,
        tenant_max_requests_per_second=2.5,
        ssl_keyfile=str(tls["SSL_KEY"]),
        ssl_certfile=str(tls["SSL_CERT"]),
        ssl_ca_certs=str(tls["SSL_CA"]),
        ssl_cert_reqs=2,
        otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces",
    )
    assert config.endpoints.ipc_dir is None
    assert len(config.endpoints.detokenizer_in) == 3
    assert all(a.startswith("tcp://127.0.0.1:") for a in config.endpoints.detokenizer_in)
    # Every engine has its own five addresses, none shared.
    engines = config.endpoints.engines
    assert len(engines) == 2
    own = [a for e in engines for a in (e.core_in, e.executor_in, e.executor_out, e.events)]
    shared = [config.endpoints.tokenizer_in, config.endpoints.frontend_in]
    assert len(set(own + shared)) == len(own) + len(shared)


def test_server_defaults_are_the_serve_config_defaults(tiny_llama_dir):
    engine = EngineArgs(model=tiny_llama_dir).create_engine_config()
    assert engine_args_from(parse("serve", tiny_llama_dir)) == EngineArgs(model=tiny_llama_dir)
    config = serve_config_from_args(parse("serve", tiny_llama_dir, "--enable-log-requests"))
    try:
        assert config.endpoints.ipc_dir is not None
        assert len(config.endpoints.detokenizer_in) == 1
        expected = ServeConfig(engine=engine, endpoints=config.endpoints, enable_log_requests=True)
        assert config == expected
        # What AsyncLLM.start builds: ServerArgs defaults, an engine config made beforehand.
        other = serve_config_from(engine, ServerArgs(tokenizer_workers=2, transport="tcp"))
        assert other.tokenizer_workers == 2 and other.engine_hang_timeout == 30.0
    finally:
        shutil.rmtree(config.endpoints.ipc_dir, ignore_errors=True)


def test_enable_auto_tool_choice_needs_a_tool_call_parser(tiny_llama_dir):
    """vLLM's flag is accepted; alone it is refused, naming both flags (as vLLM does)."""
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        serve_config_from_args(parse("serve", tiny_llama_dir, "--enable-auto-tool-choice"))


def test_chat_template_that_is_no_file_is_the_template(tiny_llama_dir):
    args = parse("serve", tiny_llama_dir, "--transport", "tcp", "--chat-template", "{{ x }}")
    assert serve_config_from_args(args).chat_template == "{{ x }}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine-hang-timeout", "0"], "argument --engine-hang-timeout: must be positive"),
        (["--max-waiting-requests", "-1"], "argument --max-waiting-requests: must be non-neg"),
        (["--request-timeout", "-5"], "argument --request-timeout: must be positive"),
        (["--tokenizer-workers", "0"], "argument --tokenizer-workers: must be at least 1"),
        (["--detokenizer-workers", "0"], "argument --detokenizer-workers: must be at least 1"),
        (["--timeout-keep-alive", "0"], "argument --timeout-keep-alive: must be at least 1"),
        (["--quantization", "bogus"], "argument --quantization: invalid choice: 'bogus'"),
        (["--transport", "udp"], "argument --transport: invalid choice: 'udp'"),
        (["--kv-cache-memory-bytes", "lots"], "argument --kv-cache-memory-bytes: expected a"),
        (["--max-request-body-bytes", "8X"], "argument --max-request-body-bytes: expected a"),
        (["--allowed-origins", "[oops"], "argument --allowed-origins: invalid"),
        (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value"),
    ],
)
def test_bad_values_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("serve", "tiny", *argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "size"),
    [("4096", 4096), ("64M", 64 << 20), ("1G", 1 << 30), ("512KiB", 512 << 10), ("1.5k", 1536)],
)
def test_sizes(text, size):
    assert parse_size(text) == size


def test_help_shows_defaults_from_the_dataclasses(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-num-seqs MAX_NUM_SEQS most sequences in one step (default: 256)" in text
    assert "larger ones get 413 (default: 8M)" in text
    assert "--log-requests" in text and "--no-enable-prefix-caching" in text
    assert format_size(8 << 20) == "8M" and format_size(1536) == "1536"
