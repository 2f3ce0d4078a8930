"""The `zllm` command: download, generate, bench (and serve, once the server lands)."""

from __future__ import annotations

import argparse
import logging
import sys

from zllm.engine_args import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options, named as `vllm serve` names them."""
    d = EngineArgs()
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=_size,
        default=None,
        help="KV cache budget in bytes (suffixes K/M/G); default 1 GiB on CPU.",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default=d.device)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="GPU: run eagerly, no CUDA graphs"
    )
    parser.add_argument(
        "--quantization",
        choices=["gguf", "int8", "none"],
        default=None,
        help="gguf (the default for a Q4_1/Q8_0 GGUF file on CPU): matmuls read the file's "
        "quantized blocks, the same weight values as fp32; none: fp32 matmuls; int8: int8 "
        "weights with dynamic int8 activations (CPU; opt-in, see BENCHMARKS.md)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
    )


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def cmd_download(args: argparse.Namespace) -> int:
    from zllm.model_files import download_model

    print(download_model(args.name))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from zllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from zllm.engine_args import EngineArgs
    from zllm.serve_config import Endpoints, ServeConfig
    from zllm.supervisor import serve

    if args.tokenizer_workers < 1 or args.detokenizer_workers < 1:
        raise ValueError("--tokenizer-workers and --detokenizer-workers must be at least 1")
    engine = EngineArgs(model=args.model, **engine_kwargs(args)).create_engine_config()
    chat_template = args.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()
    n_detok = args.detokenizer_workers
    endpoints = Endpoints.tcp(n_detok) if args.transport == "tcp" else Endpoints.ipc(n_detok)
    config = ServeConfig(
        engine=engine,
        endpoints=endpoints,
        host=args.host,
        port=args.port,
        api_keys=args.api_key,
        served_model_names=args.served_model_name,
        tokenizer_workers=args.tokenizer_workers,
        detokenizer_workers=n_detok,
        chat_template=chat_template,
        drain_timeout=args.drain_timeout,
        on_engine_failure=args.on_engine_failure,
        executor_timeout=args.executor_timeout,
        enable_log_requests=args.enable_log_requests,
        disable_log_stats=args.disable_log_stats,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout=args.request_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        protect_metrics=args.protect_metrics,
        allowed_origins=_origins(args.allowed_origins),
        trust_request_chat_template=args.trust_request_chat_template,
    )
    return serve(config)


def _origins(values: list[str]) -> list[str]:
    """`--allowed-origins` values: repeatable, each a comma-separated list or a JSON list."""
    import json

    origins: list[str] = []
    for value in values:
        value = value.strip()
        if value.startswith("["):
            origins += [str(o) for o in json.loads(value)]
        else:
            origins += [o.strip() for o in value.split(",") if o.strip()]
    return origins


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zllm", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("download", help="put a known model into the model cache")
    p.add_argument("name", nargs="?", default="smollm2")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("generate", help="complete one prompt from the shell")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="short name, .gguf file or HF directory")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="the OpenAI-compatible server (all processes)")
    p.add_argument("model", nargs="?", default=None, help="short name, .gguf file or HF directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[], help="require this key (repeatable)")
    p.add_argument("--served-model-name", nargs="+", default=[])
    p.add_argument("--tokenizer-workers", type=int, default=1)
    p.add_argument("--detokenizer-workers", type=int, default=1)
    p.add_argument("--chat-template", default=None, help="a Jinja template, or a file holding one")
    p.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--on-engine-failure", choices=["restart", "exit"], default="restart")
    p.add_argument(
        "--executor-timeout",
        type=float,
        default=60.0,
        help="seconds a step may take, with work pending, before the executor counts as dead",
    )
    p.add_argument(
        "--enable-log-requests",
        "--log-requests",
        dest="enable_log_requests",
        action="store_true",
        help="log each request (prompts are never logged without this)",
    )
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument(
        "--max-waiting-requests",
        type=_non_negative_int,
        default=1024,
        help="requests that may wait beyond --max-num-seqs (in engine requests, one per "
        "prompt); more get 503 with Retry-After",
    )
    p.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=None,
        help="seconds a request may run before it is aborted with a 504 (default: no limit)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=_size,
        default=8 << 20,
        help="largest request body (suffixes K/M/G; default 8M); larger ones get 413",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="require the API key for /health, /metrics, /dashboard and /version too",
    )
    p.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        help="enable CORS for these origins (comma-separated or a JSON list, repeatable; "
        "'*' for any); CORS is off by default",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in request bodies (a template is code to run)",
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    from zllm import bench

    bench.add_parsers(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"zllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
