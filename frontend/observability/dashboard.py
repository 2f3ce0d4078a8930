"""The live dashboard: `GET /dashboard` (one static page) polls `GET /dashboard/stats`.

The page draws everything itself (SVG, no libraries, nothing fetched from elsewhere). The
stats are the core's latest heartbeat (KV block grid, running and waiting requests, token
counters), the supervisor's process table, and what this frontend keeps beside them: the
heartbeat sampled once a second for the last few minutes (`Timeline`), and the TTFT and
inter-token latencies of the last minute (`LatencyWindow`), which `metrics.Metrics` feeds.

A tenant's view (frontend/access/permissions.py) has its own prefix-cache hits in place of the engine's,
only its own row among the tenants, and no tier hits.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from array import array
from collections import deque
from importlib import resources

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from zllm.frontend.access.permissions import EVERYONE, VIEWER_KEY, Viewer
from zllm.frontend.observability.tenant_prefix_hits import TenantPrefixHits
from zllm.kv.tiers import TIER_NAMES
from zllm.protocol import MAX_BLOCK_CELLS, EngineStats, ProcessRole
from zllm.runtime.engine_client import EngineClient
from zllm.runtime.percentile import percentile

HISTORY_S = 120  # what the charts show
_ROLE_ORDER = (
    ProcessRole.FRONTEND,
    ProcessRole.TOKENIZER,
    ProcessRole.CORE,
    ProcessRole.EXECUTOR,
    ProcessRole.DETOKENIZER,
)


class LatencyWindow:
    """Latencies (seconds) observed in the last `window_s`, for percentiles.

    A ring of `max_samples` (time, value) pairs allocated once, up front: the window takes
    the same memory on its first request as on its millionth (a deque of tuples grew by
    ~110 B a sample until it reached its bound, which read as the frontend's growth per
    request in the soak; issue 56). Past `max_samples` the oldest pairs are overwritten,
    so a busy minute's percentiles come from its latest `max_samples` latencies."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 8192) -> None:
        self.window_s = window_s
        self.max_samples = max_samples
        self._times = array("d", bytes(8 * max_samples))
        self._values = array("d", bytes(8 * max_samples))
        self._next = 0  # the slot the next sample takes
        self.count = 0  # samples held (at most max_samples)

    def add(self, now: float, value: float) -> None:
        self._times[self._next] = now
        self._values[self._next] = value
        self._next = (self._next + 1) % self.max_samples
        self.count = min(self.count + 1, self.max_samples)

    def percentiles(self, now: float) -> Percentiles:
        oldest = now - self.window_s
        start = self._next - self.count
        values = [
            self._values[i % self.max_samples]
            for i in range(start, self._next)
            if self._times[i % self.max_samples] >= oldest
        ]
        if not values:
            return Percentiles()
        return Percentiles(
            percentile(values, 50), percentile(values, 90), percentile(values, 99), len(values)
        )


class _Point(msgspec.Struct, array_like=True, gc=False):
    time: float  # the heartbeat's (the core's clock when it sent it)
    running: int
    waiting: int
    kv_usage: float
    prompt_tokens: int
    generation_tokens: int
    busy_s: float
    idle_s: float


