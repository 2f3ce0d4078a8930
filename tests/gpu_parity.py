"""The GPU tests' comparisons with the CPU engine (tests/test_cuda*.py): greedy outputs equal,
or a first mismatch at a near-tie; freeing an engine's GPU memory between engines; counting
a graph runner's replays."""

from __future__ import annotations

import torch


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def assert_same_greedy(gpu_out, cpu_out, label: str) -> int:
    """Exact equality, or a first mismatch at a near-tie: each side's token in the other's
    top-5 with a CPU logprob gap under parity.TIE_TOLERANCE (cuBLAS sums in another order
    than CPU BLAS). Returns the number of such flips."""
    from parity import FLIPS, TIE_TOLERANCE

    flips = 0
    for i, (g, c) in enumerate(zip(gpu_out, cpu_out, strict=True)):
        ours, theirs = g.outputs[0].token_ids, c.outputs[0].token_ids
        k = first_divergence(ours, theirs)
        if k is None:
            assert len(ours) == len(theirs), f"{label}[{i}]: lengths differ"
            continue
        g_top, c_top = g.outputs[0].logprobs[k], c.outputs[0].logprobs[k]
        assert theirs[k] in g_top and ours[k] in c_top, f"{label}[{i}]: flip at {k} off top-5"
        gap = abs(c_top[theirs[k]].logprob - c_top[ours[k]].logprob)
        assert gap < TIE_TOLERANCE, f"{label}[{i}]: flip at {k}, CPU logprob gap {gap:.4f}"
        FLIPS.append(f"{label}[{i}]: GPU vs CPU flip at output position {k} (gap {gap:.4f})")
        flips += 1
    return flips


def free_llm(llm) -> None:
    import gc

    del llm
    gc.collect()
    torch.cuda.empty_cache()


def counting_replays(runner) -> list[int]:
    """Wrap a CudaGraphRunner's run so that each replay (an answer other than None) is
    counted in the one-element list returned."""
    count, run = [0], runner.run

    def counted(*args):
        out = run(*args)
        count[0] += out is not None
        return out

    runner.run = counted
    return count
