"""Tenants in the core: what each was served, and weighted fair share between them.

`TenantLedger` (every policy) counts each tenant's requests, computed and generated tokens
and preemptions for /metrics, and keeps its virtual counter: the tokens the engine computed
for it (prompt chunks and decodes) divided by its weight.

`FairShare` (`--scheduling-policy fair`) uses the ledger to share the batch. A tenant is
*active* while it has requests running or waiting; an active tenant with weight w is owed
`floor(max_num_seqs * w / W)` running sequences, W the active tenants' total weight.

    admission   the next waiting request comes from the tenant that runs fewer sequences
                than it is owed, and among those (or, when none does, among all) from the
                one with the lowest virtual counter; within a tenant, priority then arrival
    preemption  when a tenant runs fewer sequences than it is owed, has requests waiting,
                and the batch has no free slot (max_num_seqs), the newest lowest-priority
                running request of the most-served tenant that runs *more* than its exact
                share is preempted for it (recomputed later, mostly from the prefix cache);
                the same, one request a step, while the KV pool has no room for it
    budget      running requests get the step's token budget in counter order, so when
                blocks run out it is the most-served tenant's request that is preempted

A tenant is never preempted below its own share, so preemption cannot ping-pong. A tenant
that comes back after being idle starts at the lowest counter among active tenants, not at
its old one: idle time banks no credit (the Virtual Token Counter of Sheng et al., "Fairness
in Serving Large Language Models", OSDI 2024, with slot shares so that a flood already
running yields to a newcomer at once instead of one finished request at a time).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from zllm.core.request import Request
from zllm.protocol import CacheSize, TenantStats

# Idle tenants whose counts are kept (the least recently active are forgotten beyond this;
# active ones are always kept): bounds the memory and the /metrics series of a server whose
# clients make up X-Tenant names.
MAX_IDLE_TENANTS = 256


@dataclass(slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    served: float = 0.0  # virtual counter: computed tokens / weight
    num_active: int = 0  # client requests not finished
    num_requests: int = 0
    num_computed_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0


class TenantLedger:
    """Every tenant the core has seen (bounded, see MAX_IDLE_TENANTS) and what it was served."""

    def __init__(self, weights: dict[str, float], max_idle: int = MAX_IDLE_TENANTS) -> None:
        self.weights = weights
        self.max_idle = max_idle
        # Least recently active first.
        self.tenants: OrderedDict[str, Tenant] = OrderedDict()

    def __getitem__(self, name: str) -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(name, self.weights.get(name, 1.0))
        return tenant

    def arrive(self, name: str) -> None:
        """A client request of `name` entered the core."""
        tenant = self[name]
        if tenant.num_active == 0:
            # Back from idle: no credit for the time away.
            floor = min((t.served for t in self.tenants.values() if t.num_active), default=None)
            if floor is not None:
                tenant.served = max(tenant.served, floor)
        tenant.num_active += 1
        tenant.num_requests += 1
        self.tenants.move_to_end(name)
        self._forget_idle()

    def depart(self, name: str) -> None:
        """A client request of `name` ended (all its sequences)."""
        self[name].num_active -= 1
        self._forget_idle()  # (it may have gone idle: the bound holds after every change)

    def charge(self, name: str, num_tokens: int) -> None:
        """The engine computes `num_tokens` tokens for `name` in a step being scheduled."""
        tenant = self[name]
        tenant.num_computed_tokens += num_tokens
        tenant.served += num_tokens / tenant.weight

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> list[TenantStats]:
        num_running = Counter(r.tenant for r in running)
        num_waiting = Counter(r.tenant for r in waiting)
        return [
            TenantStats(
                name=t.name,
                weight=t.weight,
                num_running=num_running[t.name],
                num_waiting=num_waiting[t.name],
                num_requests=t.num_requests,
                num_computed_tokens=t.num_computed_tokens,
                num_generation_tokens=t.num_generation_tokens,
                num_preemptions=t.num_preemptions,
            )
            for t in list(self.tenants.values())
        ]

    def cache_size(self) -> CacheSize:
        """For /metrics: the tenants kept, at most `max_idle` idle ones beside the active."""
        tenants = list(self.tenants.values())  # (a copy: the heartbeat thread reads it)
        num_active = sum(1 for t in tenants if t.num_active)
        return CacheSize("core", "tenant_ledger", len(tenants), self.max_idle + num_active)

    def _forget_idle(self) -> None:
        if len(self.tenants) <= self.max_idle:
            return
        idle = [name for name, t in self.tenants.items() if not t.num_active]
        for name in idle[: max(0, len(idle) - self.max_idle)]:
            del self.tenants[name]


@dataclass(slots=True)
class TenantLoad:
    """The active tenants' sequences in one step, kept current as it preempts and admits."""

    running: Counter[str] = field(default_factory=Counter)
    waiting: Counter[str] = field(default_factory=Counter)
    share: dict[str, float] = field(default_factory=dict)  # exact share of max_num_seqs

    def owed(self, name: str) -> int:
        return math.floor(self.share.get(name, 0.0))

    def below_share(self, name: str) -> bool:
        return self.running[name] < self.owed(name)

    def move(self, name: str, to_running: bool) -> None:
        step = 1 if to_running else -1
        self.running[name] += step
        self.waiting[name] -= step


