"""Continuous batching under one token budget per step.

There are no separate prefill and decode phases. Every request has `num_computed_tokens`
that catches up with `num_tokens` (prompt + output so far); each step gives each request
up to the budget's remaining tokens. A long prompt is therefore prefilled in chunks, and
decodes ride in the same step as prefills.

Order per step: running requests first (oldest first), then waiting ones (FIFO) while the
budget, `max_num_seqs` and the blocks last (an `n > 1` request counts its samples, which
fork after its prompt, and a beam search its beams: `Request.num_seqs_to_run`; one wider
than the whole batch runs alone). When blocks run out for a running request, the
newest running request is preempted: its blocks are freed and it goes back to the *front* of
the queue to be recomputed (its prefix is usually still in the prefix cache). Oldest-first
service plus front-of-queue requeueing means no request starves.

With `--scheduling-policy priority` "oldest" becomes "first in (priority, arrival) order"
(core/request_queue.py): running requests are served in it and the one preempted is the
lowest priority, the newest among equals. A request of higher priority waits for room like
any other. Under `fair`, which tenant is admitted next, which running requests yield to a
tenant below its share, and the running order are `FairShare`'s choices (core/fair_share.py).

`num_computed_tokens` advances when a step is *scheduled*, not when it returns, and a
request whose scheduled chunk reaches its end gets one pending token. So the core can
schedule step N+1 while the executor still runs step N: a request that samples in N is
scheduled in N+1 to compute that (not yet known) token, which the executor holds.

Speculative decoding (config.speculative; core/speculation.py): a request's next step
verifies the executor's proposals, and how many are accepted is known only when it returns,
so while speculation is on a request with a step in flight is *held* until then; the others
keep scheduling ahead.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from zllm.config.engine import SchedulerConfig, SpeculativeConfig
from zllm.config.kv_transfer import KVTransferConfig
from zllm.core.beam_search import BeamCoordinator
from zllm.core.fair_share import FairShare, TenantLedger
from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.connector import SchedulerConnector, TieredKVConnector
from zllm.core.kv.prefix_pins import pin_computed_prefix
from zllm.core.lora_batch import adapter_fits, adapter_names, running_adapters
from zllm.core.request import Request, RequestStatus, child_request_id
from zllm.core.request_queue import WaitingQueue
from zllm.core.sequences import SequenceTable
from zllm.core.speculation import Speculation
from zllm.core.step.outputs import embedding_output, error_output, rows, tokens_output
from zllm.core.step.plan import PrefixFound, StepPlan, find_prefix
from zllm.core.step.stopping import check_stop
from zllm.protocol import (
    EngineCoreOutput,
    FinishReason,
    ForkedRequestData,
    ModelRunnerOutput,
    SchedulerOutput,
    TenantStats,
)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        speculative: SpeculativeConfig | None = None,
        max_loras: int = 0,
        kv_connector: TieredKVConnector | None = None,
        kv_transfer: KVTransferConfig | None = None,
    ) -> None:
        """`max_loras`: the most distinct LoRA adapters in one step (0: LoRA off).
        `kv_connector`: the KV tiers below the pool (KV offload; a disaggregation consumer's
        remote buffer), if any. `kv_transfer`: this engine's part in disaggregation."""
        self.config = config
        self.kv = SchedulerConnector(
            block_manager, kv_connector, kv_transfer, config.pipeline_stages
        )
        self.max_loras = max_loras
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        # The longest sequence the KV pool can hold alone bounds the context length, so any
        # single request can always run once everything else is preempted.
        self.max_model_len = block_manager.longest_sequence(
            config.max_model_len, config.max_num_batched_tokens
        )
        self.seqs = SequenceTable()
        self.requests = self.seqs.requests  # sequence id -> sequence
        self.waiting = WaitingQueue(by_priority=config.orders_by_priority)
        self.running: list[Request] = []
        self._finished_req_ids: list[str] = []
        self._pending_forks: list[ForkedRequestData] = []
        self.beams = BeamCoordinator(self.is_taken, self._adopt, self._end)
        self._step_id = 0
        self.num_preemptions = 0
        # What each tenant was served (metrics, every policy), and the fair policy's choices.
        self.tenants = TenantLedger(config.tenant_weights)
        self.fair = (
            FairShare(self.tenants, config.max_num_seqs) if config.policy == "fair" else None
        )
        self.spec = Speculation(speculative)

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request that passed EngineCore's checks (its id is unused)."""
        self.seqs.add(req)
        self.tenants.arrive(req.tenant)
        self.waiting.add(req)
        if req.sampling_params.use_beam_search:
            self.beams.add(req, self.max_model_len)

    def abort_requests(self, client_req_ids: Iterable[str]) -> list[str]:
        """Drop requests wherever they are; idempotent. Returns the ids actually aborted."""
        aborted = []
        for client_req_id in client_req_ids:
            if not self.seqs.is_known(client_req_id):
                continue
            for req in self.seqs.of_client(client_req_id):
                self._end(req, FinishReason.ABORT)
            self.beams.drop(client_req_id)
            aborted.append(client_req_id)
        return aborted

    def finish_sequence(self, client_req_id: str, sample_index: int, reason: FinishReason) -> bool:
        """End one sample of a request (a stop string was found); the others go on."""
        for req in self.seqs.of_client(client_req_id):
            if req.sample_index == sample_index:
                self._end(req, reason)
                return True
        return False

    def is_known(self, client_req_id: str) -> bool:
        return self.seqs.is_known(client_req_id)

    def is_taken(self, req_id: str) -> bool:
        """Whether `req_id` names a request or one of its samples here."""
        return self.seqs.is_taken(req_id)

    def requests_of_client(self, client_id: int) -> list[str]:
        """The client request ids sent by one client process."""
        return self.seqs.client_requests_of(client_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_slot_usage(self) -> tuple[int, int]:
        """(KV slots allocated to running requests, slots holding computed tokens), counted
        in the first KV cache group (the full-attention one when the model has one)."""
        bm = self.block_manager
        allocated = sum(bm.num_held_blocks(r.req_id, group=0) for r in self.running)
        used = sum(r.num_computed_tokens for r in self.running)
        return allocated * self.block_size, used

    def tenant_stats(self) -> list[TenantStats]:
        """Per tenant, for the heartbeat thread (copies first, as in lora_adapters)."""
        return self.tenants.stats(list(self.running), list(self.waiting))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.block_manager.pins:
            self.block_manager.unpin_expired(time.monotonic())
        if self.fair is not None:
            self._preempt_for_fair_share()
            self.running.sort(key=self.fair.running_key)
        elif self.config.policy == "priority":
            # Highest priority first, so the request preempted when blocks run out (the last
            # one) is the lowest priority and the newest among equals.
            self.running.sort(key=lambda r: r.priority_key)
        plan = StepPlan(
            budget=self.config.max_num_batched_tokens,
            encoder_budget=self.config.max_num_encoder_tokens or None,
            speculate=self.spec.enabled_for(len(self.running)),
        )
        stages = self.config.pipeline_stages
        if stages > 1:
            # About a stage's share of the running requests per step: the next step takes
            # the others (these are held while in flight), so the stages' micro-batches
            # overlap instead of the whole batch going down the pipeline alone.
            plan.max_running = -(-len(self.running) // stages)
        preempted = self._schedule_running(plan)
        if not preempted:  # a step that had to preempt (the pool is full) admits nobody
            self._schedule_waiting(plan)
        return self._make_output(plan)

    def _preempt_for_fair_share(self) -> None:
        """Fair share: running requests of over-served tenants yield their slots (or blocks)
        to tenants below their share that have requests waiting."""
        assert self.fair is not None
        self.fair.begin_step(self.running, self.waiting)
        free_slots = self.config.max_num_seqs - self._seats_taken()
        bm = self.block_manager
        held = bm.num_held_blocks
        for victim in self.fair.victims(self.running, free_slots, held, bm.num_blocks):
            self.running.remove(victim)
            self._preempt(victim)

    def _schedule_running(self, plan: StepPlan) -> bool:
        """Running requests, oldest first; preempts the newest when blocks run out.
        Returns whether anything was preempted."""
        bm = self.block_manager
        preempted = False
        i = 0
        while i < len(self.running) and plan.budget > 0:
            if plan.max_running is not None and len(plan.scheduled) >= plan.max_running:
                break
            req = self.running[i]
            num_new = min(req.num_tokens_with_pending - req.num_computed_tokens, plan.budget)
            num_new = req.chunk_end(
                req.num_computed_tokens, num_new, plan.encoder_budget, plan.encoder_fresh
            )
            if num_new <= 0 or self._held(req, plan):
                # Everything known is computed and its next token is pending; or it is held
                # until its step in flight returns.
                i += 1
                continue
            drafts = self.spec.take_drafts(
                req, num_new, plan.budget, plan.speculate, self.max_model_len
            )
            moved = False  # whether a preemption may have moved req in self.running
            while not bm.allocate_slots(
                req.req_id,
                req.block_token_ids,
                req.num_computed_tokens,
                num_new + len(drafts) + self.spec.lookahead(plan.speculate),
            ):
                # Pinned prefixes yield before any running request is preempted (half of the
                # pins at a time, soonest to expire first); then a beam that only waits for
                # its siblings goes first, else the newest request.
                if bm.pins:
                    bm.release_pins(max(1, len(bm.pins) // 2))
                    continue
                victim = self.beams.idle_beam(self.running, plan.scheduled) or self.running[-1]
                self.running.remove(victim)
                self._preempt(victim)
                preempted = moved = True
                if victim is req:
                    return True  # it was the newest: nothing is left after it
            self._add_to_step(plan, req, num_new, drafts)
            # (a search of the list for every request would make a step quadratic in them)
            i = self.running.index(req) + 1 if moved else i + 1
        return preempted

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Waiting requests, FIFO: none jumps the queue, except that a preempted beam that
        has reported this round is passed over (it has nothing to compute until its siblings
        report), and so are a request whose LoRA adapter would be one more than --max-loras
        in the batch (as vLLM does: the requests behind it of adapters already running go
        ahead), a consumer's request waiting for its remote blocks, and one whose prefix
        loads in a step in flight (a prefetch)."""
        if not self.waiting:
            return  # (a decode-only step need not count the seats)
        bm = self.block_manager
        max_seqs = self.config.max_num_seqs
        seats = self._seats_taken()
        while self.waiting and plan.budget > 0 and seats < max_seqs:
            req = self._next_waiting()
            if req is None or self._held(req, plan):
                return  # (held: preempted with a step in flight, until that returns)
            need = req.num_seqs_to_run
            if seats and seats + need > max_seqs:
                return  # its samples would overfill the batch: it waits, first in line
            found = find_prefix(req, self.block_manager, self.kv)
            if self.kv.wants_prefetch(req, found.cached):
                # Its loads go out in a step of their own (core/kv/prefetch.py).
                if not (
                    self.kv.prefetch(req, found.cached, found.salt)
                    or self._make_room_for(req, plan)
                ):
                    return
                continue
            num_new = req.num_tokens_with_pending - found.num_tokens
            if num_new > plan.budget and not self.config.enable_chunked_prefill:
                return
            num_new = req.chunk_end(
                found.num_tokens, min(num_new, plan.budget), plan.encoder_budget, plan.encoder_fresh
            )
            if num_new <= 0:
                return  # its next image does not fit this step's budgets: it waits, first
            num_slots = found.num_loaded + num_new + self.spec.lookahead(plan.speculate)
            if not bm.allocate_slots(
                req.req_id,
                req.block_token_ids,
                found.num_computed,
                num_slots,
                found.cached,
                found.salt,
            ):
                if self._make_room_for(req, plan):
                    seats = self._seats_taken()  # (it may have preempted)
                    continue
                return
            self._admit(req, plan, found, num_new)
            seats += need

    def _seats_taken(self) -> int:
        """The running sequences, with the samples of those not yet forked: max_num_seqs
        bounds what the batch holds once they fork."""
        return sum(req.num_seqs_to_run for req in self.running)

    def _next_waiting(self) -> Request | None:
        adapters = running_adapters(self.running)
        candidates = (
            r
            for r in self.waiting
            if not self.beams.is_idle(r)
            and adapter_fits(r, adapters, self.max_loras)
            and not self.kv.awaits_remote_kv(r)
            and not self.kv.prefetching(r)
        )
        return self.fair.pick(candidates) if self.fair else next(candidates, None)

    def _make_room_for(self, req: Request, plan: StepPlan) -> bool:
        """Blocks ran out for `req`: free some if that is allowed (True: try again)."""
        idle = self.beams.idle_beam(self.running, plan.scheduled)
        if idle is not None:  # a beam that only waits for its siblings yields
            self.running.remove(idle)
            self._preempt(idle)
            return True
        if not self.running and self.block_manager.pins:
            self.block_manager.release_pins()  # the pool to itself would fit it: pins yield
            return True
        if self.fair is not None and self.fair.load.below_share(req.tenant):
            self.fair.blocked = req  # over-served tenants make room next step
        return False

    def _admit(self, req: Request, plan: StepPlan, found: PrefixFound, num_new: int) -> None:
        """`req` got its blocks: from the queue into the step."""
        self.waiting.remove(req)
        if self.fair is not None:
            self.fair.load.move(req.tenant, to_running=True)
        first = req.num_cached_tokens < 0
        self.kv.admitted(req, found.cached, found.load_tiers, first)
        if first:  # this is what the client sees
            req.num_cached_tokens = found.num_tokens
            req.first_scheduled_time = time.time()
            self.block_manager.record_prefix_query(req.num_tokens, found.num_pool_hit)
        req.num_computed_tokens = found.num_tokens
        if req.status == RequestStatus.PREEMPTED:
            plan.resumed.add(req.req_id)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._add_to_step(plan, req, num_new)

    def _held(self, req: Request, plan: StepPlan) -> bool:
        """Whether `req` waits for its step in flight before it is scheduled again: while
        speculating (how many proposals that step accepts is unknown), and with pipeline
        stages any step of it (the first stage needs the token it samples; a beam's report,
        prompt logprobs and a preempted request's recompute follow from it)."""
        if self.config.pipeline_stages > 1:
            return req.num_steps_in_flight > 0
        return bool(req.num_pending_tokens) and (plan.speculate or req.verifying)

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting requests (vllm:lora_requests_info).
        Called from the heartbeat thread: copies first (a deque refuses iteration while the
        main thread changes it; list() copies it in one go under the GIL)."""
        return adapter_names(list(self.running)), adapter_names(list(self.waiting))

    def _add_to_step(
        self, plan: StepPlan, req: Request, num_new: int, drafts: list[int] | None = None
    ) -> None:
        drafts = drafts or []
        num_drafts = len(drafts)
        # (a hybrid model's state snapshot for the prefix cache; nothing for other models)
        self.block_manager.save_state_at(
            req.req_id, req.num_prompt_tokens, req.num_computed_tokens, num_new
        )
        self.tenants.charge(req.tenant, plan.add(req, num_new, drafts))
        if req.cache_pin is not None and not req.pinned:
            pin_computed_prefix(req, self.block_manager)
        if req.sampling_params.embed or req.sampling_params.use_beam_search:
            # An embedding's answer is the pooled vector, a beam's next token is chosen by
            # its group once every beam has reported: nothing pending to decode.
            return
        if req.num_computed_tokens - num_drafts == req.num_tokens_with_pending:
            # This step samples the next token. An n > 1 request draws all n first tokens
            # from the one set of prompt logits, and is forked when they come back.
            if req.waits_to_fork and req.num_pending_tokens == 0:
                plan.num_samples[req.req_id] = req.sampling_params.n
            req.num_pending_tokens += 1

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, fork, and finish requests (those gone meanwhile are skipped)."""
        outputs: list[EngineCoreOutput] = []
        for req_id in sched_out.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is not None:
                req.num_steps_in_flight -= 1
        self.kv.load_failed(runner_out.kv_load_failed)
        self.kv.prefetched(sched_out.step_id, runner_out.kv_load_failed)
        for req_id, message in runner_out.failed.items():
            req = self.requests.get(req_id)
            if req is not None:
                outputs.extend(self._fail(req, message))
        for req_id, lp in runner_out.prompt_logprobs.items():
            req = self.requests.get(req_id)
            # (a chunk computed before the request was preempted: its recompute sends them)
            if req is not None and sched_out.step_id >= req.preempted_at_step:
                if req.prompt_logprobs is None:
                    req.prompt_logprobs = lp
                else:
                    req.prompt_logprobs.extend(lp)

        for req_id, vector in runner_out.pooled.items():
            req = self.requests.get(req_id)
            if req is not None:
                outputs.append(self._finish_embedding(req, vector))
        for idx, req_id in enumerate(runner_out.req_ids):
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.sampling_params.use_beam_search:
                assert runner_out.logprobs and runner_out.logprobs[idx] is not None
                outputs.extend(self.beams.report(req, runner_out.logprobs[idx]))
                continue
            req.num_pending_tokens -= 1
            tokens = runner_out.sampled_token_ids[idx]
            logprobs = runner_out.logprobs[idx] if runner_out.logprobs else None
            if req_id in sched_out.num_samples:
                assert len(tokens) == sched_out.num_samples[req_id], "one token per sample"
                outputs.extend(self._fork(req, tokens, logprobs))
                tokens, logprobs = tokens[:1], rows(logprobs, 0, 1)
            drafts = sched_out.spec_token_ids.get(req_id)
            if drafts:
                self.spec.count_verified(req, len(drafts), len(tokens) - 1)
            if runner_out.draft_token_ids and runner_out.draft_token_ids[idx]:
                req.spec_token_ids = runner_out.draft_token_ids[idx]
            outputs.append(self._append_and_check(req, tokens, logprobs))
        return outputs

    # ---- internals -------------------------------------------------------------------------
    def _append_and_check(self, req: Request, tokens: list[int], logprobs) -> EngineCoreOutput:
        """Append a step's tokens (several when proposals were accepted), one by one, up to
        the first that ends the request; the rest are dropped."""
        first = req.num_output_tokens == 0
        finished = False
        num_kept = 0
        for token_id in tokens:
            req.append_token(token_id)
            num_kept += 1
            finished = check_stop(req, self.max_model_len)
            if finished:
                break
        if logprobs is not None and num_kept < len(logprobs.ranks):
            logprobs = rows(logprobs, 0, num_kept)
        self.tenants[req.tenant].num_generation_tokens += num_kept
        out = tokens_output(req, tokens[:num_kept], logprobs, first)
        if finished:
            out.finish_reason = req.finish_reason
            out.stop_reason = req.stop_reason
            self._finish(req)
        return out

    def _finish_embedding(self, req: Request, vector: list[float]) -> EngineCoreOutput:
        out = embedding_output(req, vector)
        self._end(req, FinishReason.STOP)
        return out

    def _fail(self, req: Request, message: str) -> list[EngineCoreOutput]:
        """The executor could not run `req`: every sequence of its client request ends with
        finish reason "error" and the executor's message (the frontend answers 500)."""
        outputs = []
        for seq in self.seqs.of_client(req.client_req_id):
            seq.known_to_executor = False  # it holds no state for it
            seq.computed = False  # nor did it compute its blocks: they cache nothing
            outputs.append(error_output(seq, message))
            self._end(seq, FinishReason.ERROR)
        self.beams.drop(req.client_req_id)
        return outputs

    def _fork(self, parent: Request, tokens: list[int], logprobs) -> list[EngineCoreOutput]:
        """Split an `n > 1` request into its samples once its prompt is computed."""
        outputs = []
        for index in range(1, len(tokens)):
            # The fork happens right after the prompt; the parent may be a step ahead.
            child = parent.fork(
                child_request_id(parent.req_id, index, self.is_taken),
                sample_index=index,
                output_token_ids=[],
                num_computed_tokens=parent.num_prompt_tokens,
                status=RequestStatus.RUNNING,
            )
            child.prompt_logprobs = parent.prompt_logprobs
            self._adopt(parent, child)
            out = self._append_and_check(child, [tokens[index]], rows(logprobs, index, 1))
            if not child.is_finished:
                self._pending_forks.append(
                    ForkedRequestData(
                        req_id=child.req_id,
                        parent_req_id=parent.req_id,
                        sample_index=index,
                        first_token_id=tokens[index],
                        state_slot=self.block_manager.state_slot(child.req_id),
                    )
                )
                child.known_to_executor = True
                child.num_tokens_sent = child.num_tokens  # its first token: in the fork
            outputs.append(out)
        return outputs

    def _adopt(
        self, parent: Request, child: Request, fork: ForkedRequestData | None = None
    ) -> None:
        """A forked sequence joins its parent's client request: it shares the parent's
        blocks, or, when the parent was preempted while its step ran, recomputes too.
        `fork`: what tells the executor, if it is to know of the child now."""
        if fork is not None:
            self._pending_forks.append(fork)
        self.seqs.add_fork(child)
        # (a hybrid model's fork may find no state slot free: it recomputes, as below)
        if parent.status == RequestStatus.RUNNING and self.block_manager.fork(
            parent.req_id, child.req_id
        ):
            if fork is not None:
                fork.state_slot = self.block_manager.state_slot(child.req_id)
            self.running.append(child)
            return
        child.status = RequestStatus.PREEMPTED
        child.num_computed_tokens = 0
        self.waiting.add(child, front=True)

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        if not req.output_token_ids and not req.num_pending_tokens:
            # The prefill starts over, and so do its prompt logprobs: those of chunks still in
            # flight are stale (dropped when they come back). With its first token pending,
            # the step in flight finishes the prompt and its logprobs; the recompute, which
            # then has an output, sends none.
            req.prompt_logprobs = None
            req.preempted_at_step = self._step_id + 1  # the step being built
        self.num_preemptions += 1
        self.tenants[req.tenant].num_preemptions += 1
        if self.fair is not None:
            self.fair.load.move(req.tenant, to_running=False)
        self.waiting.add(req, front=True)

    def _end(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        self._finish(req)

    def _finish(self, req: Request) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.block_manager.free(req.req_id, keep_hashes=req.computed)
        if self.seqs.remove(req):
            self.tenants.depart(req.tenant)
        # A fork of this request not yet sent must not be sent.
        self._pending_forks = [f for f in self._pending_forks if f.req_id != req.req_id]
        self.beams.forget(req.req_id)
        if req.known_to_executor:
            self._finished_req_ids.append(req.req_id)

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        bm = self.block_manager
        changed = bm.take_changed_tables()
        kv_transfers = self.kv.take_transfers(self._step_id + 1)
        kv_sends, kv_send_engines = self.kv.sends(plan.scheduled)
        pipeline = self.config.pipeline_stages > 1
        new_reqs, cached_reqs = plan.request_data(bm, changed, pipeline)
        state_restores, state_saves = bm.take_state_work()
        self._step_id += 1
        out = SchedulerOutput(
            step_id=self._step_id,
            new_requests=new_reqs,
            cached_requests=cached_reqs,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            num_samples=plan.num_samples,
            beam_tokens=self.beams.take_tokens(),
            spec_token_ids=plan.spec_token_ids,
            speculate=plan.speculate,
            forked_requests=self._pending_forks,
            blocks_to_copy=bm.take_pending_copies(),
            state_restores=state_restores,
            state_saves=state_saves,
            finished_req_ids=self._finished_req_ids,
            kv_transfers=kv_transfers,
            kv_sends=kv_sends,
            kv_send_engines=kv_send_engines,
        )
        self._pending_forks = []
        self._finished_req_ids = []
        return out
