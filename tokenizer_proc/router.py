"""Which data-parallel engine serves a request (`--data-parallel-size N`).

Each tokenizer worker keeps a view of every engine, built from what the engines' cores
publish (core/main.py, one PUB socket each):

- its load, from the heartbeat (every 0.5 s): waiting x 4 + running, as the Kubernetes
  inference gateway's queue scorer weighs them, plus one for each request this worker sent
  it since that heartbeat (which does not know them yet; counted as running, which most are
  by the next one, or finished);
- the block hashes its prefix cache holds, from its KV cache events, and the prompts this
  worker sent it in the last RECENT_S seconds (their blocks are cached once the engine
  schedules them, a little later: without this, a burst of requests sharing a prefix would
  scatter before the first event arrives).

`cache_aware` routing scores each engine that is up as

    PREFIX_WEIGHT x (share of the prompt's full blocks it holds, leading run) - load

and takes the best (ties: the least loaded, then round robin). A prompt whose prefix one
engine holds goes there unless that engine's load is more than PREFIX_WEIGHT x the share
above another's (8 running requests, or 2 waiting, for a whole-prompt hit): so a shared
long prefix stays on its engine while the engines are near balance, and an engine that grew
a queue sheds new work whatever it holds. `load` routing
ignores the prefix.

A prefill/decode disaggregation consumer's request marked do_remote_prefill is pinned
instead, under either policy: its KV blocks come from the producer into the buffer of one
engine, which both servers compute from the prompt (zllm/config/kv_transfer.py
`consumer_engine`). If that engine is down it goes where the policy says, unmarked (its
blocks went to the engine that is down: it computes the prompt rather than wait for them).

Every engine is up when the worker starts (the supervisor starts the workers once every
engine is ready, so the first requests need not wait for a heartbeat). An engine is down
(never chosen) once its heartbeats stop for DOWN_AFTER_S, or when a send to it fails; its
view is then forgotten (a restarted engine's cache is empty) and it is up again with its
next heartbeat. The view is a routing hint: a stale or lost event costs a prefix hit
elsewhere, never a wrong answer, since each engine checks its own cache.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from zllm.kv.block_hash import BlockHash
from zllm.protocol import EngineStats, KVCacheEvents

# A waiting request weighs this many running ones (the inference gateway's queue scorer).
WAITING_WEIGHT = 4
# What a whole-prompt prefix hit is worth, in load units: two waiting requests.
PREFIX_WEIGHT = 8.0
# Seconds this worker counts a prompt it routed as held by its engine (until the engine's
# own KV events take over).
RECENT_S = 10.0
# Recent hashes kept per engine at most: past it the oldest go, expired or not (a burst of
# more than this many blocks within RECENT_S then credits the engine with fewer of them).
MAX_RECENT = 1 << 16
# Seconds without a heartbeat (sent every 0.5 s) before an engine counts as down.
DOWN_AFTER_S = 2.0


@dataclass(eq=False)
class EngineView:
    """What one tokenizer worker knows of one engine."""

    index: int
    held: set[BlockHash] = field(default_factory=set)  # block hashes from its KV events
    # Routed here: hash -> when, oldest first (expired ones are dropped from the front).
    recent: OrderedDict[BlockHash, float] = field(default_factory=OrderedDict)
    num_waiting: int = 0
    num_running: int = 0
    routed_since_stats: int = 0
    last_heartbeat: float | None = None  # None: never heard from (or marked down since)

    @property
    def load(self) -> int:
        return WAITING_WEIGHT * self.num_waiting + self.num_running + self.routed_since_stats

    def holds(self, block_hash: BlockHash, now: float) -> bool:
        if block_hash in self.held:
            return True
        routed_at = self.recent.get(block_hash)
        return routed_at is not None and now - routed_at < RECENT_S

    def forget(self) -> None:
        self.held.clear()
        self.recent.clear()
        self.num_waiting = self.num_running = self.routed_since_stats = 0
        self.last_heartbeat = None


class Router:
    def __init__(
        self,
        num_engines: int,
        policy: str = "cache_aware",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in ("cache_aware", "load"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.clock = clock
        # Up from the start: see the module's docstring.
        self.engines = [EngineView(i, last_heartbeat=clock()) for i in range(num_engines)]
        self._next = 0  # round robin among ties

    # ---- what the engines publish ------------------------------------------------------
    def on_message(self, msg: EngineStats | KVCacheEvents) -> None:
        if not 0 <= _engine_of(msg) < len(self.engines):
            return  # from a config this worker does not share: ignore
        if isinstance(msg, EngineStats):
            self.on_stats(msg)
        else:
            self.on_kv_events(msg)

    def on_stats(self, stats: EngineStats) -> None:
        view = self.engines[stats.status.engine_index]
        view.num_waiting, view.num_running = stats.load.num_waiting, stats.load.num_running
        view.routed_since_stats = 0
        view.last_heartbeat = self.clock()

    def on_kv_events(self, events: KVCacheEvents) -> None:
        view = self.engines[events.engine]
        if events.cleared:
            view.held.clear()
            view.recent.clear()
        view.held.difference_update(events.removed)
        view.held.update(events.stored)

    def mark_down(self, engine: int) -> None:
        """A send to it failed: its core is gone (it is up again with its next heartbeat)."""
        self.engines[engine].forget()

    # ---- choosing ----------------------------------------------------------------------
    def up(self) -> list[EngineView]:
        """The engines heard from within DOWN_AFTER_S (forgetting the rest)."""
        now = self.clock()
        live = []
        for view in self.engines:
            if view.last_heartbeat is not None and now - view.last_heartbeat > DOWN_AFTER_S:
                view.forget()
            if view.last_heartbeat is not None:
                live.append(view)
        return live

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        exclude: Sequence[int] = (),
        pinned: int | None = None,
    ) -> int | None:
        """The engine for a prompt with these full-block hashes (None: no engine is up):
        `pinned` if it is up and not excluded, whatever the policy (a disaggregation
        consumer's request, whose blocks go to that engine), else the policy's pick."""
        candidates = [v for v in self.up() if v.index not in exclude]
        if not candidates:
            return None
        if any(v.index == pinned for v in candidates):
            return pinned
        now = self.clock()

        def score(view: EngineView) -> tuple[float, int]:
            share = 0.0
            if self.policy == "cache_aware" and block_hashes:
                held = next(
                    (i for i, h in enumerate(block_hashes) if not view.holds(h, now)),
                    len(block_hashes),
                )
                share = held / len(block_hashes)
            return (PREFIX_WEIGHT * share - view.load, -view.load)

        best = max(score(v) for v in candidates)
        tied = [v for v in candidates if score(v) == best]
        self._next += 1
        return tied[self._next % len(tied)].index

    def routed(self, engine: int, block_hashes: Sequence[BlockHash]) -> None:
        """A request was sent to `engine`: count it, and its prompt's blocks as held there."""
        view = self.engines[engine]
        view.routed_since_stats += 1
        now = self.clock()
        recent = view.recent
        for h in block_hashes:
            recent[h] = now
            recent.move_to_end(h)
        while recent:
            oldest, when = next(iter(recent.items()))
            if now - when < RECENT_S and len(recent) <= MAX_RECENT:
                break
            del recent[oldest]


def _engine_of(msg: EngineStats | KVCacheEvents) -> int:
    return msg.status.engine_index if isinstance(msg, EngineStats) else msg.engine
