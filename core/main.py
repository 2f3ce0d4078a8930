"""The core process (`zllm: core`): sockets and threads around one `EngineCore`.

    tokenizers, frontend, detokenizers, supervisor ──► [PULL core_in] ─ input thread ─► queue
                                                                                          │
    main loop:  apply inputs ─► EngineCore.step(SocketExecutor) ─► publish                │
                  ▲   (schedules step N+1 while the executor runs step N;      ◄──────────┘
                  │    waits at most 10 ms for an output)
                  └─────────── [PUSH executor_in]   [PULL executor_out]
    DetokenizerBatch ──► [PUSH detokenizer_in[i]]   (one message per worker per step)
    RequestRejected  ──► [PUSH frontend_in]
    heartbeat thread: EngineStats every 0.5 s ──► frontend_in and supervisor_in
    with --data-parallel-size > 1, the same thread also publishes [PUB events]: the heartbeat
    and the prefix cache's KVCacheEvents (queued by the main loop), for the tokenizer workers'
    routing

Every rule (checks, the step loop and how many steps are out, announcing requests to
detokenizers, aborts, sleep mode, statistics) lives in `EngineCore`; this file only moves
messages.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import msgspec
import zmq

from zllm.config.engine import sleep_refusal
from zllm.config.serve import ServeConfig
from zllm.core.engine_core import DetokenizerBatches, EngineCore
from zllm.core.executors import ExecutorTimeout, SocketExecutor
from zllm.errors import ParamError
from zllm.protocol import (
    AbortRequests,
    ClientGone,
    CoreInput,
    DetokenizerBatch,
    EngineCoreRequest,
    EngineStats,
    FinishSequence,
    KVBlocksReceived,
    KVCacheEvents,
    ProcessRole,
    RequestRejected,
    ResetPrefixCache,
    SleepControl,
    SleepReply,
    SpecDecodeStats,
)
from zllm.runtime.messaging import receive, send_nowait
from zllm.runtime.procutil import report_ready, start_process

logger = logging.getLogger("zllm.core")

HEARTBEAT_INTERVAL_S = 0.5
LOG_STATS_INTERVAL_S = 10.0
# How often the main loop takes in new inputs while it waits for a step (seconds).
INPUT_POLL_S = 0.01


class CoreProcess:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.engine = EngineCore(config.engine, config.detokenizer_workers)
        self.engine.stats.status.engine_index = config.engine_index
        self.inputs: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self.encoder = msgspec.msgpack.Encoder()
        # Data parallel: the prefix cache's changes, for the heartbeat thread to publish.
        self.kv_events: queue.SimpleQueue[KVCacheEvents] | None = None
        if config.data_parallel_size > 1:
            self.kv_events = queue.SimpleQueue()
            self.engine.block_manager.record_kv_events()
        ctx = zmq.Context.instance()
        ep = config.engine_endpoints
        self.executor = SocketExecutor(
            ctx, ep.executor_in, ep.executor_out, config.executor_timeout
        )
        self.to_detokenizers = []
        for addr in config.endpoints.detokenizer_in:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(addr)
            self.to_detokenizers.append(sock)
        self.to_frontend = ctx.socket(zmq.PUSH)
        self.to_frontend.connect(config.endpoints.frontend_in)

    # ---- threads -------------------------------------------------------------------------
    def start_threads(self) -> None:
        threading.Thread(target=self._input_loop, name="core-input", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="core-heartbeat", daemon=True).start()

    def _input_loop(self) -> None:
        """Receive and decode here (ZeroMQ releases the GIL while waiting)."""
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.bind(self.config.engine_endpoints.core_in)
        for msg in receive(sock, msgspec.msgpack.Decoder(CoreInput), logger):
            self.inputs.put(msg)

    def _heartbeat_loop(self) -> None:
        """The engine's stats every HEARTBEAT_INTERVAL_S, whatever a step costs: the frontend
        reads them (metrics, /health), the supervisor watches for them (a hung core). With
        several engines, the tokenizer workers get them too (each engine's load), and the
        KV cache events as they come."""
        ctx = zmq.Context.instance()
        targets = []
        for addr in (self.config.endpoints.frontend_in, self.config.endpoints.supervisor_in):
            sock = ctx.socket(zmq.PUSH)
            sock.connect(addr)
            targets.append(sock)
        publisher = None
        if self.kv_events is not None:
            publisher = ctx.socket(zmq.PUB)
            publisher.bind(self.config.engine_endpoints.events)
            # A restarted engine's cache is empty: the tokenizers forget what it held.
            self.kv_events.put(KVCacheEvents(self.config.engine_index, cleared=True))
        encoder = msgspec.msgpack.Encoder()
        stats_log = StatsLog()
        next_beat = time.monotonic()
        while True:
            if publisher is not None and self._publish_events(publisher, encoder, next_beat):
                continue
            time.sleep(max(0.0, next_beat - time.monotonic()))
            next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
            stats = self.engine.heartbeat()
            data = encoder.encode(stats)
            for sock in targets:
                try:
                    sock.send(data, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # that receiver is restarting; the next beat will do
            if publisher is not None:
                publisher.send(data)  # PUB never blocks: a slow subscriber loses messages
            if not self.config.disable_log_stats:
                stats_log.maybe_log(stats)

    def _publish_events(
        self, publisher: zmq.Socket, encoder: msgspec.msgpack.Encoder, until: float
    ) -> bool:
        """Publish the next KV cache events the main loop queued, waiting for them until
        `until` (the next heartbeat); False when none came."""
        assert self.kv_events is not None
        try:
            events = self.kv_events.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            return False
        publisher.send(encoder.encode(events))
        return True

    def _queue_kv_events(self) -> None:
        """Data parallel: hand the prefix cache's changes since the last call to the
        heartbeat thread (which owns the PUB socket: ZeroMQ sockets are single-threaded)."""
        if self.kv_events is None:
            return
        stored, removed, cleared = self.engine.block_manager.take_kv_events()
        if stored or removed or cleared:
            engine = self.config.engine_index
            self.kv_events.put(KVCacheEvents(engine, stored, removed, cleared))

    # ---- the main loop -------------------------------------------------------------------
    def run(self) -> None:
        # Any detokenizer state from before a restart belongs to requests failed upstream.
        reset = DetokenizerBatch(reset=True, engine=self.config.engine_index)
        for sock in self.to_detokenizers:
            send_nowait(sock, self.encoder, reset, logger)
        try:
            self._loop()
        except ExecutorTimeout as e:
            # A stuck executor is as bad as a dead one: exit, and the supervisor fails what
            # was in flight and restarts the engine.
            logger.error("%s: treating the executor as dead", e)
            os._exit(3)

    def _loop(self) -> None:
        """Inputs, then one turn of `EngineCore.step`, forever. With steps out, the turn waits
        at most INPUT_POLL_S for an output, so new requests and aborts are taken in while a
        long step runs (the heartbeat's waiting count, metrics and the data-parallel
        router's load, hold what arrived during it). With nothing out, the engine is idle or
        stalled (say, a request waiting for KV blocks from a prefill instance): only an input
        changes that, so the loop waits for one instead of spinning."""
        engine = self.engine
        while True:
            self._apply_inputs(block=not engine.num_steps_in_flight)
            batches = engine.step(self.executor, INPUT_POLL_S)
            self._queue_kv_events()  # blocks are cached as they are allocated
            if batches is not None:
                self._publish(batches)

    def _apply_inputs(self, block: bool) -> None:
        """Everything queued; when `block`, first wait (briefly) for something to arrive."""
        try:
            msg = self.inputs.get(timeout=0.5) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(msg)
            try:
                msg = self.inputs.get_nowait()
            except queue.Empty:
                return

    def _apply(self, msg: CoreInput) -> None:
        engine = self.engine
        if isinstance(msg, EngineCoreRequest):
            if engine.asleep:
                message = "the engine is asleep (POST /wake_up first)"
                rejected: RequestRejected | None = RequestRejected(msg.req_id, message, 503)
            else:
                rejected = engine.add_request(msg)
            if rejected is not None:
                send_nowait(self.to_frontend, self.encoder, rejected, logger)
        elif isinstance(msg, SleepControl):
            ok, message = self._sleep_control(msg)
            reply = SleepReply(msg.reply_to, ok, engine.asleep, message)
            send_nowait(self.to_frontend, self.encoder, reply, logger)
        elif isinstance(msg, ResetPrefixCache):
            reset, batches = engine.reset_prefix_cache(self.executor, msg.tiers)
            self._publish(batches)
            reset.reply_to = msg.reply_to
            send_nowait(self.to_frontend, self.encoder, reset, logger)
            logger.info(
                "prefix cache reset: %d cached blocks dropped%s",
                reset.blocks_dropped,
                f", tiers' blocks {reset.tier_blocks_dropped}" if msg.tiers else "",
            )
        elif isinstance(msg, AbortRequests):
            self._publish(engine.abort(msg.req_ids))
        elif isinstance(msg, FinishSequence):
            engine.finish_sample(msg.req_id, msg.sample_index)
        elif isinstance(msg, KVBlocksReceived):
            engine.kv_received(msg.stored, msg.removed, msg.rank)
            if msg.rejected:
                engine.kv_rejected(msg.rejected, msg.rejection)
        elif isinstance(msg, ClientGone):
            batches = engine.client_gone(msg.client_id)
            logger.warning(
                "client %d is gone: aborted its %d request(s)",
                msg.client_id,
                sum(len(b.aborted) for b in batches.values()),
            )
            self._publish(batches)

    def _sleep_control(self, msg: SleepControl) -> tuple[bool, str]:
        """Sleep mode's calls, with EngineCore's rules (both idempotent)."""
        refusal = sleep_refusal(self.config.engine)
        if refusal is not None:
            return False, refusal
        try:
            if msg.command == "sleep":
                self._publish(self.engine.sleep(self.executor, msg.level))
            elif msg.command == "wake_up":
                self.engine.wake_up(self.executor, msg.tags)
            else:
                return False, f"unknown command {msg.command!r}"
        except ParamError as e:
            return False, str(e)
        logger.info("engine %s", "asleep" if self.engine.asleep else "awake")
        return True, ""

    def _publish(self, batches: DetokenizerBatches) -> None:
        for worker, batch in batches.items():
            batch.engine = self.config.engine_index
            send_nowait(self.to_detokenizers[worker], self.encoder, batch, logger)


class StatsLog:
    """vLLM's periodic stats line, every LOG_STATS_INTERVAL_S while there is work."""

    def __init__(self) -> None:
        self.last_time = time.monotonic()
        self.last = (0, 0, 0)  # prompt tokens, generation tokens, steps at the last line
        # The speculative decoding section at the last line.
        self.last_spec = SpecDecodeStats()

    def maybe_log(self, s: EngineStats) -> None:
        now = time.monotonic()
        elapsed = now - self.last_time
        if elapsed < LOG_STATS_INTERVAL_S:
            return
        prompt, generation, steps = self.last
        tokens, load, prefix = s.tokens, s.load, s.prefix_cache
        hit_rate = prefix.hits / prefix.queries if prefix.queries else 0.0
        if s.steps.count != steps or load.num_running or load.num_waiting:
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                (tokens.prompt - prompt) / elapsed,
                (tokens.generated - generation) / elapsed,
                load.num_running,
                load.num_waiting,
                100 * s.kv_pool.usage,
                100 * hit_rate,
            )
        if s.spec is not None and s.spec.num_drafts != self.last_spec.num_drafts:
            self._log_spec_decode(s.spec, elapsed)
            self.last_spec = s.spec
        self.last_time = now
        self.last = (tokens.prompt, tokens.generated, s.steps.count)

    def _log_spec_decode(self, spec: SpecDecodeStats, elapsed: float) -> None:
        """vLLM's SpecDecoding line, over the interval since the last line."""
        last = self.last_spec
        drafts = spec.num_drafts - last.num_drafts
        proposed = spec.num_draft_tokens - last.num_draft_tokens
        accepted = spec.num_accepted_tokens - last.num_accepted_tokens
        before = last.accepted_per_pos
        per_pos = [
            (now - (before[i] if i < len(before) else 0)) / drafts
            for i, now in enumerate(spec.accepted_per_pos)
        ]
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + accepted / drafts,
            accepted / elapsed,
            proposed / elapsed,
            accepted,
            proposed,
            ", ".join(f"{rate:.3f}" for rate in per_pos),
            100 * accepted / proposed if proposed else 0.0,
        )


def main() -> None:
    config = start_process(ProcessRole.CORE)
    engine = config.engine
    logger.info(
        "scheduler: %d KV blocks of %d tokens, max_num_seqs=%d, max_num_batched_tokens=%d",
        engine.cache.num_blocks,
        engine.cache.block_size,
        engine.scheduler.max_num_seqs,
        engine.scheduler.max_num_batched_tokens,
    )
    core = CoreProcess(config)
    core.start_threads()
    report_ready(config, ProcessRole.CORE)
    core.run()


if __name__ == "__main__":
    main()
