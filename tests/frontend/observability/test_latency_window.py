"""The dashboard's latency window (frontend/observability/dashboard.py LatencyWindow): the
percentiles of the last `window_s` seconds from a ring allocated once, so its memory does
not grow with the requests it has seen (issue 56)."""

from __future__ import annotations

import tracemalloc

from zllm.frontend.observability import dashboard
from zllm.frontend.observability.dashboard import LatencyWindow
from zllm.runtime.percentile import percentile


def test_percentiles_cover_only_the_last_window():
    window = LatencyWindow(window_s=10.0, max_samples=64)
    for t in range(20):  # one latency a second: t seconds -> t / 100 s
        window.add(float(t), t / 100)
    p = window.percentiles(now=19.0)
    kept = [t / 100 for t in range(9, 20)]  # samples from 9 s on are within 10 s of 19 s
    assert p.count == len(kept)
    assert (p.p50, p.p90, p.p99) == (
        percentile(kept, 50),
        percentile(kept, 90),
        percentile(kept, 99),
    )
    assert window.percentiles(now=100.0).count == 0  # all older than the window


def test_past_its_size_the_oldest_latencies_give_way():
    window = LatencyWindow(window_s=1e9, max_samples=8)
    for i in range(30):
        window.add(float(i), float(i))
    p = window.percentiles(now=30.0)
    assert p.count == 8
    assert p.p50 == percentile([float(i) for i in range(22, 30)], 50)


def test_its_memory_does_not_grow_with_the_samples_it_sees():
    window = LatencyWindow(window_s=60.0, max_samples=4096)
    window.add(0.0, 0.1)
    tracemalloc.start()
    try:
        for i in range(20_000):
            window.add(i / 1000, 0.01 * (i % 7))
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # Only what the window's own module allocated and still holds: under xdist another test's
    # engine threads in this worker allocate too, and tracemalloc's totals count every thread.
    held = snapshot.filter_traces([tracemalloc.Filter(True, dashboard.__file__)])
    grown = sum(stat.size for stat in held.statistics("filename"))
    assert grown < 1024, f"the window grew by {grown} B over 20,000 samples"
