"""Sleep mode's cost per level: how long `sleep(level)` and `wake_up()` take and how much
resident memory sleeping releases. Median of `--repeats`; the KV pool is written first so it
is resident.

    python benchmarks/sleep_wake.py smollm2 [--kv-cache-memory-bytes 1G] [--repeats 3]

Offline by default (the served path runs the same EngineCore calls). With `--serve`, a
`zllm serve` on loopback with the flags after `--` (e.g. `--data-parallel-size 2` or
`--tensor-parallel-size 3`: every engine and rank sleeps), timed through POST /sleep and
/wake_up, resident memory summed over the server's process tree, and a greedy completion
checked equal before and after each wake-up:

    python benchmarks/sleep_wake.py smollm2 --serve -- --data-parallel-size 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident set (0 for one that has no memory of its own: a kernel thread)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def touch_pool(llm) -> None:
    """Write the whole KV pool, so it is resident as a pool in use is (a function: a loop
    variable left in main() would keep a pool tensor alive through the sleep)."""
    for tensor in llm.model_runner.kv_tensors:
        tensor.fill_(0)


def tree_resident_bytes(pid: int) -> int:
    """VmRSS summed over `pid` and its descendants (a server's processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        try:
            total += resident_bytes(current)
        except OSError:  # (it ended meanwhile)
            continue
    return total


def measure_levels(sleep, wake_up, resident, check, repeats: int) -> dict:
    """Per level, the median seconds `sleep(level)` and `wake_up()` took and the resident
    bytes sleeping released (`resident()` before and after), `check()` after each wake-up."""
    results = {}
    for level in (1, 2):
        sleeps, wakes, released = [], [], []
        for _ in range(repeats):
            before = resident()
            start = time.perf_counter()
            sleep(level)
            sleeps.append(time.perf_counter() - start)
            released.append(before - resident())
            start = time.perf_counter()
            wake_up()
            wakes.append(time.perf_counter() - start)
            check()
        results[f"level{level}"] = {
            "sleep_s": round(statistics.median(sleeps), 3),
            "wake_s": round(statistics.median(wakes), 3),
            "released_mib": round(statistics.median(released) / 2**20, 1),
        }
    return results


def served(args: argparse.Namespace) -> dict:
    """The served measurement (--serve): one server, each level `repeats` times."""
    import httpx

    from zllm.runtime.procutil import free_ports

    port = free_ports(1)[0]
    command = [
        sys.executable, "-m", "zllm.cli", "serve", args.model, "--host", "127.0.0.1",
        "--port", str(port), "--enable-sleep-mode",
        "--kv-cache-memory-bytes", args.kv_cache_memory_bytes, *args.serve_args,
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, timeout=600)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{' '.join(command)} did not come up")
            time.sleep(0.5)
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Sleep mode releases memory while the engine is idle.",
                "max_tokens": 16, "temperature": 0, "ignore_eos": True}  # fmt: skip

        def complete() -> str:
            return client.post("/v1/completions", json=body).json()["choices"][0]["text"]

        expected = complete()

        def check() -> None:
            assert complete() == expected, "outputs after waking differ"

        return measure_levels(
            lambda level: client.post("/sleep", params={"level": level}).raise_for_status(),
            lambda: client.post("/wake_up").raise_for_status(),
            lambda: tree_resident_bytes(server.pid),
            check,
            args.repeats,
        )
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kv-cache-memory-bytes", default="1G")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="through `zllm serve`")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # `zllm serve` flags after --
    args = parser.parse_args(argv[:cut])
    args.serve_args = argv[cut + 1 :]
    if args.serve:
        results = served(args)
        print(json.dumps({"model": args.model, "serve_args": args.serve_args, **results}))
        return 0

    from zllm import LLM, SamplingParams
    from zllm.config.arg_utils import parse_size

    llm = LLM(
        args.model,
        enable_sleep_mode=True,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory_bytes),
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = "Sleep mode releases memory while the engine is idle."
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    touch_pool(llm)

    def check() -> None:
        touch_pool(llm)
        again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert again == expected, "outputs after waking differ"

    results = measure_levels(
        lambda level: llm.sleep(level=level), llm.wake_up, resident_bytes, check, args.repeats
    )
    print(
        json.dumps(
            {"model": args.model, "kv_cache_memory_bytes": args.kv_cache_memory_bytes, **results}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
