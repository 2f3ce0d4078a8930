"""What one tensor-parallel collective costs on this machine: gloo all-reduce and all-gather
of a decode step's tensors between N rank processes on loopback, the mean of a run of back-to-back calls (median of five runs).

A decode step of a model with L layers makes 2 L all-reduces ([rows, hidden]) and one
all-gather of the logits ([rows, vocab / N]), so L * 2 * all-reduce + all-gather is the
step's floor of communication; compare it with the step time `zllm bench serve` reports.

    python benchmarks/tp_collectives.py --ranks 2 3 --hidden 576 --vocab 49152 --rows 1 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _rank(rank: int, size: int, port: int, args, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    out = {}
    for rows in args.rows:
        x = torch.randn(rows, args.hidden)
        logits = torch.randn(rows, -(-args.vocab // size))
        parts = [torch.empty_like(logits) for _ in range(size)]
        for name, op in (
            ("all_reduce", lambda x=x: dist.all_reduce(x)),
            ("all_gather", lambda logits=logits, parts=parts: dist.all_gather(parts, logits)),
        ):
            for _ in range(20):  # warm-up
                op()
            # Back to back, as a decode step makes them (little compute between): the mean of
            # a run of calls, median of five runs.
            runs = []
            for _ in range(5):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.iters):
                    op()
                runs.append((time.perf_counter() - start) / args.iters)
            out[(name, rows)] = statistics.median(runs) * 1e6
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=30, help="for the per-step floor")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    from zllm.runtime.procutil import free_ports

    print(f"cores: {len(os.sched_getaffinity(0))}; hidden {args.hidden}, vocab {args.vocab}")
    print("| ranks | rows | all-reduce us | all-gather (logits) us | per step ms (2 L + 1) |")
    print("|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for size in args.ranks:
        results = ctx.SimpleQueue()
        port = free_ports(1)[0]
        procs = [
            ctx.Process(target=_rank, args=(r, size, port, args, results)) for r in range(size)
        ]
        for p in procs:
            p.start()
        out = results.get()
        for p in procs:
            p.join()
        for rows in args.rows:
            reduce_us, gather_us = out[("all_reduce", rows)], out[("all_gather", rows)]
            step_ms = (2 * args.layers * reduce_us + gather_us) / 1000
            print(f"| {size} | {rows} | {reduce_us:.0f} | {gather_us:.0f} | {step_ms:.1f} |")


if __name__ == "__main__":
    main()
