"""The engine core: the scheduler and block manager, the step loop, and the rules around them.

A plain class with no sockets and no threads, driven the same way by the offline `LLM` (an
in-process executor) and by the core process (`core/main.py`, which adds the sockets, an
input thread and a heartbeat thread):

    add_request(EngineCoreRequest) -> RequestRejected | None      as messages arrive
    abort(ids) / client_gone(client_id) -> DetokenizerBatches       (drop detokenizer state)
    finish_sample(req_id, sample_index)                             (a stop string matched)
    batches = step(executor)   -> schedule -> executor.submit -> executor.poll -> update:
                                  one DetokenizerBatch per detokenizer worker that has news
    sleep(executor, level) / wake_up(executor, tags)                (sleep mode, when idle)
    reset_prefix_cache(executor, tiers) -> PrefixCacheReset, batches (any time)
    heartbeat()                -> EngineStats, the wire struct, filled in place

The in-flight rule lives in `step` alone: an executor that `runs_ahead` (another process runs
the steps) gets up to `MAX_STEPS_IN_FLIGHT` steps at once, or with pipeline stages one per
stage (each stage works on its own micro-batch), so the core schedules step N+1 while the
executor runs step N; an in-process executor gets one (two when it is asynchronous: it
launches a step in `submit` and finishes it at the next `submit` or `poll`). Outputs are answered in order:
`update` pairs each ModelRunnerOutput with the oldest step still in flight. Which requests
may join a step while an earlier one of theirs is out (a speculating request is held to one)
is the scheduler's rule (core/scheduler.py).

Detokenizer rules. A request's detokenizer worker is `detokenizer_index(req_id, M)`. What it
needs to know of the request (`DetokRequest`) is parked here and sent with the request's
first output, so a worker never holds state for a request that produced nothing. A request
aborted after that is named in its worker's `aborted` list, so the worker drops its state.
This module never imports torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import msgspec

from zllm.config.engine import EngineConfig, check_request_options
from zllm.config.kv_layout import block_bytes, blocks_on_every_rank
from zllm.core.executors import Executor, ExecutorTimeout
from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.connector import TieredKVConnector
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.errors import ParamError
from zllm.inputs import check_prompt, check_token_params
from zllm.kv.cache_groups import kv_cache_groups
from zllm.kv.state_layout import check_sequences_fit, num_state_slots
from zllm.model.family import Trait
from zllm.model.registry import family_of
from zllm.protocol import (
    PROMPT_TAIL_TOKENS,
    SLEEP_TAGS,
    CachePin,
    CacheSize,
    DetokenizerBatch,
    DetokRequest,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    KVPoolStats,
    KVRejection,
    KVTransfers,
    LoRAStats,
    ModelRunnerOutput,
    PinStats,
    PrefixCacheReset,
    RequestRejected,
    SchedulerOutput,
    StageStats,
)
from zllm.runtime.messaging import detokenizer_index

MAX_STEPS_IN_FLIGHT = 2
# The step id of a control step (sleep, wake-up, a tier reset's drops): the scheduler numbers
# its steps from 1, so no scheduled step is ever taken for one.
CONTROL_STEP_ID = -1

DetokenizerBatches = dict[int, DetokenizerBatch]  # worker index -> its batch


def control_step(
    *,
    sleep_level: int = 0,
    wake_up: Sequence[str] = (),
    kv_transfers: KVTransfers | None = None,
) -> SchedulerOutput:
    """A step no request is in (no tokens, nothing to sample): it carries only the executor's
    sleep (`sleep_level` 1 or 2), its wake-up (the parts named) or tier transfers."""
    return SchedulerOutput(
        step_id=CONTROL_STEP_ID,
        new_requests=[],
        cached_requests=[],
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        sleep_level=sleep_level,
        wake_up=list(wake_up),
        kv_transfers=kv_transfers,
    )


class EngineCore:
    def __init__(self, config: EngineConfig, num_detokenizers: int = 1) -> None:
        assert config.cache.num_blocks, "the executor sizes the KV pool before the core starts"
        self.config = config
        self.num_detokenizers = num_detokenizers
        family = family_of(config.arch)
        # How a prompt may be cut into chunks: an encoder's in one step; an image whose tokens
        # see each other both ways (Gemma 3's) within one chunk.
        self.whole_prompt = family.has(Trait.ENCODER)
        self.whole_images = config.arch.vision and family.has(Trait.BIDIRECTIONAL_IMAGES)
        groups = kv_cache_groups(config.arch, config.cache.hybrid_kv_cache)
        self.kv_connector = _make_kv_connector(config)
        self.block_manager = BlockManager(
            config.cache.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            sliding_windows=[g.sliding_window for g in groups],
            record_evictions=self.kv_connector is not None,
            max_pinned_blocks=max_pinned_blocks(config),
            num_state_slots=num_state_slots(config.arch, config.scheduler.max_num_seqs),
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            config.speculative,
            max_loras=config.lora.max_loras if config.lora else 0,
            kv_connector=self.kv_connector,
            kv_transfer=config.kv_transfer,
        )
        stages = config.pipeline_parallel_size
        self.stats = EngineStats(
            kv_pool=KVPoolStats(
                num_blocks=self.block_manager.num_blocks, block_bytes=block_bytes(config)
            ),
            # Pipeline stages' time, at 0 from the start (one entry per stage).
            stages=StageStats([0.0] * stages, [0.0] * stages) if stages > 1 else None,
        )
        self._in_flight: deque[SchedulerOutput] = deque()
        # Sent to a request's detokenizer with its first output, then dropped.
        self._unannounced: dict[str, DetokRequest] = {}
        # True until a step is scheduled after the engine had nothing at all to do: the
        # executor's wait before that step was for work, not for the core.
        self._idle = True
        # Sleep mode: the parts the executor has released (SLEEP_TAGS), until woken.
        self.sleeping: set[str] = set()
        # The executor's caches as its latest output that had news of them said.
        self._executor_caches: list[CacheSize] = []

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def max_steps_in_flight(self, executor: Executor) -> int:
        """How many steps `executor` may hold at once (the module docstring's rule)."""
        if not executor.runs_ahead:
            return 1
        return max(MAX_STEPS_IN_FLIGHT, self.config.scheduler.pipeline_stages)

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> RequestRejected | None:
        """Queue a request, or say why it cannot run (nothing is queued then).

        A request whose id is already here is a resend (the frontend re-sends requests a dead
        tokenizer worker may have lost) and is ignored."""
        req_id = request.req_id
        if self.scheduler.is_known(req_id):
            return None
        # Inside the core, a client id that another request's sample already holds (the core
        # names samples `<id>#<i>`) gets a free name of its own; it is still the client's id
        # everywhere else (outputs, aborts).
        internal_id = req_id
        while self.scheduler.is_taken(internal_id):
            internal_id += "#"
        params = request.sampling_params
        try:
            check_prompt(
                request.prompt_token_ids,
                max_tokens=params.max_tokens,
                max_model_len=self.max_model_len,
                vocab_size=self.config.arch.vocab_size,
                pooling=params.embed,
            )
            check_token_params(params, self.config.arch.vocab_size)
            check_request_options(request.options, self.config)
            if self.block_manager.state_slots is not None:  # (a hybrid's seats)
                check_sequences_fit(params, self.block_manager.state_slots.num_slots)
        except ParamError as e:
            return RequestRejected.of(req_id, e)
        self.scheduler.add_request(
            Request(
                req_id=internal_id,
                client_req_id=req_id,
                prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=params,
                eos_token_ids=request.eos_token_ids,
                arrival_time=request.arrival_time or time.time(),
                client_id=request.client_id,
                options=msgspec.structs.replace(
                    request.options, cache_pin=self._cache_pin(request)
                ),
                timing=request.timing,
                images=list(request.images),
                whole_images=self.whole_images,
                whole_prompt=self.whole_prompt,
            )
        )
        if request.timing is not None:
            request.timing.core_arrival = time.time()
        self.stats.tokens.prompt += len(request.prompt_token_ids)
        self._unannounced[req_id] = DetokRequest(
            req_id=req_id,
            prompt_tail=list(request.prompt_token_ids[-PROMPT_TAIL_TOKENS:]),
            n=params.n,
            stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            want_logprobs=params.logprobs is not None or params.prompt_logprobs is not None,
        )
        return None

    def abort(self, req_ids: list[str]) -> DetokenizerBatches:
        """Drop requests wherever they are (idempotent); tell their detokenizers."""
        batches: DetokenizerBatches = {}
        for req_id in self.scheduler.abort_requests(req_ids):
            if self._unannounced.pop(req_id, None) is None:  # a worker holds its state
                self._batch_for(batches, req_id).aborted.append(req_id)
        self._note_if_idle()
        return batches

    def client_gone(self, client_id: int) -> DetokenizerBatches:
        """A client process died: nobody will read its requests' outputs, so abort them."""
        return self.abort(self.scheduler.requests_of_client(client_id))

    def kv_received(self, stored: list[bytes], removed: list[bytes], rank: int = 0) -> None:
        """A disaggregation consumer's executor rank took in these blocks (its part of them)
        from a producer and dropped those to make room: the remote tier's index follows."""
        if self.kv_connector is not None:
            self.kv_connector.received(stored, removed, rank)

    def kv_rejected(self, count: int, rejection: KVRejection) -> None:
        """A disaggregation consumer's executor rank refused `count` blocks (counted only)."""
        self.scheduler.kv.rejected(count, rejection)

    def finish_sample(self, req_id: str, sample_index: int) -> None:
        """A stop string ended one sample (the detokenizer found it; its state is gone)."""
        self.scheduler.finish_sequence(req_id, sample_index, FinishReason.STOP)
        self._note_if_idle()

    # ---- the step loop ---------------------------------------------------------------------
    def step(self, executor: Executor, wait_s: float | None = None) -> DetokenizerBatches | None:
        """One turn of the loop: submit steps while the executor has room, then apply the
        oldest step's output, waiting up to `wait_s` for it (None: until it comes). Returns
        what each detokenizer worker must be sent, or None when no output was applied
        (nothing out, or not answered within `wait_s`)."""
        self._submit_steps(executor)
        if not self._in_flight:
            return None  # idle, or stalled (nothing could be scheduled)
        output = executor.poll(wait_s)
        if output is None:
            return None
        batches = self.update(output)
        if executor.runs_ahead:  # the next step runs while these outputs are published
            self._submit_steps(executor)
        return batches

    def _submit_steps(self, executor: Executor) -> None:
        limit = self.max_steps_in_flight(executor)
        while len(self._in_flight) < limit and self.scheduler.has_unfinished_requests():
            step = self.schedule()
            if step is None:
                return
            try:
                executor.submit(step)
            except BaseException:
                self._in_flight.pop()  # it never ran (the caller aborts its requests)
                raise

    def drain(self, executor: Executor) -> DetokenizerBatches:
        """Wait for every step in flight and apply their outputs (nothing new is scheduled)."""
        batches: DetokenizerBatches = {}
        while self._in_flight:
            output = executor.poll(None)
            if output is None:
                raise ExecutorTimeout("the executor did not answer a step in flight")
            for worker, batch in self.update(output).items():
                _merge_batch(batches, worker, batch)
        return batches

    # ---- sleep mode ------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        """Whether any part is released: requests wait for a whole wake-up."""
        return bool(self.sleeping)

    def sleep(self, executor: Executor, level: int = 1) -> DetokenizerBatches:
        """Put the executor to sleep (idempotent; only with no unfinished request): the steps
        in flight are collected first (their outputs returned), then the executor releases
        its KV pool (level 1; the weights stay in host memory) or its weights too (level 2),
        and the prefix cache empties (with KV tiers, its blocks are stored down to them
        first, so after waking those prefixes load back)."""
        if level not in (1, 2):
            raise ParamError("sleep level must be 1 or 2", "level")
        if self.asleep:
            return {}
        if self.scheduler.has_unfinished_requests():
            raise ParamError("requests are running; sleep when the engine is idle", "sleep")
        batches = self.drain(executor)
        self._run_control_step(executor, self._sleep_step(level))
        self.sleeping = set(SLEEP_TAGS)
        self.stats.status.asleep = True
        return batches

    def wake_up(self, executor: Executor, tags: Sequence[str] | None = None) -> None:
        """The executor restores the parts named (vLLM's tags: "weights", "kv_cache"; None:
        both); idempotent. The engine serves again once both are back."""
        tags = list(SLEEP_TAGS) if not tags else list(tags)
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise ParamError(f"unknown wake_up tags {unknown}: use {list(SLEEP_TAGS)}", "tags")
        waking = [t for t in SLEEP_TAGS if t in tags and t in self.sleeping]
        if not waking:
            return
        self._run_control_step(executor, control_step(wake_up=waking))
        self.sleeping -= set(waking)
        self.stats.status.asleep = self.asleep

    def _run_control_step(self, executor: Executor, step: SchedulerOutput) -> None:
        """Run a step no request is in (nothing else is out) and wait for its empty answer."""
        assert not self._in_flight
        executor.submit(step)
        if executor.poll(None) is None:
            raise ExecutorTimeout("the executor did not answer a control step")

    # ---- prefix cache reset ----------------------------------------------------------------
    def reset_prefix_cache(
        self, executor: Executor, tiers: bool = False
    ) -> tuple[PrefixCacheReset, DetokenizerBatches]:
        """vLLM's reset_prefix_cache, while serving: every pin is released and every cached
        block no request holds is forgotten (running requests keep theirs and are not
        disturbed: only the core's bookkeeping changes). With `tiers`, the cpu and disk KV
        tiers are emptied too: the steps in flight are collected first (their outputs
        returned), so the drops follow every load and store those carry, and one step with
        no request carries the drops (asleep, they wait for the first step after waking).
        Returns the counts (`reply_to` 0: the caller's to fill in)."""
        batches: DetokenizerBatches = {}
        clear_tiers = tiers and self.kv_connector is not None
        if clear_tiers:
            batches = self.drain(executor)
        reset = PrefixCacheReset(0, self.block_manager.drop_cached())
        if clear_tiers:
            assert self.kv_connector is not None
            reset.tier_blocks_dropped = self.kv_connector.clear_stored_tiers()
            transfers = self.kv_connector.take_transfers() if not self.asleep else None
            if transfers is not None:
                self._run_control_step(executor, control_step(kv_transfers=transfers))
        return reset, batches

    # ---- steps -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """The next step for the executor, or None when it would carry nothing."""
        start = time.perf_counter()
        step = self.scheduler.schedule()
        self.stats.steps.core_schedule_s += time.perf_counter() - start
        if not (
            step.total_num_scheduled_tokens
            or step.finished_req_ids
            or step.forked_requests
            or step.blocks_to_copy
            or step.beam_tokens  # (taken from the scheduler: this step must carry them)
            or step.kv_transfers
        ):
            return None
        step.after_no_work, self._idle = self._idle, False
        self._in_flight.append(step)
        return step

    def update(self, output: ModelRunnerOutput) -> DetokenizerBatches:
        """Apply the executor's answer to the oldest step in flight; returns what each
        detokenizer worker must be sent."""
        start = time.perf_counter()
        step = self._in_flight.popleft()
        assert output.step_id == step.step_id, "the executor answers steps in order"
        outputs = self.scheduler.update_from_output(step, output)
        batches: DetokenizerBatches = {}
        for out in outputs:
            batch = self._batch_for(batches, out.req_id)
            announce = self._unannounced.pop(out.req_id, None)
            if announce is not None:
                batch.new_requests.append(announce)
            batch.outputs.append(out)
        self._count_step(output, outputs)
        self._note_if_idle()
        self.stats.steps.core_output_s += time.perf_counter() - start
        return batches

    def _sleep_step(self, level: int) -> SchedulerOutput:
        """The step that puts the executor to sleep, emptying the prefix cache first."""
        transfers = None
        if self.kv_connector is not None:
            self.kv_connector.evicted(self.block_manager.evict_cached())
            transfers = self.kv_connector.take_transfers()
        self.block_manager.reset_prefix_cache()
        return control_step(sleep_level=level, kv_transfers=transfers)

    def heartbeat(self) -> EngineStats:
        """The stats struct with its gauges read now (safe to call from another thread:
        it only reads the scheduler's state)."""
        s, bm, sched = self.stats, self.block_manager, self.scheduler
        s.status.time = time.time()
        load = s.load
        load.num_running, load.num_waiting = sched.num_running, sched.num_waiting
        load.num_preemptions = sched.num_preemptions
        pool = s.kv_pool
        pool.usage, pool.num_free_blocks = bm.usage, bm.num_free_blocks
        pool.block_states, pool.blocks_per_cell = bm.block_states()
        s.prefix_cache.queries = bm.prefix_cache_queries
        s.prefix_cache.hits = bm.prefix_cache_hits
        if self.config.speculative is not None:
            s.spec = sched.spec.stats()
        if self.config.lora is not None:
            running, waiting = sched.lora_adapters()
            s.lora = LoRAStats(running, waiting, self.config.lora.max_loras)
        if self.kv_connector is not None:
            s.kv_tiers = self.kv_connector.stats()
        s.kv_transfer = sched.kv.transfer_stats()
        s.pins = PinStats(len(bm.pins), bm.pins.max_blocks)
        s.tenants = sched.tenant_stats()
        pins = CacheSize("core", "prefix_pins", len(bm.pins), bm.pins.max_blocks)
        s.caches = [sched.tenants.cache_size(), pins, *self._executor_caches]
        return s

    # ---- internals -------------------------------------------------------------------------
    def _cache_pin(self, request: EngineCoreRequest) -> CachePin | None:
        """The request's pin with its token count resolved (the whole prompt unless the
        tokenizer said less); None when pinning is off (the request is served unpinned)."""
        pin = request.options.cache_pin
        if pin is None or not self.block_manager.pins.max_blocks:
            return None
        num_prompt = len(request.prompt_token_ids)
        num_tokens = num_prompt if pin.num_tokens < 0 else min(pin.num_tokens, num_prompt)
        return CachePin(ttl_s=pin.ttl_s, num_tokens=num_tokens)

    def _batch_for(self, batches: DetokenizerBatches, req_id: str) -> DetokenizerBatch:
        worker = detokenizer_index(req_id, self.num_detokenizers)
        batch = batches.get(worker)
        if batch is None:
            batch = batches[worker] = DetokenizerBatch()
        return batch

    def _count_step(self, output: ModelRunnerOutput, outputs: list[EngineCoreOutput]) -> None:
        s = self.stats
        s.tokens.generated += sum(len(o.new_token_ids) for o in outputs)
        steps = s.steps
        steps.count += 1
        steps.executor_busy_s += output.exec_time_s
        steps.executor_idle_s += output.idle_time_s
        steps.executor_prepare_s += output.prepare_time_s
        steps.executor_forward_s += output.forward_time_s
        steps.executor_sample_s += output.sample_time_s
        steps.gpu_idle_s += output.gpu_idle_time_s
        steps.overlapped += output.overlapped
        if output.stage_idle_s and s.stages is not None:
            # (A new section: the heartbeat thread may be encoding the old one.)
            s.stages = StageStats(
                _add(s.stages.idle_s, output.stage_idle_s),
                _add(s.stages.busy_s, output.stage_busy_s),
            )
        if output.cache_sizes is not None:
            self._executor_caches = output.cache_sizes
        allocated, used = self.scheduler.kv_slot_usage()
        s.kv_pool.slots_allocated += allocated
        s.kv_pool.slots_used += used

    def _note_if_idle(self) -> None:
        if not self._in_flight and not self.scheduler.has_unfinished_requests():
            self._idle = True


def max_pinned_blocks(config: EngineConfig) -> int:
    """--max-pinned-bytes in blocks; by default a tenth of the pool."""
    num_blocks = config.cache.num_blocks or 0
    limit = config.cache.max_pinned_bytes
    if limit is None:
        return num_blocks // 10
    return min(num_blocks, limit // block_bytes(config))


def _make_kv_connector(config: EngineConfig) -> TieredKVConnector | None:
    """The KV tiers' index, the disk tier's seeded from what its directory already holds,
    and a disaggregation consumer's remote buffer."""
    offload = config.kv_offload if config.kv_offload and config.kv_offload.enabled else None
    transfer = config.kv_transfer
    remote_bytes = transfer.buffer_bytes if transfer is not None and transfer.consumes else 0
    if offload is None and not remote_bytes:
        return None
    on_disk = blocks_on_every_rank(config) if offload and offload.disk_dir else []
    return TieredKVConnector(offload, block_bytes(config), on_disk, remote_bytes, config.world_size)


def _merge_batch(batches: DetokenizerBatches, worker: int, batch: DetokenizerBatch) -> None:
    """Add one step's batch for `worker` to those of earlier steps (in order)."""
    into = batches.get(worker)
    if into is None:
        batches[worker] = batch
        return
    into.new_requests += batch.new_requests
    into.outputs += batch.outputs
    into.aborted += batch.aborted


def _add(totals: list[float], values: list[float]) -> list[float]:
    """Per-stage sums: `totals` plus `values`."""
    return [t + v for t, v in zip(totals, values, strict=True)]
