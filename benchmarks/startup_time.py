"""Seconds from launching a server to its first successful /health (issue 37's load-time
goal: at most llama-server's on the same file), for each engine in turn, repeated; medians.

    python benchmarks/startup_time.py --repeats 5 \\
        --engine "zllm=zllm serve MODEL.gguf --port {port}" \\
        --engine "llama-server=/path/llama-server -m MODEL.gguf --port {port}"

Each run starts the command in its own process group, polls http://127.0.0.1:{port}/health
every 20 ms, then stops the group with SIGINT (SIGKILL after 30 s). Engines alternate run by
run, so a drift in the machine's load touches both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import time
import urllib.request


def time_to_health(command: str, port: int, timeout_s: float) -> float:
    args = shlex.split(command.format(port=port))
    start = time.perf_counter()
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited with {proc.returncode} before /health")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"{args[0]}: no /health within {timeout_s} s")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", action="append", required=True, help="LABEL=COMMAND")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--output-json", default=None, help="also write {label: runs} here")
    args = parser.parse_args()
    engines = [e.split("=", 1) for e in args.engine]
    times: dict[str, list[float]] = {label: [] for label, _ in engines}
    for _ in range(args.repeats):
        for label, command in engines:
            times[label].append(time_to_health(command, args.port, args.timeout))
            time.sleep(1.0)  # the port and the page cache settle
    for label, runs in times.items():
        shown = " ".join(f"{t:.2f}" for t in runs)
        print(f"{label}: median {statistics.median(runs):.2f} s (runs: {shown})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    label: {"median_s": statistics.median(runs), "runs_s": runs}
                    for label, runs in times.items()
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
