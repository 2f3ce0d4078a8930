"""torch's CPU ops in a process's main thread against a thread Python started: the reason the
Ray rank actor runs its steps in the actor's main thread (executor/ranks/ray_actors.py).

A decode-sized linear (8 x 576 by 1536 x 576, SmolLM2's gate/up shape at batch 8) in a loop
for a second, with the same torch thread count, in the main thread and in a new thread.

    python benchmarks/thread_pool.py [--threads 2]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch


def per_call_us(threads: int) -> float:
    torch.set_num_threads(threads)
    x, w = torch.randn(8, 576), torch.randn(1536, 576)
    for _ in range(50):
        torch.nn.functional.linear(x, w)
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 1.0:
        for _ in range(100):
            torch.nn.functional.linear(x, w)
        calls += 100
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"main thread:    {per_call_us(args.threads):7.1f} us per call")
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(per_call_us(args.threads)))
    thread.start()
    thread.join()
    print(f"started thread: {result[0]:7.1f} us per call")


if __name__ == "__main__":
    main()
