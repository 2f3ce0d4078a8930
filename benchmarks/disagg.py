"""Prefill/decode disaggregation against one server, in the same run: TTFT and TPOT at each
concurrency, and what moving the KV costs per token of context.

    single   `zllm serve MODEL`: one engine, the machine's cores in its torch pool
    disagg   a prefill server (kv_producer) and a decode server (kv_consumer), each with
             OMP_NUM_THREADS = cores / 2, behind `zllm proxy` (transport tcp, or --transport
             shm)

Each layout serves `zllm bench serve` (random token-id prompts, greedy, ignore_eos) at every
--concurrencies value with its own prompts; the decode server's /metrics say how many prompt
tokens it loaded from the transfer and how many requests stopped waiting for it.

The transfer itself is timed apart, in this process: a KVSender gathers N tokens' blocks of
the model's KV layout from a pool and a KVReceiver (another thread, the same host) puts them
into its buffer; the time from `send` until the receiver reports them, per token, median of
--reps.

    python benchmarks/disagg.py                                   # SmolLM2, ~15 min on 2 cores
    python benchmarks/disagg.py --concurrencies 8 --num-prompts 16 --transport shm
    python benchmarks/disagg.py --data-parallel-size 2   # every server of two engines
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from zllm.runtime.procutil import free_ports


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited: see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"not healthy after 600 s: see {log}")


def launch(cmd: list[str], log: Path, threads: int | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


def serve(args, port: int, log: Path, extra: list[str], procs: list, threads: int | None = None):
    cmd = [sys.executable, "-m", "zllm.cli", "serve", args.model, "--host", "127.0.0.1",
           "--port", str(port), *extra]  # fmt: skip
    proc = launch(cmd, log, threads)
    procs.append(proc)  # (the caller stops it, healthy or not)
    wait_healthy(f"http://127.0.0.1:{port}", proc, log)


def bench(args, url: str, label: str, concurrency: int, seed: int, out: Path) -> dict:
    num_prompts = max(args.num_prompts, 2 * concurrency)
    json_path = out / f"{label}-c{concurrency}.json"
    cmd = [sys.executable, "-m", "zllm.cli", "bench", "serve", "--base-url", url,
           "--num-prompts", str(num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--concurrency", str(concurrency),
           "--prompt-seed", str(seed), "--label", label, "--output-json", str(json_path)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=open(out / f"{label}-c{concurrency}.log", "wb"))
    return json.loads(json_path.read_text())


def counter(url: str, name: str, label: str = "") -> float:
    """A counter summed over its series (data-parallel engines each have theirs)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(rf"^{re.escape(name)}{{[^}}]*{label}[^}}]*}} (\S+)$", text, re.M)
    return sum(float(value) for value in found)


