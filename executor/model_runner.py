"""Runs one scheduled step: flat batch in, sampled tokens out.

The runner keeps each request's state (tokens, block table, seeded generator) between steps,
so the core sends a request's full data once and afterwards only what changed. What it runs
the step on is the model host's (host/model_host.py: its weights, KV cache and decode path); how
it samples, the step sampler's (step_sampler.py, logits_processors.py, sampler.py); when the
host's parts release their memory, sleep mode's (host/sleep_mode.py).

    execute_model(so)   _update_states        forks, finished, new, cached, block copies
                        _transfer_kv          KV offload: drops, stores, loads
      prepare           prepare_inputs        StepInputs: flat token ids, positions, metadata
      forward           _forward              hidden states, one row per new token
      sample            StepSampler.sample    one token per sampler row
      pack              StepSampler.pack      ModelRunnerOutput, one entry per sampling request
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from zllm.config.engine import EngineConfig
from zllm.executor.graphs.fused_decode import FusedDecode
from zllm.executor.host.cpu_share import cpu_share_for
from zllm.executor.host.model_host import ModelHost
from zllm.executor.host.sleep_mode import SleepMode
from zllm.executor.kv.connector import KVTiers
from zllm.executor.launched_step import LaunchedStep, copy_to_host
from zllm.executor.lora.manager import LoRAManager
from zllm.executor.parallel.groups import ONE_RANK, Parallel
from zllm.executor.parallel.pipeline_stage import PipelineStage
from zllm.executor.pooling import pool_embeddings
from zllm.executor.requests.state import RequestState
from zllm.executor.requests.structured_output import GrammarCompiler
from zllm.executor.sample.rows import SampleRows
from zllm.executor.sample.step_sampler import StepSampler
from zllm.executor.step_inputs import StepInputs, prepare_inputs
from zllm.executor.step_timing import GpuIdleClock
from zllm.kv.cache_groups import KVCacheGroup
from zllm.protocol import SLEEP_TAGS, CacheSize, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from zllm.executor.graphs.decode import CudaGraphRunner

logger = logging.getLogger(__name__)


class ModelRunner:
    """Every request's state and one step over the model host: `execute_model`."""

    def __init__(self, config: EngineConfig, parallel: Parallel = ONE_RANK) -> None:
        """`parallel`: this process's place among the executor's ranks. Every rank runs every
        step on its part of the model (ModelHost). The last stage's ranks sample the same
        tokens from the same gathered logits; one of them answers the core
        (parallel.answers), and the earlier stages return no output."""
        self.config = config
        self.tp, self.pp = parallel.tp, parallel.pp
        # When the last step ended (a pipeline stage's idle time before the next).
        self._step_end = time.perf_counter()
        self.host = host = ModelHost(config, parallel)
        layout = host.layout
        self.sleep_mode = SleepMode(host.weights, host.kv, host.decode, layout.device, host.images)
        # Tensor parallel: unseeded rows draw from a generator of the runner's own, the same
        # on every rank (rank 0 of an offline engine shares torch's global one with the user).
        unseeded = (
            torch.Generator(device=layout.device).manual_seed(config.seed)
            if self.tp.enabled
            else None
        )
        self.sampling = StepSampler(
            host.weights.compute_logits, layout.arch.vocab_size, layout.device, unseeded
        )
        self.stage = (
            PipelineStage(self.pp, layout.arch.hidden_size, layout.dtype, layout.device)
            if self.pp.enabled
            else None
        )
        self.grammars = GrammarCompiler(config.tokenizer_path, layout.arch.vocab_size)
        self.requests: dict[str, RequestState] = {}
        self._gpu_clock = GpuIdleClock(layout.device)
        self._sent_cache_sizes: list[CacheSize] | None = None  # as the core last heard them
        self._cpu_share = cpu_share_for(
            str(layout.device), config.world_size, config.deterministic, torch.get_num_threads()
        )

    # ---- what the host holds (the interface ranks, LLM and the tests read) ---------------------
    @property
    def model(self) -> nn.Module:
        return self.host.weights.model

    @property
    def quantization(self) -> str:
        return self.host.weights.quantization

    @property
    def fused_decode(self) -> FusedDecode | None:
        return self.host.decode.fused

    @fused_decode.setter
    def fused_decode(self, fused: FusedDecode | None) -> None:
        self.host.decode.fused = fused  # (None: benchmarks time the module path)

    @property
    def graph_runner(self) -> CudaGraphRunner | None:
        return self.host.decode.graph_runner

    @property
    def lora(self) -> LoRAManager | None:
        return self.host.weights.lora

    @property
    def num_blocks(self) -> int:
        return self.host.kv.num_blocks

    @property
    def kv_groups(self) -> list[KVCacheGroup]:
        return self.host.layout.kv_groups

    @property
    def kv_tensors(self) -> list[torch.Tensor]:
        return self.host.kv.tensors

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.host.kv.caches

    @property
    def kv_tiers(self) -> KVTiers | None:
        return self.host.kv.tiers

    @property
    def asleep(self) -> bool:
        return self.sleep_mode.asleep

    # ---- sleep mode ----------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Release the KV pool, and at level 2 the weights (host/sleep_mode.py), keeping the
        config, the compiled grammars' tokenizer data and the sampler. The core calls it only
        when no request is unfinished; the states still here are of finished requests whose
        ids would come with the next step."""
        if self.asleep:
            return
        self.requests.clear()
        self.sampling.child_generators.clear()
        self.sleep_mode.sleep(level)

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """Restore the parts named: the weights, a fresh and empty KV pool, or both."""
        self.sleep_mode.wake_up(tags)

    # ---- state updates -------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> dict[str, str]:
        """Apply what changed since the last step, forks first (they copy their parent as of
        the step that sampled them). Returns the new requests that cannot run, with why;
        they get no state here, so later steps that still name them skip them."""
        state_pool = self.host.kv.state  # a hybrid model's recurrent-state slots
        for fork in so.forked_requests:
            generator = self.sampling.take_child_generator(fork.parent_req_id, fork.sample_index)
            parent = self.requests[fork.parent_req_id]
            child = parent.fork(fork, generator)
            if state_pool is not None and child.state_slot >= 0:
                state_pool.fork(parent.req_id, parent.state_slot, child.state_slot)
            self._attach_grammar(child)
            self.requests[fork.req_id] = child
        if state_pool is not None:  # (a parent's samples all fork in one step)
            for fork in so.forked_requests:
                state_pool.drop_stash(fork.parent_req_id)
        for req_id, token in so.beam_tokens.items():  # after the forks, which copy the beam
            self.requests[req_id].append(token)
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.sampling.forget(req_id)
            if state_pool is not None:
                state_pool.drop_stash(req_id)
        lora = self.host.weights.lora
        if lora is not None and so.finished_req_ids:
            lora.evict(st.lora_int_id for st in self.requests.values() if st.lora_int_id)
        failed = self._add_new_requests(so)
        for cached in so.cached_requests:
            state = self.requests.get(cached.req_id)
            if state is None:
                continue  # it failed; the core has not heard yet
            if not self.pp.is_last:  # the tokens the last stage sampled (its own are here)
                for token in cached.new_token_ids:
                    state.append(token)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.block_ids is not None:
                state.block_ids = list(cached.block_ids)
            if cached.state_slot >= 0:
                state.state_slot = cached.state_slot
            if cached.resumed:  # after a preemption: blocks past the prefix hit are new
                state.draft_num_computed = min(state.draft_num_computed, cached.num_computed_tokens)
                state.draft_tail = []
        for src, dst in so.blocks_to_copy:
            self.host.kv.copy_block(src, dst)
        for snapshot, slot in so.state_restores:  # a hybrid's prefix hits: their state
            assert state_pool is not None
            state_pool.restore_snapshot(snapshot, slot)
        return failed

    def _add_new_requests(self, so: SchedulerOutput) -> dict[str, str]:
        """A state for each new request; those whose LoRA adapter fails to load get none and
        are returned with why."""
        failed: dict[str, str] = {}
        for new in so.new_requests:
            if new.lora is not None:
                lora = self.host.weights.lora
                assert lora is not None, "the core refuses LoRA requests when LoRA is off"
                try:
                    lora.add(new.lora)
                except Exception as e:  # its files changed since they were checked
                    logger.error("Request %s fails: %s", new.req_id, e)
                    failed[new.req_id] = f"LoRA adapter {new.lora.lora_name!r}: {e}"
                    continue
            state = RequestState.from_new(new, self.host.layout.device)
            self._attach_grammar(state)
            self.requests[new.req_id] = state
        return failed

    def _attach_grammar(self, st: RequestState) -> None:
        """A structured-output request's matcher, fed the output it already has (a recomputed
        request after preemption, a forked sample's first token)."""
        params = st.sampling_params.structured_outputs
        if params is not None and self.pp.is_last:  # (earlier stages do not sample)
            st.grammar = self.grammars.matcher(params, st.eos_token_ids, st.output_token_ids)

    # ---- one step ------------------------------------------------------------------------------
    @property
    def can_overlap_steps(self) -> bool:
        """Whether steps may be launched over an unfinished one (async_steps.py): one rank
        (the ranks would have to agree on every overlap) and no speculation (a proposer reads
        each step's tokens on the host)."""
        return not self.tp.enabled and not self.pp.enabled and self.host.kv.proposer is None

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step, start to finish. A pipeline stage before the last runs its layers,
        passes them on, and returns None."""
        launched = self.launch(so)
        return None if launched is None else self.finish(launched)

    @torch.inference_mode()
    def launch(
        self, so: SchedulerOutput, pending: LaunchedStep | None = None
    ) -> LaunchedStep | None:
        """Apply the step's changes, build its inputs and queue its forward and sampling; on a
        GPU the sampled ids are then on their way to pinned host memory. `pending`: a step
        launched before and not finished yet (the asynchronous executor): tokens it sampled
        for this step's requests are read from the device. None: a pipeline stage before the
        last passed the step on.

        Timed in three parts (inputs, forward, logits + sampling + output) for /metrics; on a
        GPU the forward is only enqueued, so its time lands in finish's wait."""
        step_start = time.perf_counter()
        idle_s = 0.0 if so.after_no_work or pending is not None else step_start - self._step_end
        launched = LaunchedStep(so, step_start=step_start)
        try:
            return self._launch(launched, idle_s, pending)
        finally:
            self._step_end = time.perf_counter()

    def _share_the_cpu(self) -> None:
        """Run on the cores other programs leave free (executor/host/cpu_share.py)."""
        share = self._cpu_share
        threads = share.threads_now()
        if threads != torch.get_num_threads():
            logger.info(
                "other programs took %.1f of this executor's %d cores in the last second: "
                "%d thread(s) from now (was %d; at most %d)", share.others, len(share.cpus),
                threads, torch.get_num_threads(), share.max_threads,
            )  # fmt: skip
            torch.set_num_threads(threads)

    def _launch(
        self, launched: LaunchedStep, idle_s: float, pending: LaunchedStep | None
    ) -> LaunchedStep | None:
        so = launched.so
        if self.asleep:
            if so.total_num_scheduled_tokens or so.new_requests:
                raise RuntimeError("the engine is asleep: wake it up before running steps")
            launched.output = ModelRunnerOutput(
                step_id=so.step_id, req_ids=[], sampled_token_ids=[]
            )
            return launched
        launched.failed = self._update_states(so)
        scheduled, launched.load_failures = self._transfer_kv(so)
        if not any(req_id in self.requests for req_id in so.num_scheduled_tokens):
            if self.stage is not None:  # (a prefetch's loads: the failures go down alone)
                self.stage.pass_failures()
            if not self.pp.is_last:  # (every stage holds the same states: none runs it)
                return None
            launched.output = ModelRunnerOutput(
                step_id=so.step_id,
                req_ids=[],
                sampled_token_ids=[],
                failed=launched.failed,
                kv_load_failed=self._kv_load_failed(launched.load_failures),
            )
            return launched
        if self._cpu_share is not None:
            self._share_the_cpu()
        pending_tokens = None if pending is None else pending.pending_tokens()
        launched.inputs = inputs = prepare_inputs(
            self.host, self.requests, so, scheduled, pending_tokens
        )
        launched.forward_start = time.perf_counter()
        launched.gpu_start = self._gpu_clock.record()
        hidden, launched.stage_times = self._forward(inputs, idle_s, launched.step_start)
        self._stash_fork_states(so)
        if hidden is None:
            self._send_kv(so)  # this stage's layers' part of the blocks its forward wrote
            return None  # passed on to the next stage
        launched.forward_end = time.perf_counter()
        launched.prompt_logprobs = self.sampling.prompt_logprobs(inputs, hidden)
        launched.pooled = pool_embeddings(
            inputs, hidden, self.config.pooler, self._classifier_head()
        )
        launched.rows = rows = self.sampling.choose_rows(inputs, so)
        if rows.requests:
            sampled = self.sampling.sample(rows, hidden)
            launched.device_token_ids = sampled.sampled_token_ids
            launched.sampled = copy_to_host(sampled)
            for st in rows.requests:
                st.num_pending += 1  # until finish appends it
        # After the copies to the host: the step's end for the idle clock and for finish.
        launched.gpu_end = self._gpu_clock.record()
        launched.launched_end = time.perf_counter()
        return launched

    @torch.inference_mode()
    def finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's sampled ids on the host, append them to their requests
        and pack the step's output (proposals and KV sends after)."""
        try:
            output = self._finish(launched)
        finally:
            self._step_end = time.perf_counter()  # (a pipeline stage's idle time starts here)
        sizes = self.cache_sizes()
        if sizes != self._sent_cache_sizes:  # (a few ints: only news goes on the wire)
            output.cache_sizes = self._sent_cache_sizes = sizes
        return output

    def cache_sizes(self) -> list[CacheSize]:
        """The executor's bounded caches now: compiled grammars, loaded LoRA adapters, a
        vision model's encoded images (their count, and their bytes against the bound)."""
        sizes = [self.grammars.cache_size()]
        if self.lora is not None:
            live = (st.lora_int_id for st in self.requests.values() if st.lora_int_id)
            sizes.append(self.lora.cache_size(live))
        if self.host.images is not None:
            sizes.extend(self.host.images.cache.sizes())
        return sizes

    def _finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        if launched.output is not None:
            return launched.output
        finish_start = time.perf_counter()
        so, rows, inputs = launched.so, launched.rows, launched.inputs
        assert rows is not None and inputs is not None
        if launched.gpu_end is not None:
            launched.gpu_end.synchronize()
        for st in rows.requests:
            st.num_pending -= 1
        output = self.sampling.pack(so.step_id, rows, launched.sampled, launched.prompt_logprobs)
        output.gpu_idle_time_s = self._gpu_clock.idle_before(
            launched.gpu_start, launched.gpu_end, so.after_no_work
        )
        output.pooled = launched.pooled
        output.failed = launched.failed
        output.kv_load_failed = self._kv_load_failed(launched.load_failures)
        if self.host.kv.proposer is not None:
            output.draft_token_ids = self._propose(so, inputs, rows)
        # After the proposer, whose catch-up writes a draft model's part of the blocks.
        self._send_kv(so)
        output.prepare_time_s = launched.forward_start - launched.step_start
        output.forward_time_s = launched.forward_end - launched.forward_start
        # Sampling's launch and this finish; not the other steps launched in between.
        output.sample_time_s = (
            launched.launched_end - launched.forward_end + time.perf_counter() - finish_start
        )
        if launched.stage_times is not None:
            stage_times = launched.stage_times
            stage_times[-1, 1] += output.sample_time_s  # this stage's busy time: all of it
            output.stage_idle_s, output.stage_busy_s = stage_times.T.tolist()
        return output

    def _transfer_kv(
        self, so: SchedulerOutput
    ) -> tuple[dict[str, int], list[tuple[int, bytes, int]]]:
        """KV offload: the step's drops, stores and loads, before its forward. A load that
        fails (a missing or corrupt disk block) is recomputed in this step: every request
        whose computed context covers that block starts its step at the block instead (its
        tokens are all here), so the step's outputs are what recompute gives. Returns the
        tokens each request computes and every failed (tier, hash, block id), those of
        loads no scheduled request covers too (a prefetch: core/kv/prefetch.py). With
        pipeline stages nothing is recomputed: the failures go down the pipeline with the
        step (pipeline_stage.py)."""
        loads, failures = [], []
        if so.kv_transfers is not None:
            assert self.kv_tiers is not None, "the core sends KV transfers only with tiers"
            loads = so.kv_transfers.loads
            failures = self.kv_tiers.apply(so.kv_transfers)
        if loads:
            # A rank's disk load can fail alone (a damaged file of its part): the ranks
            # recompute what failed on any of them, so they compute the same tokens.
            failures = self.tp.union_across(failures)
        if self.stage is not None:
            self.stage.loads_failed(loads, failures)
            # A stage cannot recompute alone (the stages before it have run the step), and
            # need not: the core sends a load that can fail only in a step in which no
            # request reads its block (a prefetch), with pipeline stages.
            return so.num_scheduled_tokens, failures
        if not failures:
            return so.num_scheduled_tokens, []
        bad = {block_id for _, _, block_id in failures}
        block_size = self.host.layout.block_size
        scheduled = dict(so.num_scheduled_tokens)
        for req_id in scheduled:
            st = self.requests.get(req_id)
            if st is None:
                continue
            computed_blocks = st.block_ids[0][: st.num_computed_tokens // block_size]
            first_bad = next((i for i, b in enumerate(computed_blocks) if b in bad), None)
            if first_bad is not None:
                start = first_bad * block_size
                scheduled[req_id] += st.num_computed_tokens - start
                st.num_computed_tokens = start
                # A draft model's part of the block did not load either.
                st.draft_num_computed = min(st.draft_num_computed, start)
        return scheduled, failures

    def _kv_load_failed(self, failures: list[tuple[int, bytes, int]]) -> list[tuple[int, bytes]]:
        """The (tier, hash) of the step's failed loads, for the core: on one stage what
        `_transfer_kv` found; on the last pipeline stage every stage's (the mask that came
        down the pipeline with the step)."""
        if self.stage is not None:
            return self.stage.failed_loads()
        return [(tier, block_hash) for tier, block_hash, _ in failures]

    def _stash_fork_states(self, so: SchedulerOutput) -> None:
        """A hybrid model's n > 1 request that sampled its first tokens this step: its
        prompt's state is kept for its samples, which fork a step or two later (the parent
        may step on meanwhile and change its own slot)."""
        state = self.host.kv.state
        if state is None:
            return
        for req_id, count in so.num_samples.items():
            st = self.requests.get(req_id)
            if count > 1 and st is not None:
                state.stash(req_id, st.state_slot)

    def _send_kv(self, so: SchedulerOutput) -> None:
        """A disaggregation producer: the prompt blocks this step's forward completed, each
        to its consumer engine; every pipeline stage sends its own layers' part."""
        sender = self.host.kv.sender
        if so.kv_sends and sender is not None:
            sender.send(so.kv_sends, so.kv_send_engines)

    def _forward(
        self, inputs: StepInputs, idle_s: float, step_start: float
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Hidden states [T, hidden], and on a pipeline stage its table of stage times
        (pipeline_stage.py). A stage takes the stream in (the first embeds the tokens), runs
        its layers, and all but the last pass the stream on and return None."""
        if self.stage is None:
            return self._run_model(inputs), None
        stream = self.stage.receive(inputs.input_ids, self.model.embed)
        out = self._run_model(inputs, stream, final_norm=self.pp.is_last)
        return self.stage.send(out, idle_s, step_start)

    def _classifier_head(self):
        """A classifier's head (pooled state -> logits), None for any other model."""
        return self.host.weights.model.classify if self.config.pooler.labels else None

    def _run_model(
        self, inputs: StepInputs, stream: torch.Tensor | None = None, final_norm: bool = True
    ) -> torch.Tensor:
        """The model's layers over the step: the decode path's when it takes the step (a
        captured CUDA graph's replay, the fused CPU stack: host/decode_path.py), else the
        modules. `stream`: the residual stream entering a pipeline stage's layers (None:
        embed the tokens); `final_norm` False: return the stream leaving them (a stage
        before the last)."""
        ids, positions, meta = inputs.input_ids, inputs.positions, inputs.attn_metadata
        model, kv_caches = self.host.weights.model, self.host.kv.caches
        if inputs.images is not None:  # image tokens: the encoder's features, not embeddings
            stream = model.embed(ids)
            rows = inputs.images.rows.to(stream.device)
            stream[rows] = inputs.images.features.to(stream.device, stream.dtype)
        else:
            hidden = self.host.decode.run(ids, positions, meta, stream, final_norm)
            if hidden is not None:
                return hidden
        if stream is None:
            return model(ids, positions, kv_caches, meta)
        x, residual = model.forward_layers(stream, positions, kv_caches, meta)
        if final_norm:
            return model.final_norm(x, residual)
        return x if residual is None else x + residual

    def _propose(
        self, so: SchedulerOutput, inputs: StepInputs, rows: SampleRows
    ) -> list[list[int]]:
        """Speculative decoding: proposals for the requests that sampled (when the step
        speculates), aligned with the output's req_ids; [] when there are none. A draft model
        catches up on the step's tokens whatever the step."""
        proposer = self.host.kv.proposer
        assert proposer is not None
        stepped = [
            (st, end)
            for st, end in zip(inputs.states, inputs.seq_lens, strict=True)
            if not st.sampling_params.embed
        ]
        propose_for = rows.requests if so.speculate else []
        drafts = proposer.after_step(stepped, propose_for)
        if not any(drafts):
            return []
        return drafts
