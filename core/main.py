"""The core process: owns the scheduler and block manager and drives the executor.

    tokenizers, frontend, detokenizers ──► [PULL core_in] ─ input thread ─► queue
                                                                             │
    main loop:  apply inputs ─► schedule step N+1 ─► send ─► wait for step N ─► publish
                                    │  (while the executor runs step N)         │
                                    └──► [PUSH executor_in]    [PULL executor_out]
    outputs ──► [PUSH detokenizer_in[hash(req_id) % M]]   (one message per worker per step)
    heartbeat thread ──► [PUSH frontend_in] EngineStatus every 0.5 s, whatever a step costs

At most two steps are in flight: the executor always has the next one queued when it
finishes the current one, and the core does its bookkeeping while the executor computes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from zllm.config import EngineConfig
from zllm.core.engine_core import EngineCore
from zllm.core.request import Request
from zllm.procutil import report_ready, start_process
from zllm.protocol import (
    AbortRequests,
    CoreInput,
    DetokenizerBatch,
    DetokRequest,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStatus,
    FinishReason,
    FinishSequence,
    ModelRunnerOutput,
    RequestError,
    SchedulerOutput,
)
from zllm.serve_config import ServeConfig, detokenizer_index

logger = logging.getLogger("zllm.core")

MAX_STEPS_IN_FLIGHT = 2
HEARTBEAT_INTERVAL_S = 0.5
LOG_STATS_INTERVAL_S = 10.0
PROMPT_TAIL = 6  # prompt tokens a detokenizer needs to decode the first output correctly


class CoreProcess:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.engine = EngineCore(config.engine, executor=None)  # type: ignore[arg-type]
        self.scheduler = self.engine.scheduler
        self.num_detokenizers = config.detokenizer_workers
        self.inputs: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight: deque[SchedulerOutput] = deque()
        # Sent to a detokenizer with a request's first output, then dropped.
        self.unannounced: dict[str, DetokRequest] = {}
        self.stats = EngineStatus(time=time.time(), num_blocks=config.engine.cache.num_blocks or 0)
        self._last_block_snapshot = 0.0
        self._last_log = time.monotonic()
        self._logged = (0, 0, 0)  # prompt tokens, generation tokens, steps at the last log
        self.encoder = msgspec.msgpack.Encoder()

        ctx = zmq.Context.instance()
        ep = config.endpoints
        self.to_executor = ctx.socket(zmq.PUSH)
        self.to_executor.connect(ep.executor_in)
        self.from_executor = ctx.socket(zmq.PULL)
        self.from_executor.connect(ep.executor_out)
        self.to_detokenizers = []
        for addr in ep.detokenizer_in:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(addr)
            self.to_detokenizers.append(sock)
        self.to_frontend = ctx.socket(zmq.PUSH)
        self.to_frontend.connect(ep.frontend_in)
        self.runner_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)

    # ---- threads -------------------------------------------------------------------------
    def start_threads(self) -> None:
        threading.Thread(target=self._input_loop, name="core-input", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="core-heartbeat", daemon=True).start()

    def _input_loop(self) -> None:
        """Receive and decode in this thread (ZeroMQ releases the GIL while waiting)."""
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.bind(self.config.endpoints.core_in)
        decoder = msgspec.msgpack.Decoder(CoreInput)
        while True:
            data = sock.recv()
            try:
                self.inputs.put(decoder.decode(data))
            except msgspec.DecodeError as e:
                logger.error("dropping a malformed message (%d bytes): %s", len(data), e)

    def _heartbeat_loop(self) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(self.config.endpoints.frontend_in)
        encoder = msgspec.msgpack.Encoder()
        while True:
            self.stats.time = time.time()
            sock.send(encoder.encode(self.stats))
            time.sleep(HEARTBEAT_INTERVAL_S)

    # ---- the main loop -------------------------------------------------------------------
    def run(self) -> None:
        self._refresh_stats()  # the first heartbeat already shows the (empty) pool
        # Any detokenizer state from before a restart belongs to requests failed upstream.
        for sock in self.to_detokenizers:
            self._send(sock, DetokenizerBatch(new_requests=[], outputs=[], reset=True))
        no_work = True
        while True:
            idle = not self.in_flight and not self.scheduler.has_unfinished_requests()
            no_work = no_work or idle
            self._apply_inputs(block=idle)
            if (
                len(self.in_flight) < MAX_STEPS_IN_FLIGHT
                and self.scheduler.has_unfinished_requests()
            ):
                schedule_start = time.perf_counter()
                step = self.scheduler.schedule()
                self.stats.core_schedule_s += time.perf_counter() - schedule_start
                if self._worth_sending(step):
                    step.after_no_work, no_work = no_work, False
                    self.to_executor.send(self.encoder.encode(step))
                    self.in_flight.append(step)
                    continue  # schedule the next step right away, while this one runs
            if self.in_flight:
                self._collect_step()

    @staticmethod
    def _worth_sending(step: SchedulerOutput) -> bool:
        return bool(
            step.total_num_scheduled_tokens
            or step.finished_req_ids
            or step.forked_requests
            or step.blocks_to_copy
        )

    def _collect_step(self) -> None:
        if not self.from_executor.poll(int(self.config.executor_timeout * 1000)):
            # A stuck executor is as bad as a dead one: exit, and the supervisor fails what
            # was in flight and restarts the engine.
            logger.error(
                "no step finished for %.0f s with work pending: treating the executor as dead",
                self.config.executor_timeout,
            )
            os._exit(3)
        data = self.from_executor.recv()
        output_start = time.perf_counter()
        output = self.runner_decoder.decode(data)
        step = self.in_flight.popleft()
        outputs = self.scheduler.update_from_output(step, output)
        self._publish(outputs)
        s = self.stats
        s.core_output_s += time.perf_counter() - output_start
        s.executor_prepare_s += output.prepare_time_s
        s.executor_forward_s += output.forward_time_s
        s.executor_sample_s += output.sample_time_s
        s.num_generation_tokens += sum(len(o.new_token_ids) for o in outputs)
        s.num_steps += 1
        s.executor_busy_s += output.exec_time_s
        s.executor_idle_s += output.idle_time_s
        self._refresh_stats()

    # ---- inputs --------------------------------------------------------------------------
    def _apply_inputs(self, block: bool) -> None:
        try:
            msg = self.inputs.get(timeout=0.5) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(msg)
            try:
                msg = self.inputs.get_nowait()
            except queue.Empty:
                self._refresh_stats()
                return

    def _apply(self, msg) -> None:
        if isinstance(msg, EngineCoreRequest):
            self._add_request(msg)
        elif isinstance(msg, AbortRequests):
            for req_id in self.scheduler.abort_requests(msg.req_ids):
                self._announce_abort(req_id)
        elif isinstance(msg, FinishSequence):
            self.scheduler.finish_sequence(msg.req_id, msg.sample_index, FinishReason.STOP)
            self._forget_if_done(msg.req_id)

    def _add_request(self, msg: EngineCoreRequest) -> None:
        if msg.req_id in self.unannounced or self.scheduler.is_known(msg.req_id):
            return  # a re-sent request (a tokenizer restarted): we have it already
        params = msg.sampling_params
        vocab = self.config.engine.arch.vocab_size
        bad = next((t for t in msg.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:  # tokenizers check too; the executor must never see one
            message = f"Token id {bad} is out of vocabulary range [0, {vocab})."
            self._send(self.to_frontend, RequestError(msg.req_id, message, 400, "prompt"))
            return
        try:
            self.scheduler.add_request(
                Request(
                    req_id=msg.req_id,
                    prompt_token_ids=list(msg.prompt_token_ids),
                    sampling_params=params,
                    eos_token_id=msg.eos_token_id,
                    arrival_time=msg.arrival_time or time.time(),
                )
            )
        except ValueError as e:
            self._send(self.to_frontend, RequestError(msg.req_id, str(e), 400, "prompt"))
            return
        self.stats.num_prompt_tokens += len(msg.prompt_token_ids)
        self.unannounced[msg.req_id] = DetokRequest(
            req_id=msg.req_id,
            prompt_tail=list(msg.prompt_token_ids[-PROMPT_TAIL:]),
            n=params.n,
            stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            want_logprobs=params.logprobs is not None or params.prompt_logprobs is not None,
        )

    # ---- outputs -------------------------------------------------------------------------
    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        if not outputs:
            return
        batches: dict[int, DetokenizerBatch] = {}
        for out in outputs:
            worker = detokenizer_index(out.req_id, self.num_detokenizers)
            batch = batches.get(worker)
            if batch is None:
                batch = batches[worker] = DetokenizerBatch(new_requests=[], outputs=[])
            announce = self.unannounced.pop(out.req_id, None)
            if announce is not None:
                batch.new_requests.append(announce)
            batch.outputs.append(out)
        for worker, batch in batches.items():
            self._send(self.to_detokenizers[worker], batch)

    def _announce_abort(self, req_id: str) -> None:
        """Tell the request's detokenizer it ended, so it drops its state."""
        if self.unannounced.pop(req_id, None) is not None:
            return  # no detokenizer ever heard of it
        out = EngineCoreOutput(
            req_id=req_id, sample_index=-1, new_token_ids=[], finish_reason=FinishReason.ABORT
        )
        worker = detokenizer_index(req_id, self.num_detokenizers)
        self._send(self.to_detokenizers[worker], DetokenizerBatch(new_requests=[], outputs=[out]))

    def _forget_if_done(self, req_id: str) -> None:
        if not self.scheduler.is_known(req_id):
            self.unannounced.pop(req_id, None)

    def _send(self, sock: zmq.Socket, msg) -> None:
        try:
            sock.send(self.encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            # The receiver is gone (restarting): its requests are failed upstream.
            logger.warning("dropping a %s: its receiver is not keeping up", type(msg).__name__)

    def _refresh_stats(self) -> None:
        """Update the snapshot the heartbeat thread sends (and log a stats line now and then)."""
        s = self.stats
        stats = self.engine.stats()
        s.num_running = stats.num_running
        s.num_waiting = stats.num_waiting
        s.kv_cache_usage = stats.kv_cache_usage
        s.num_preemptions = stats.num_preemptions
        s.prefix_cache_queries = stats.prefix_cache_queries
        s.prefix_cache_hits = stats.prefix_cache_hits
        s.num_free_blocks = stats.num_free_blocks
        now = time.monotonic()
        if now - self._last_block_snapshot >= HEARTBEAT_INTERVAL_S:
            self._last_block_snapshot = now
            s.block_states, s.blocks_per_cell = self.engine.block_manager.block_states()
        if not self.config.disable_log_stats and now - self._last_log >= LOG_STATS_INTERVAL_S:
            self._log_stats(now)

    def _log_stats(self, now: float) -> None:
        s, last = self.stats, self._logged
        elapsed = now - self._last_log
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        if s.num_steps != last[2] or s.num_running or s.num_waiting:
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                (s.num_prompt_tokens - last[0]) / elapsed,
                (s.num_generation_tokens - last[1]) / elapsed,
                s.num_running,
                s.num_waiting,
                100 * s.kv_cache_usage,
                100 * hit_rate,
            )
        self._last_log = now
        self._logged = (s.num_prompt_tokens, s.num_generation_tokens, s.num_steps)


def main() -> None:
    config = start_process("core")
    engine_config: EngineConfig = config.engine
    logger.info(
        "scheduler: %d KV blocks of %d tokens, max_num_seqs=%d, max_num_batched_tokens=%d",
        engine_config.cache.num_blocks,
        engine_config.cache.block_size,
        engine_config.scheduler.max_num_seqs,
        engine_config.scheduler.max_num_batched_tokens,
    )
    core = CoreProcess(config)
    core.start_threads()
    report_ready(config, "core")
    core.run()


if __name__ == "__main__":
    main()