def kv_flags(role: str, port: int, transport: str, engines: int = 1) -> list[str]:
    extra: dict = {"transport": transport}
    if role == "kv_producer" and engines > 1:
        extra["consumer_data_parallel_size"] = engines
    config = {"kv_role": role, "kv_port": port, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free loopback ports (a data-parallel consumer's
    engines listen at kv_port + engine)."""
    import socket

    for _ in range(100):
        (first,) = free_ports(1)
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def run_layouts(args, out: Path) -> list[dict]:
    rows = []
    cores = len(os.sched_getaffinity(0))
    for layout in args.layouts:
        procs = []
        try:
            engines = args.data_parallel_size
            dp = ["--data-parallel-size", str(engines)] if engines > 1 else []
            if layout == "single":
                (port,) = free_ports(1)
                serve(args, port, out / "single.log", dp, procs)
                url = decode_url = f"http://127.0.0.1:{port}"
            else:
                pre, dec, proxy_port = free_ports(3)
                kv_port = free_port_run(engines)
                half = max(1, cores // 2)
                consumer = kv_flags("kv_consumer", kv_port, args.transport) + dp
                producer = kv_flags("kv_producer", kv_port, args.transport, engines) + dp
                serve(args, dec, out / "decode.log", consumer, procs, half)
                serve(args, pre, out / "prefill.log", producer, procs, half)
                cmd = [sys.executable, "-m", "zllm.cli", "proxy", "--port", str(proxy_port),
                       "--prefill", f"http://127.0.0.1:{pre}",
                       "--decode", f"http://127.0.0.1:{dec}"]  # fmt: skip
                proxy = launch(cmd, out / "proxy.log")
                procs.append(proxy)
                url = f"http://127.0.0.1:{proxy_port}"
                decode_url = f"http://127.0.0.1:{dec}"
                wait_healthy(url, proxy, out / "proxy.log")
            for i, concurrency in enumerate(args.concurrencies):
                hits0 = counter(decode_url, "zllm:kv_offload_hits_total", 'tier="remote"')
                waits0 = counter(decode_url, "zllm:kv_transfer_wait_timeouts_total")
                result = bench(args, url, layout, concurrency, 100 + i, out)
                time.sleep(1.0)  # the decode server's next heartbeat
                rows.append({
                    "layout": layout, "concurrency": concurrency,
                    "ttft_p50_ms": result["ttft_ms"]["p50"], "ttft_p99_ms": result["ttft_ms"]["p99"],
                    "tpot_p50_ms": result["tpot_ms"]["p50"], "tpot_p99_ms": result["tpot_ms"]["p99"],
                    "output_tok_s": result["output_throughput"],
                    "input_tokens": result["total_input_tokens"], "failed": result["failed"],
                    "remote_hit_tokens": counter(
                        decode_url, "zllm:kv_offload_hits_total", 'tier="remote"') - hits0,
                    "wait_timeouts": counter(
                        decode_url, "zllm:kv_transfer_wait_timeouts_total") - waits0,
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
        finally:
            for proc in reversed(procs):
                proc.terminate()
            for proc in procs:
                proc.wait(60)
    return rows


def transfer_cost(args) -> list[dict]:
    """Seconds per token of context to move a prompt's KV from a producer's pool into a
    consumer's buffer (gather, send, receive, store), per transport and context length."""
    import torch
    import zmq

    from zllm.config.engine_args import EngineArgs
    from zllm.config.kv_transfer import KVTransferConfig
    from zllm.executor.kv.connector import KVPool
    from zllm.executor.kv.transfer import KVReceiver, KVSender, RemoteKVBuffer

    config = EngineArgs(model=args.model).create_engine_config()
    arch, bs = config.arch, config.cache.block_size
    torch.set_num_threads(1)
    rows = []
    for transport in ("tcp", "shm"):
        for tokens in args.transfer_tokens:
            blocks = tokens // bs
            pool = KVPool([torch.randn(2, blocks + 1, bs, arch.num_kv_heads, arch.head_dim)
                           for _ in range(arch.num_layers)])  # fmt: skip
            target = KVPool([torch.zeros_like(t) for t in pool.tensors])
            (port,) = free_ports(1)
            transfer = KVTransferConfig(role="kv_both", port=port, transport=transport)
            news_addr = f"ipc://{tempfile.mkdtemp()}/news"
            news = zmq.Context.instance().socket(zmq.PULL)
            news.bind(news_addr)
            buffer = RemoteKVBuffer(target, blocks, pin_memory=False)
            KVReceiver(transfer, buffer, "bench", news_addr)
            sender = KVSender(transfer, pool, "bench")
            while not news.poll(100):  # until connected (earlier sends are dropped)
                sender.send([(10**9, 0)])
            while news.poll(300):
                news.recv()
            times = []
            for rep in range(args.reps):
                sends = [(rep * 10**6 + i, i) for i in range(blocks)]
                start = time.perf_counter()
                sender.send(sends)
                # One message of blocks, one report from the receiver once it stored them.
                assert news.poll(30_000), "the receiver did not report the blocks"
                news.recv()
                times.append(time.perf_counter() - start)
            block_bytes = pool.gather([0]).numel() * 4
            per_token_us = statistics.median(times) / tokens * 1e6
            rows.append({
                "transport": transport, "tokens": tokens, "bytes": blocks * block_bytes,
                "median_s": round(statistics.median(times), 4),
                "us_per_token": round(per_token_us, 2),
                "GB_per_s": round(blocks * block_bytes / statistics.median(times) / 1e9, 2),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            news.close(linger=0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--layouts", nargs="+", default=["single", "disagg"])
    parser.add_argument("--concurrencies", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, help="engines of each server (both layouts)"
    )
    parser.add_argument("--transfer-tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--out", default=None, help="results directory (default: a temp dir)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="zllm-disagg-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"results in {out}", flush=True)
    results = {"transfer": transfer_cost(args)}
    if not args.skip_serving:
        results["serving"] = run_layouts(args, out)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
