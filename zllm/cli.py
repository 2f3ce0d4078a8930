"""The `zllm` command: serve a model over an OpenAI-compatible API, generate from the shell,
answer a file of OpenAI batch requests offline (`zllm run-batch`), download a model (a short
name or a Hugging Face Hub id), benchmark, and put one endpoint over disaggregated prefill
and decode servers (`zllm proxy`)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict

from zllm.config.arg_utils import add_dataclass_args, dataclass_from_args
from zllm.config.engine_args import add_engine_args, engine_args_from
from zllm.config.serve import ServeConfig, ServerArgs
from zllm.runtime.launch import serve_config_from


def cmd_download(args: argparse.Namespace) -> int:
    from zllm.model.files import resolve_model

    print(resolve_model(args.name, args.revision, args.download_dir))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from zllm import LLM, SamplingParams

    llm = LLM(**asdict(engine_args_from(args)))
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
    from zllm.runtime.supervisor import serve

    return serve(serve_config_from_args(args))


def cmd_run_batch(args: argparse.Namespace) -> int:
    import asyncio

    from zllm.frontend.openai.batch import run_batch

    config = serve_config_from_args(args)
    asyncio.run(run_batch(config, args.input_file, args.output_file, not args.no_progress_bar))
    return 0  # (as vllm run-batch: failed lines are answered in the output, not an exit code)


def cmd_proxy(args: argparse.Namespace) -> int:
    from zllm.proxy.app import ProxyConfig, run_proxy

    config = ProxyConfig(
        args.prefill, args.decode, args.timeout, args.api_key, args.startup_timeout
    )
    run_proxy(config, args.host, args.port)  # (a pairing refused: a ValueError, exit 2)
    return 0


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """What `zllm serve` runs with: the parsed flags, with the model resolved."""
    server = dataclass_from_args(ServerArgs, args)
    return serve_config_from(engine_args_from(args).create_engine_config(), server)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zllm", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="the OpenAI-compatible server (all processes)")
    add_dataclass_args(p, ServerArgs, title="server options")
    add_engine_args(p, model_positional=True)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="complete one prompt from the shell")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "run-batch",
        help="answer a file of OpenAI batch requests (chat, completions, embeddings) offline",
    )
    p.add_argument("-i", "--input-file", required=True,
                   help="JSONL of {custom_id, method, url, body} lines; - for stdin")  # fmt: skip
    p.add_argument("-o", "--output-file", required=True,
                   help="JSONL of one answer per request line, in order; - for stdout")  # fmt: skip
    p.add_argument("--no-progress-bar", action="store_true", help="no progress bar on stderr")
    add_dataclass_args(p, ServerArgs, title="server options (those that shape answers apply)")
    add_engine_args(p)
    p.set_defaults(func=cmd_run_batch)

    p = sub.add_parser(
        "proxy",
        help="one OpenAI endpoint over prefill (kv_producer) and decode (kv_consumer) servers",
    )
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill server's base URL (repeat for several: the pairs take requests round "
        "robin)",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode server's base URL (repeat for several, paired in order with --prefill; "
        "or one for all)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request to a server may take")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait at start for servers still starting; then the proxy "
                   "checks that they pair up (kv roles, the same weights) or exits")  # fmt: skip
    p.add_argument("--api-key", default=None,
                   help="the key the start's check asks the servers' GET /v1/models with, if "
                   "they need one (clients' requests carry their own)")  # fmt: skip
    p.set_defaults(func=cmd_proxy)

    p = sub.add_parser(
        "download", help="fetch a model (a short name or a Hub id) into its cache; print its path"
    )
    p.add_argument("name", nargs="?", default="smollm2")
    p.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit hash")
    p.add_argument("--download-dir", default=None, help="the Hugging Face cache to fetch into")
    p.set_defaults(func=cmd_download)

    from zllm.bench import cli as bench

    bench.add_parsers(sub)
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