class Timeline:
    """The core's heartbeat, sampled once a second by a task that starts with the first
    request or dashboard poll and keeps going for the life of the process."""

    def __init__(self, client: EngineClient, interval_s: float = 1.0, size: int = 600) -> None:
        self.client = client
        self.interval_s = interval_s
        self.points: deque[_Point] = deque(maxlen=size)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start sampling (in the server's event loop); idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def sample(self) -> None:
        s = self.client.stats
        if s is None or (self.points and self.points[-1].time == s.status.time):
            return  # no heartbeat yet, or no new one since the last sample
        if self.points and s.status.time < self.points[-1].time:
            self.points.clear()  # the clock went back: start over
        self.points.append(
            _Point(
                s.status.time,
                s.load.num_running,
                s.load.num_waiting,
                s.kv_pool.usage,
                s.tokens.prompt,
                s.tokens.generated,
                s.steps.executor_busy_s,
                s.steps.executor_idle_s,
            )
        )

    def history(self, now: float, seconds: float, smooth: int = 3) -> History:
        """Per sample since `now - seconds`: gauges, and token rates over the last `smooth`
        intervals (a counter that went down means the engine restarted: that span counts 0)."""
        points = list(self.points)
        start = bisect.bisect_left([p.time for p in points], now - seconds)
        h = History()
        for i in range(max(start, 1), len(points)):
            p, q = points[max(0, i - smooth)], points[i]
            dt = q.time - p.time
            h.t.append(round(q.time - now, 2))
            h.running.append(q.running)
            h.waiting.append(q.waiting)
            h.kv_usage.append(round(q.kv_usage, 4))
            h.generation_tps.append(
                round(max(0, q.generation_tokens - p.generation_tokens) / dt, 1)
            )
            h.prompt_tps.append(round(max(0, q.prompt_tokens - p.prompt_tokens) / dt, 1))
        return h

    def rates(self, now: float, seconds: float = 5.0) -> tuple[float, float, float]:
        """(generation tokens/s, prompt tokens/s, executor busy share) over the last
        `seconds`, from the oldest sample in that span to the newest."""
        points = [p for p in self.points if p.time >= now - seconds - self.interval_s]
        if len(points) < 2:
            return 0.0, 0.0, 0.0
        p, q = points[0], points[-1]
        dt = q.time - p.time
        busy, idle = q.busy_s - p.busy_s, q.idle_s - p.idle_s
        if min(q.generation_tokens - p.generation_tokens, busy, idle) < 0:
            return 0.0, 0.0, 0.0  # the engine restarted inside the span
        busy_share = busy / (busy + idle) if busy + idle > 0 else 0.0
        return (
            (q.generation_tokens - p.generation_tokens) / dt,
            (q.prompt_tokens - p.prompt_tokens) / dt,
            busy_share,
        )


# ---- the stats document --------------------------------------------------------------------


class Percentiles(msgspec.Struct):
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    count: int = 0


class History(msgspec.Struct):
    t: list[float] = msgspec.field(default_factory=list)  # seconds relative to now (<= 0)
    running: list[int] = msgspec.field(default_factory=list)
    waiting: list[int] = msgspec.field(default_factory=list)
    kv_usage: list[float] = msgspec.field(default_factory=list)
    generation_tps: list[float] = msgspec.field(default_factory=list)
    prompt_tps: list[float] = msgspec.field(default_factory=list)


class KVPool(msgspec.Struct):
    num_blocks: int
    block_size: int
    blocks_per_cell: int
    # One character per cell: "0" free, "1" in use by a request, "2" cached prefix.
    cells: str
    num_used: int  # blocks referenced by a request (exact)
    num_cached: int  # free blocks holding a reusable prefix (exact at one block per cell)
    num_free: int


class ProcessInfo(msgspec.Struct):
    role: str
    index: int
    up: bool


class KVTier(msgspec.Struct):
    """One KV offload tier, since start: prompt tokens it served over those looked up."""

    name: str
    hit_rate: float
    hits: int
    blocks: int
    capacity: int
    load_failures: int


class TenantRow(msgspec.Struct):
    """A tenant with requests in the engine now (zllm/config/tenants.py)."""

    name: str
    running: int
    waiting: int
    weight: float


class Engine(msgspec.Struct):
    state: str
    healthy: bool
    message: str
    heartbeat_age_s: float | None
    running: int
    waiting: int
    kv_usage: float
    generation_tps: float
    prompt_tps: float
    executor_busy: float  # share of the executor's time spent computing (last seconds)
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_cache_hit_rate: float
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, found cached
    steps: int
    in_flight: int
    # Speculative decoding since start (None when the engine does not speculate): proposed
    # tokens accepted, tokens a verifying step yields on average, acceptance by position.
    spec_acceptance_rate: float | None = None
    spec_mean_acceptance_length: float | None = None
    spec_acceptance_per_pos: list[float] = []
    kv_tiers: list[KVTier] = []  # KV offload, the configured tiers (empty: off)
    pinned_blocks: int = 0  # prefix pinning: blocks pinned now, and the bound
    max_pinned_blocks: int = 0
    tenants: list[TenantRow] = []  # those with requests running or waiting, busiest first


class DashboardStats(msgspec.Struct):
    model: str
    tenant: (
        str | None
    )  # whose view: one tenant's (frontend/access/permissions.py), or None: everyone's
    time: float
    uptime_s: float
    engine: Engine
    kv: KVPool
    history: History
    ttft: Percentiles
    itl: Percentiles
    latency_window_s: float
    finished: dict[str, int]
    processes: list[ProcessInfo]


class Dashboard:
    """The two routes: the page, and its stats."""

    def __init__(
        self,
        client: EngineClient,
        model_name: str,
        timeline: Timeline,
        ttft: LatencyWindow,
        itl: LatencyWindow,
        num_finished: dict[str, int],
        prefix_hits: TenantPrefixHits,
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.timeline = timeline
        self.ttft = ttft
        self.itl = itl
        self.num_finished = num_finished
        self.prefix_hits = prefix_hits
        self.started = time.time()
        self._page = (
            resources.files("zllm.frontend.observability") / "static" / "dashboard.html"
        ).read_bytes()
        self._encoder = msgspec.json.Encoder()

    async def page(self, request: Request) -> Response:
        return Response(
            self._page, media_type="text/html; charset=utf-8", headers={"cache-control": "no-cache"}
        )

    async def stats(self, request: Request) -> Response:
        self.timeline.start()
        return Response(
            self._encoder.encode(self.snapshot(request.scope.get(VIEWER_KEY, EVERYONE))),
            media_type="application/json",
            headers={"cache-control": "no-store"},
        )

    def snapshot(self, viewer: Viewer = EVERYONE) -> DashboardStats:
        client = self.client
        s = client.stats or EngineStats()
        now, mono = time.time(), time.monotonic()
        healthy, message = client.health()
        gen_tps, prompt_tps, busy = self.timeline.rates(now)
        queries, hits = s.prefix_cache.queries, s.prefix_cache.hits
        if viewer.tenant is not None:  # its own hits, not every tenant's
            own = self.prefix_hits.of(viewer.tenant)
            queries, hits = own.queries, own.hits
        engine = Engine(
            state=str(client.engine_state),
            healthy=healthy,
            message=message,
            heartbeat_age_s=round(mono - client.last_heartbeat, 2) if client.stats else None,
            running=s.load.num_running,
            waiting=s.load.num_waiting,
            kv_usage=s.kv_pool.usage,
            generation_tps=round(gen_tps, 1),
            prompt_tps=round(prompt_tps, 1),
            executor_busy=round(busy, 4),
            prompt_tokens=s.tokens.prompt,
            generation_tokens=s.tokens.generated,
            preemptions=s.load.num_preemptions,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            steps=s.steps.count,
            in_flight=client.num_in_flight,
            kv_tiers=_kv_tiers(s) if viewer.sees_all else [],
            pinned_blocks=s.pins.pinned_blocks,
            max_pinned_blocks=s.pins.max_pinned_blocks,
            tenants=[t for t in _busy_tenants(s) if viewer.sees(t.name)],
        )
        _add_speculation(engine, s)
        return DashboardStats(
            model=self.model_name,
            tenant=viewer.tenant,
            time=now,
            uptime_s=round(now - self.started, 1),
            engine=engine,
            kv=self._kv_pool(s),
            history=self.timeline.history(now, HISTORY_S),
            ttft=self.ttft.percentiles(mono),
            itl=self.itl.percentiles(mono),
            latency_window_s=self.ttft.window_s,
            finished=dict(self.num_finished),
            processes=_processes(client),
        )

    def _kv_pool(self, s: EngineStats) -> KVPool:
        pool = s.kv_pool
        num_blocks = pool.num_blocks or self.client.config.engine.cache.num_blocks or 0
        if pool.block_states:
            per_cell = max(1, pool.blocks_per_cell)
            cells = pool.block_states.translate(_CELL_CHARS).decode("latin-1")
            used = num_blocks - pool.num_free_blocks
        else:  # the core has not taken a snapshot yet: it has not run anything either
            per_cell = max(1, -(-num_blocks // MAX_BLOCK_CELLS))
            cells = "0" * -(-num_blocks // per_cell)
            used = 0
        cached = min(cells.count("2") * per_cell, num_blocks - used)
        return KVPool(
            num_blocks=num_blocks,
            block_size=self.client.config.engine.cache.block_size,
            blocks_per_cell=per_cell,
            cells=cells,
            num_used=used,
            num_cached=cached,
            num_free=num_blocks - used - cached,
        )


_CELL_CHARS = bytes.maketrans(b"\x00\x01\x02", b"012")


def _kv_tiers(s: EngineStats) -> list[KVTier]:
    """The configured KV offload tiers (empty: off)."""
    queries, tiers = s.prefix_cache.queries, s.kv_tiers
    if tiers is None:
        return []
    return [
        KVTier(
            name=TIER_NAMES[i],
            hit_rate=tiers.hits[i] / queries if queries else 0.0,
            hits=tiers.hits[i],
            blocks=tiers.blocks[i],
            capacity=capacity,
            load_failures=tiers.load_failures[i],
        )
        for i, capacity in enumerate(tiers.capacity)
        if capacity
    ]


def _busy_tenants(s: EngineStats) -> list[TenantRow]:
    """Tenants with requests running or waiting, busiest first."""
    return sorted(
        (
            TenantRow(t.name, t.num_running, t.num_waiting, t.weight)
            for t in s.tenants
            if t.num_running or t.num_waiting
        ),
        key=lambda t: (-t.running, -t.waiting, t.name),
    )


def _add_speculation(engine: Engine, s: EngineStats) -> None:
    """Speculative decoding's acceptance, when the engine speculates."""
    spec = s.spec
    if spec is None or not spec.accepted_per_pos:
        return
    drafts = spec.num_drafts
    engine.spec_acceptance_rate = (
        spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0.0
    )
    engine.spec_mean_acceptance_length = 1 + spec.num_accepted_tokens / drafts if drafts else 1.0
    engine.spec_acceptance_per_pos = [
        round(n / drafts, 4) if drafts else 0.0 for n in spec.accepted_per_pos
    ]


def _processes(client: EngineClient) -> list[ProcessInfo]:
    return [
        # Engine processes carry their engine: a row per engine's role when several.
        ProcessInfo(
            f"{key[0]} (engine {key[2]})" if client.num_engines > 1 and len(key) > 2 else key[0],
            key[1],
            alive,
        )
        for key, alive in sorted(
            client.processes.items(),
            key=lambda item: (_role_rank(item[0][0]), item[0][2:], item[0][0], item[0][1]),
        )
    ]


def _role_rank(role: ProcessRole) -> int:
    return _ROLE_ORDER.index(role)