class FairShare:
    """The `fair` policy's choices; the scheduler carries them out (see the module doc)."""

    def __init__(self, ledger: TenantLedger, max_num_seqs: int) -> None:
        self.ledger = ledger
        self.max_num_seqs = max_num_seqs
        self.load = TenantLoad()
        # A waiting request of a tenant below its share that the KV pool had no room for
        # when it was its turn (set during admission, read by the next step).
        self.blocked: Request | None = None

    def begin_step(self, running: list[Request], waiting: Iterable[Request]) -> None:
        load = self.load = TenantLoad(
            running=Counter(r.tenant for r in running), waiting=Counter(r.tenant for r in waiting)
        )
        active = {name for name, n in (load.running + load.waiting).items() if n > 0}
        total = sum(self.ledger[name].weight for name in active)
        load.share = {name: self.max_num_seqs * self.ledger[name].weight / total for name in active}

    def victims(
        self,
        running: list[Request],
        free_slots: int,
        held_blocks: Callable[[str], int],
        num_blocks: int,
    ) -> list[Request]:
        """Running requests to preempt before this step, so that tenants below their share
        with requests waiting get room (see the module doc). `held_blocks`: the KV blocks a
        running request holds (by its id), of the pool's `num_blocks`."""
        load = self.load
        wanted = sum(
            min(load.waiting[name], load.owed(name) - load.running[name])
            for name in load.share
            if load.below_share(name)
        )
        blocked, self.blocked = self.blocked, None
        if wanted <= free_slots:
            if blocked is None or not load.below_share(blocked.tenant):
                return []
            # Slots are free, blocks are not: another tenant holding more blocks than its
            # share of the pool yields one request a step until the blocked one fits.
            held: Counter[str] = Counter()
            for r in running:
                held[r.tenant] += held_blocks(r.req_id)
            over = [
                n
                for n, b in held.items()
                if n != blocked.tenant
                and b > num_blocks * load.share.get(n, 0.0) / self.max_num_seqs
            ]
            victim = self._newest_of_most_served(running, over, [])
            return [] if victim is None else [victim]
        num_running = load.running.copy()  # the load itself changes as they are preempted
        chosen: list[Request] = []
        for _ in range(wanted - free_slots):
            over = [n for n, k in num_running.items() if k > load.share.get(n, 0.0)]
            victim = self._newest_of_most_served(running, over, chosen)
            if victim is None:
                break
            chosen.append(victim)
            num_running[victim.tenant] -= 1
        return chosen

    def _newest_of_most_served(
        self, running: list[Request], tenants: list[str], exclude: list[Request]
    ) -> Request | None:
        """The lowest-priority, newest running request of the most-served of `tenants` (not
        in `exclude`), or None when `tenants` is empty."""
        if not tenants:
            return None
        name = max(tenants, key=lambda n: self.ledger[n].served)
        return max(
            (r for r in running if r.tenant == name and r not in exclude),
            key=lambda r: r.priority_key,
        )

    def running_key(self, req: Request) -> tuple[float, tuple[int, float]]:
        """Order of running requests for the token budget: least-served tenant first."""
        return (self.ledger[req.tenant].served, req.priority_key)

    def pick(self, candidates: Iterable[Request]) -> Request | None:
        """The next waiting request to admit among `candidates` (in queue order: priority,
        then arrival), or None."""
        load = self.load
        num_tenants = sum(1 for n in load.waiting.values() if n > 0)
        best: Request | None = None
        best_key: tuple[bool, float] | None = None
        seen: set[str] = set()
        for req in candidates:
            if req.tenant in seen:
                continue
            seen.add(req.tenant)
            key = (not load.below_share(req.tenant), self.ledger[req.tenant].served)
            if best_key is None or key < best_key:
                best, best_key = req, key
            if len(seen) >= num_tenants:
                break  # every tenant with requests waiting has its first candidate here
        return best
