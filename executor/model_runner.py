"""Runs one scheduled step: flat batch in, sampled tokens out.

The runner keeps each request's state (tokens, block table, seeded generator) between steps,
so the core sends a request's full data once and afterwards only what changed.

    execute_model(so)   _update_states        forks, finished, new, cached, block copies
                        _prepare_inputs       StepInputs: flat token ids, positions, metadata
                        _forward              hidden states, one row per new token
                        _prompt_logprobs      for the prompt chunk just computed, if asked
                        _choose_sample_rows   SampleRows: who samples, how many samples each
                        _sample               one token per sampler row
                        _pack_output          ModelRunnerOutput, one entry per sampling request
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from zllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelArchConfig
from zllm.executor import cpu_kernels, fused_decode, quantization
from zllm.executor.attention_backend import StepAttentionMetadata, choose_attention_backend
from zllm.executor.batch_invariant import TILE_ROWS, make_batch_invariant, tiled
from zllm.executor.fused_decode import FusedDecode
from zllm.executor.kv_connector import KVPool, KVTiers
from zllm.executor.kv_transfer import KVSender, transfer_layout
from zllm.executor.loader import load_weights
from zllm.executor.lora.manager import LoRAManager
from zllm.executor.models import get_model_class
from zllm.executor.models.llama import RotaryEmbedding
from zllm.executor.models.transformers_backend import TransformersForCausalLM
from zllm.executor.parallel import ONE_RANK, Parallel, local_arch, release_other_stages_ends
from zllm.executor.request_state import RequestState, make_generator
from zllm.executor.sampler import Sampler, SamplerOutput, SamplingMetadata
from zllm.executor.spec_decode.draft_model import DraftModelProposer
from zllm.executor.spec_decode.ngram import NgramProposer
from zllm.executor.structured_output import GrammarCompiler, allocate_bitmask, apply_bitmask
from zllm.kv_cache_groups import KVCacheGroup, kv_cache_groups
from zllm.model_files import read_gguf
from zllm.protocol import LogprobsLists, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from zllm.executor.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class StepInputs:
    """One step's flat batch: the scheduled requests in order, their new tokens back to back."""

    states: list[RequestState]
    query_lens: list[int]  # new tokens per request
    seq_lens: list[int]  # context per request after this step (computed + new)
    token_ends: np.ndarray  # int64 [S]: where each request's rows end in the flat batch
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn_metadata: StepAttentionMetadata | list[StepAttentionMetadata]  # one, or one per layer


@dataclass(slots=True)
class SampleRows:
    """The requests that sample this step, and the sampler rows they fill (in batch order).

    A request drawing several samples (so.num_samples) fills that many rows with the same
    logits, one generator each. A request verifying d proposed tokens fills d + 1 rows, one
    per position, each with its own logits (row j: after the first j proposals):

        requests      |  a  |      b       |  c  |      d        |   b draws 3
        logits rows   |  a  |      b       |  c  | d0   d1   d2  |   d verifies 2 proposals
        sampler rows  |  a  |  b   b1  b2  |  c  | d0   d1   d2  |   b1, b2: samples 1, 2
    """

    requests: list[RequestState]
    hidden_rows: np.ndarray  # int64 [L]: the hidden-state row behind each logits row
    logits_states: list[RequestState]  # [L]
    repeats: list[int]  # [L]: sampler rows each logits row feeds
    num_rows: list[int]  # [R]: sampler rows of each request
    row_states: list[RequestState]  # [B]
    row_generators: list[torch.Generator | None]  # [B]
    row_drafts: list[int]  # [B]: the proposal a row verifies, -1 for none
    row_num_prior: list[int]  # [B]: proposals before the row's position (0 unless verifying)
    drafts: dict[str, list[int]]  # the proposals each verifying request's rows check

    @property
    def verifies(self) -> bool:
        return bool(self.drafts)


def kv_bytes_per_token(arch: ModelArchConfig, dtype: torch.dtype) -> int:
    """K and V for every layer: 2 x layers x kv_heads x head_dim x dtype size."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * elem


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """Which block tables and which view a layer's attention metadata is built from."""

    group: int  # its KV cache group: the block tables it reads
    sliding_window: int | None  # its own window (a non-hybrid group may mix layers)


class ModelRunner:
    """The model, its KV cache and every request's state: `execute_model` runs one step."""

    def __init__(self, config: EngineConfig, parallel: Parallel = ONE_RANK) -> None:
        """`parallel`: this process's place among the executor's ranks. Every rank runs every
        step on its part of the model: its tensor-parallel share of the heads (self.arch, so
        its KV cache too), its pipeline stage's layers (self.layers). The last stage's ranks
        sample the same tokens from the same gathered logits; one of them answers the core
        (parallel.answers), and the earlier stages return no output."""
        self.config = config
        self.tp, self.pp = tp, pp = parallel.tp, parallel.pp
        self.arch = local_arch(config.arch, tp)
        self.layers = pp.layer_range(self.arch.num_layers)  # the layers this stage holds
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = _DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        torch.manual_seed(config.seed)
        # Tensor parallel: unseeded rows draw from a generator of the runner's own, the same
        # on every rank (rank 0 of an offline engine shares torch's global one with the user).
        self._unseeded_generator = (
            torch.Generator(device=self.device).manual_seed(config.seed) if tp.enabled else None
        )
        # Pipeline parallel: this stage's sends still in flight (the tensors they read), and
        # when its last step ended (its idle time before the next).
        self._sends: list[tuple[torch.distributed.Work, torch.Tensor]] = []
        self._step_end = time.perf_counter()

        start = time.perf_counter()
        self.kv_groups = kv_cache_groups(self.arch, config.cache.hybrid_kv_cache)
        self.layer_attention = _layer_attention(self.arch, self.kv_groups, self.layers)
        # The cache tensors this stage's layers use (every one of them on a single stage).
        self.kv_slot_of = _kv_slots(self.kv_groups, self.layers)
        self.attention = choose_attention_backend(
            self.device,
            self.dtype,
            self.arch.head_dim,
            sliding_window=any(la.sliding_window for la in self.layer_attention),
        )
        self._load_weights()
        logger.info("Loaded %s in %.1f s", config.model_path, time.perf_counter() - start)
        logger.info("Attention: %s (%s)", self.attention.name, self.attention.description)

        # Ranks may see different free memory (GPUs), stages hold different layers: the pool
        # is the smallest any can hold.
        self.num_blocks = parallel.min_across(config.cache.num_blocks or self.profile_num_blocks())
        config.cache.num_blocks = self.num_blocks
        self.kv_pool = KVPool([])
        self._allocate_kv_cache()
        # KV offload: the tiers below the pool (their bytes outlive sleep mode's pool); a
        # disaggregation consumer's buffer of received blocks is one too.
        offload = config.kv_offload
        transfer = config.kv_transfer
        offloads = offload is not None and offload.enabled
        receives = transfer is not None and transfer.consumes
        self.kv_tiers = KVTiers(config, self.kv_pool) if offloads or receives else None
        # A disaggregation producer's sender of prompt blocks.
        self.kv_sender = (
            KVSender(transfer, self.kv_pool, transfer_layout(config))
            if transfer is not None and transfer.produces
            else None
        )
        self.graph_runner = self._capture_cuda_graphs(config)
        self._log_kv_cache()
        self.sampler = Sampler()
        self.proposer = _make_proposer(config, self.num_blocks, self.dtype)
        self.asleep = False
        self.grammars = GrammarCompiler(config.model_path, self.arch.vocab_size)
        self.requests: dict[str, RequestState] = {}
        # On a GPU: an event after the last step's final kernel, to time the GPU's idle gap
        # before the next step's first one (gpu_idle_time_s).
        self._gpu_done: torch.cuda.Event | None = None
        # Generators of the extra samples of an n > 1 request, drawn before the core's fork
        # message for them arrives: (parent req_id, sample_index) -> generator.
        self._child_generators: dict[tuple[str, int], torch.Generator | None] = {}

    def _load_weights(self) -> None:
        """The model, quantized, made batch-invariant and LoRA-wrapped as configured."""
        config = self.config
        self.model = self._load_model(config)
        self.quantization = self._quantize(config)
        ends_released = release_other_stages_ends(self.model, self.pp)
        if config.model_path.endswith(".gguf"):
            read_gguf(config.model_path).release_pages()  # copied out: the model holds them
        if self.quantization in ("gguf", "gguf-int8") or ends_released:
            # The fp32 weights the blocks replaced, another stage's embedding / logits.
            release_freed_memory(self.device)
        if config.deterministic:
            wrapped = make_batch_invariant(self.model)
            logger.info("Deterministic mode: %d matmuls in %d-row tiles", wrapped, TILE_ROWS)
        self.lora = (
            LoRAManager(self.model, config.lora, self.arch, self.dtype, self.device)
            if config.lora is not None
            else None
        )
        self.fused_decode = self._build_fused_decode(config)

    def _build_fused_decode(self, config: EngineConfig) -> FusedDecode | None:
        """On CPU: the whole decoder stack in one C++ call for decode-only steps
        (executor/fused_decode.py), where it covers the model and the features in use."""
        if self.device.type != "cpu" or not (fused_decode.enabled() and cpu_kernels.enabled()):
            return None
        skip = (
            "transformers backend"
            if config.model_impl == "transformers"
            else "LoRA"
            if self.lora is not None
            else "deterministic mode"
            if config.deterministic
            else "--enforce-eager"
            if config.enforce_eager
            else "tensor parallel (an all-reduce inside each layer)"
            if self.tp.enabled
            else None
        )
        if skip is None:
            try:
                fused = FusedDecode.build(self.model)
            except (fused_decode.Unsupported, cpu_kernels.CpuKernelError, RuntimeError) as exc:
                # RuntimeError: a shape DecodeStack's checks refuse (say, RoPE tables of
                # different widths); the modules serve such a model.
                skip = str(exc)
            else:
                logger.info("Decode steps: the fused CPU path (csrc/cpu/decode_stack.h)")
                return fused
        logger.info("Decode steps: the module path (fused CPU path not used: %s)", skip)
        return None

    def _allocate_kv_cache(self) -> None:
        shape = (2, self.num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        # Layer i of every KV cache group uses tensor i (kv_cache_groups.py): group_size
        # tensors, or on a pipeline stage those its layers use.
        by_slot = {
            slot: torch.zeros(shape, dtype=self.dtype, device=self.device)
            for slot in sorted(set(self.kv_slot_of.values()))
        }
        self.kv_tensors = list(by_slot.values())
        # One per layer of this stage, in order (self.layers).
        self.kv_caches = [by_slot[self.kv_slot_of[layer]] for layer in self.layers]
        self.kv_pool.tensors = self.kv_tensors

    # ---- sleep mode --------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the weights and the KV pool (and a draft model's), keeping the config, the
        compiled grammars' tokenizer data and the sampler. The core calls it only when no
        request is unfinished; the states still here are of finished requests whose ids
        would come with the next step. The KV cache's contents are gone, so the core resets
        its prefix cache too."""
        if self.asleep:
            return
        self.requests.clear()
        self._child_generators.clear()
        self.model = None  # type: ignore[assignment]
        self.lora = None
        self.fused_decode = None
        self.kv_tensors, self.kv_caches = [], []
        self.kv_pool.tensors = []
        self.graph_runner = None
        self.proposer = None
        self.asleep = True
        release_freed_memory(self.device)
        logger.info("Asleep: weights and KV cache released")

    def wake_up(self) -> None:
        """Load the weights again (from the model file) and a fresh, empty KV pool."""
        if not self.asleep:
            return
        start = time.perf_counter()
        self._load_weights()
        self._allocate_kv_cache()
        self.graph_runner = self._capture_cuda_graphs(self.config)
        self.proposer = _make_proposer(self.config, self.num_blocks, self.dtype)
        self.asleep = False
        logger.info("Awake in %.1f s", time.perf_counter() - start)

    def _load_model(self, config: EngineConfig) -> nn.Module:
        """Our model code, or transformers' through the transformers backend (model_impl)."""
        if config.model_impl == "transformers":
            return TransformersForCausalLM.load(
                config.model_path, self.arch, self.dtype, self.device, self.attention
            )
        model_cls = get_model_class(self.arch.architecture)
        model = model_cls(
            config.arch, dtype=self.dtype, attention=self.attention, tp=self.tp, pp=self.pp
        )
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.keep_positions(config.scheduler.max_model_len)
        # (A pipeline stage reads only its own layers' weights.)
        layers = getattr(model, "layer_indices", None)
        model.load_weights(load_weights(config.model_path, config.arch, layers))
        return model.to(self.device).eval()

    def _quantize(self, config: EngineConfig) -> str:
        """Apply config.quantization (or pick one when unset); returns the method in use."""
        if config.model_impl == "transformers":
            # Our quantized matmuls replace layers of our own model classes only.
            if config.quantization not in (None, "none"):
                raise ValueError(
                    f"quantization={config.quantization!r} needs zllm's model code; the "
                    f"transformers backend runs {config.dtype} matmuls (--model-impl zllm)"
                )
            return "none"
        method = config.quantization
        if method is None:
            method = "none"
            if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.enabled():
                reason = quantization.gguf_kernel_plan(config.model_path)
                if reason is None:
                    method = "gguf"
                elif config.model_path.endswith(".gguf"):
                    logger.info("GGUF kernels not used, fp32 matmuls: %s", reason)
        if method == "none":
            return method
        try:
            explicit = config.quantization is not None  # asked for: refuse what it can't serve
            quantization.quantize_model_(self.model, method, config.model_path, strict=explicit)
        except cpu_kernels.CpuKernelError as exc:
            if config.quantization is None:
                logger.warning("GGUF kernels unavailable, using fp32 matmuls: %s", exc)
                return "none"
            raise
        return method

    def _capture_cuda_graphs(self, config: EngineConfig) -> CudaGraphRunner | None:
        """On a GPU: CUDA graphs for decode-only steps (csrc/); None elsewhere.

        Not yet verified on a GPU (see the GPU issue's notes); the CPU path is untouched.
        """
        if self.device.type != "cuda" or self.attention.name != "cuda":
            return None  # graphs replay the CUDA backend's decode (not sliding-window models)
        if config.model_impl == "transformers":
            return None  # transformers' modeling code runs eagerly
        if config.lora is not None:
            # Graphs would freeze one step's rows-by-adapter; LoRA steps run eagerly.
            logger.info("LoRA enabled: no CUDA graphs")
            return None
        if self.tp.enabled or self.pp.enabled:
            # Capturing NCCL collectives (and the communicator's lazy setup) is not tried yet.
            logger.info("Tensor or pipeline parallel: no CUDA graphs")
            return None
        from zllm.executor.cuda_graph import CudaGraphRunner

        torch.cuda.set_device(self.device)
        graph_runner = CudaGraphRunner(
            self.model,
            self.kv_caches,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_blocks_per_seq=-(-config.scheduler.max_model_len // self.block_size),
            block_size=self.block_size,
            num_heads=self.arch.num_heads,
            head_dim=self.arch.head_dim,
            enabled=not config.enforce_eager,
        )
        graph_runner.capture()
        return graph_runner

    def profile_num_blocks(self) -> int:
        budget = self.config.cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.cache.gpu_memory_utilization)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        per_block = self._kv_bytes_per_slot() * self.block_size
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block ({per_block} bytes)."
            )
        return int(num_blocks)

    def _kv_bytes_per_slot(self) -> int:
        """The target's bytes per slot (this stage's layers'), plus a draft model's (it shares
        the block ids)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        draft = DraftModelProposer.kv_bytes_per_slot(self.config, self.dtype)
        # The cache tensors this stage allocates (every group's slots on one stage).
        num_tensors = len(set(self.kv_slot_of.values()))
        return 2 * num_tensors * self.arch.num_kv_heads * self.arch.head_dim * elem + draft

    def _log_kv_cache(self) -> None:
        per_slot = self._kv_bytes_per_slot()
        groups = ", ".join(
            f"{len(g.layers)} layers "
            + (f"window {g.sliding_window}" if g.sliding_window else "full")
            for g in self.kv_groups
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d bytes per slot, %.2f GiB); %d group(s): %s",
            self.num_blocks,
            self.block_size,
            per_slot,
            self.num_blocks * self.block_size * per_slot / 2**30,
            len(self.kv_groups),
            groups,
        )

    # ---- state updates -----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> dict[str, str]:
        """Apply what changed since the last step, forks first (they copy their parent as of
        the step that sampled them). Returns the new requests that cannot run, with why;
        they get no state here, so later steps that still name them skip them."""
        failed: dict[str, str] = {}
        for fork in so.forked_requests:
            generator = self._child_generators.pop((fork.parent_req_id, fork.sample_index), None)
            child = self.requests[fork.parent_req_id].fork(fork, generator)
            self._attach_grammar(child)
            self.requests[fork.req_id] = child
        for req_id, token in so.beam_tokens.items():  # after the forks, which copy the beam
            self.requests[req_id].append(token)
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            # Samples the core never forked (they finished at their first token) leave theirs.
            for key in [key for key in self._child_generators if key[0] == req_id]:
                del self._child_generators[key]
        if self.lora is not None and so.finished_req_ids:
            self.lora.evict(st.lora_int_id for st in self.requests.values() if st.lora_int_id)
        for new in so.new_requests:
            if new.lora is not None:
                assert self.lora is not None, "the core refuses LoRA requests when LoRA is off"
                try:
                    self.lora.add(new.lora)
                except Exception as e:  # its files changed since they were checked
                    logger.error("Request %s fails: %s", new.req_id, e)
                    failed[new.req_id] = f"LoRA adapter {new.lora.lora_name!r}: {e}"
                    continue
            state = RequestState.from_new(new, self.device)
            self._attach_grammar(state)
            self.requests[new.req_id] = state
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
            if cached.resumed:  # after a preemption: blocks past the prefix hit are new
                state.draft_num_computed = min(state.draft_num_computed, cached.num_computed_tokens)
                state.draft_tail = []
        for src, dst in so.blocks_to_copy:
            for kv in self.kv_tensors:  # a block's bytes: its group's layers, one per tensor
                kv[:, dst].copy_(kv[:, src])
            if self.proposer is not None:
                self.proposer.copy_block(src, dst)
        return failed

    def _attach_grammar(self, st: RequestState) -> None:
        """A structured-output request's matcher, fed the output it already has (a recomputed
        request after preemption, a forked sample's first token)."""
        params = st.sampling_params.structured_outputs
        if params is not None and self.pp.is_last:  # (earlier stages do not sample)
            st.grammar = self.grammars.matcher(params, st.eos_token_ids, st.output_token_ids)

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step: apply the changes, run the forward, sample for the requests that are due.
        A pipeline stage before the last runs its layers, passes them on, and returns None.

        Timed in three parts (inputs, forward, logits + sampling + output) for /metrics.
        """
        step_start = time.perf_counter()
        idle_s = 0.0 if so.after_no_work else step_start - self._step_end
        try:
            return self._execute(so, step_start, idle_s)
        finally:
            self._step_end = time.perf_counter()

    def _execute(
        self, so: SchedulerOutput, step_start: float, idle_s: float
    ) -> ModelRunnerOutput | None:
        if self.asleep:
            if so.total_num_scheduled_tokens or so.new_requests:
                raise RuntimeError("the engine is asleep: wake it up before running steps")
            return ModelRunnerOutput(step_id=so.step_id, req_ids=[], sampled_token_ids=[])
        failed = self._update_states(so)
        scheduled, kv_load_failed = self._transfer_kv(so)
        if not any(req_id in self.requests for req_id in so.num_scheduled_tokens):
            if not self.pp.is_last:  # (every stage holds the same states: none runs it)
                return None
            return ModelRunnerOutput(
                step_id=so.step_id,
                req_ids=[],
                sampled_token_ids=[],
                failed=failed,
                kv_load_failed=kv_load_failed,
            )
        inputs = self._prepare_inputs(so, scheduled)
        forward_start = time.perf_counter()
        gpu_start = self._record_gpu_event()
        stage_times = None
        if self.pp.enabled:
            hidden, stage_times = self._forward_stage(inputs, idle_s, step_start)
            if hidden is None:
                return None  # passed on to the next stage
        else:
            hidden = self._forward(inputs)
        if so.kv_sends and self.kv_sender is not None:
            self.kv_sender.send(so.kv_sends)  # the prompt blocks this forward completed
        # On a GPU the forward is only enqueued here; its time then lands in sampling's wait.
        forward_end = time.perf_counter()
        prompt_logprobs = self._prompt_logprobs(inputs, hidden)
        pooled = self._pool(inputs, hidden)
        rows = self._choose_sample_rows(inputs, so)
        sampled = self._sample(rows, hidden) if rows.requests else None
        gpu_end = self._record_gpu_event()  # before _pack_output waits for the results
        output = self._pack_output(so.step_id, rows, sampled, prompt_logprobs)
        output.gpu_idle_time_s = self._gpu_idle_before(gpu_start, gpu_end, so.after_no_work)
        output.pooled = pooled
        output.failed = failed
        output.kv_load_failed = kv_load_failed
        if self.proposer is not None:
            output.draft_token_ids = self._propose(so, inputs, rows)
        output.prepare_time_s = forward_start - step_start
        output.forward_time_s = forward_end - forward_start
        output.sample_time_s = time.perf_counter() - forward_end
        if stage_times is not None:
            stage_times[-1, 1] += output.sample_time_s  # this stage's busy time: all of it
            output.stage_idle_s, output.stage_busy_s = stage_times.T.tolist()
        return output

    def _transfer_kv(self, so: SchedulerOutput) -> tuple[dict[str, int], list[tuple[int, int]]]:
        """KV offload: the step's drops, stores and loads, before its forward. A load that
        fails (a missing or corrupt disk block) is recomputed in this step: every request
        whose computed context covers that block starts its step at the block instead (its
        tokens are all here), so the step's outputs are what recompute gives. Returns the
        tokens each request computes and the failed (tier, hash) for the core."""
        if so.kv_transfers is None:
            return so.num_scheduled_tokens, []
        assert self.kv_tiers is not None, "the core sends KV transfers only with tiers"
        failures = self.kv_tiers.apply(so.kv_transfers)
        if not failures:
            return so.num_scheduled_tokens, []
        bad = {block_id for _, _, block_id in failures}
        scheduled = dict(so.num_scheduled_tokens)
        for req_id in scheduled:
            st = self.requests.get(req_id)
            if st is None:
                continue
            computed_blocks = st.block_ids[0][: st.num_computed_tokens // self.block_size]
            first_bad = next((i for i, b in enumerate(computed_blocks) if b in bad), None)
            if first_bad is not None:
                start = first_bad * self.block_size
                scheduled[req_id] += st.num_computed_tokens - start
                st.num_computed_tokens = start
        return scheduled, [(tier, block_hash) for tier, block_hash, _ in failures]

    def _record_gpu_event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _gpu_idle_before(
        self,
        start: torch.cuda.Event | None,
        end: torch.cuda.Event | None,
        after_no_work: bool,
    ) -> float:
        """Seconds the GPU had nothing to run between the last step's final kernel and this
        step's first one (0 on CPU, and after a wait for work). Events are timestamped when
        the GPU reaches them, so the gap is the GPU's own, the executor's Python between the
        two included. This step has synced by now, so `start` is complete."""
        previous, self._gpu_done = self._gpu_done, end
        if start is None or previous is None or after_no_work:
            return 0.0
        return max(0.0, previous.elapsed_time(start) / 1000)

    def _prepare_inputs(
        self, so: SchedulerOutput, scheduled_tokens: dict[str, int] | None = None
    ) -> StepInputs:
        """The flat batch of the scheduled tokens, with slots and attention metadata.

        A request's new tokens are positions [computed, computed + scheduled) of its known
        tokens, so a prompt chunk, a decode and a pending token are all the same case.
        """
        states: list[RequestState] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        scheduled = list((scheduled_tokens or so.num_scheduled_tokens).items())
        if self.lora is not None:
            # Each adapter's rows side by side (a stable sort: the base first, then by id),
            # so a layer adds an adapter's update to one slice of the batch.
            scheduled.sort(key=lambda item: self._lora_id(item[0]))
        for req_id, num in scheduled:
            st = self.requests.get(req_id)
            if st is None:
                continue  # it failed (_update_states)
            start = st.num_computed_tokens
            positions.append(np.arange(start, start + num, dtype=np.int64))
            drafts = so.spec_token_ids.get(req_id)
            if drafts:  # the last known token, then the proposals it verifies
                input_ids.extend(st.all_token_ids[start : start + num - len(drafts)])
                input_ids.extend(drafts)
            else:
                input_ids.extend(st.all_token_ids[start : start + num])
            states.append(st)
            query_lens.append(num)
            seq_lens.append(start + num)
        attn_metadata = self._build_attention_metadata(states, query_lens, seq_lens, positions)
        if self.lora is not None:
            self.lora.set_batch([st.lora_int_id for st in states], query_lens)
        return StepInputs(
            states=states,
            query_lens=query_lens,
            seq_lens=seq_lens,
            token_ends=np.cumsum(query_lens),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.from_numpy(np.concatenate(positions)).to(self.device),
            attn_metadata=attn_metadata,
        )

    def _lora_id(self, req_id: str) -> int:
        st = self.requests.get(req_id)
        return 0 if st is None or st.lora_int_id is None else st.lora_int_id

    def _build_attention_metadata(
        self,
        states: list[RequestState],
        query_lens: list[int],
        seq_lens: list[int],
        positions: list[np.ndarray],
    ) -> StepAttentionMetadata | list[StepAttentionMetadata]:
        """One metadata per (KV cache group, window) the layers use; a list with one entry per
        layer, or a single metadata when every layer shares one (the common case)."""
        bs = self.block_size
        built: dict[LayerAttention, StepAttentionMetadata] = {}
        for key in dict.fromkeys(self.layer_attention):
            tables = [st.block_ids[key.group] for st in states]
            slots = [
                np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
                for table, pos in zip(tables, positions, strict=True)
            ]
            extra = {"all_as_decode": True} if self.config.deterministic else {}
            built[key] = self.attention.build_metadata(
                query_lens=query_lens,
                seq_lens=seq_lens,
                block_tables=tables,
                slot_mapping=np.concatenate(slots),
                block_size=bs,
                device=self.device,
                sliding_window=key.sliding_window,
                **extra,
            )
        if len(built) == 1:
            return next(iter(built.values()))
        return [built[key] for key in self.layer_attention]

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, hidden]: a captured CUDA graph replay when one fits, else eager."""
        hidden = None
        if self.graph_runner is not None:  # decode-only batches on a GPU
            hidden = self.graph_runner.run(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        if hidden is None and self.fused_decode is not None:  # decode-only steps on CPU
            hidden = self.fused_decode.run(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
            )
        if hidden is None:
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
            )
        return hidden

    def _forward_stage(
        self, inputs: StepInputs, idle_s: float, step_start: float
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """This pipeline stage's part of the forward: the first embeds the tokens, later ones
        receive the residual stream from the stage before (waiting for it); each runs its
        layers (fused on CPU for decode-only steps, as one stage would), and all but the last
        send the stream on (without waiting for it to arrive) and return None; the last
        returns the final hidden states.

        With the stream goes a [stages, 2] table of each stage's (idle, busy) seconds in this
        step, so the last stage can report every stage's: idle is the time before the step
        came and waiting for the stage before, busy the rest."""
        pp, model = self.pp, self.model
        wait_s = 0.0  # for the stage before
        if pp.is_first:
            stream = model.embed(inputs.input_ids)
            times = torch.zeros((pp.size, 2), dtype=torch.float64, device=self.device)
        else:
            rows = (inputs.positions.shape[0], self.arch.hidden_size)
            wait_start = time.perf_counter()
            stream, times = pp.recv([rows, (pp.size, 2)], [self.dtype, torch.float64], self.device)
            wait_s = time.perf_counter() - wait_start
        out = None
        if self.fused_decode is not None:  # decode-only steps on CPU
            out = self.fused_decode.run(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                inputs.attn_metadata,
                stream=stream,
                final_norm=pp.is_last,
            )
        if out is None:
            x, residual = model.forward_layers(
                stream, inputs.positions, self.kv_caches, inputs.attn_metadata
            )
            # The last stage's hidden states; or the stream the next stage takes in.
            out = (
                model.final_norm(x, residual)
                if pp.is_last
                else (x if residual is None else x + residual)
            )
        times[pp.stage, 0] = idle_s + wait_s
        times[pp.stage, 1] = time.perf_counter() - step_start - wait_s
        if pp.is_last:
            return out, times.cpu()
        for work, _ in self._sends:  # the last step's: its tensors may be freed now
            work.wait()
        tensors = [out, times]
        self._sends = list(zip(pp.send(tensors), tensors, strict=True))
        return None, times

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32; in deterministic mode in fixed-size tiles."""
        if self.config.deterministic:
            return tiled(self.model.compute_logits, hidden)
        return self.model.compute_logits(hidden)

    def _pool(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, list[float]]:
        """Embeddings requests: sum their prompt's final hidden states chunk by chunk; when
        the prompt is complete, its vector (mean or last token, config.pooling), L2-normed.
        A chunk starting at position 0 starts the sum over (a recompute after preemption)."""
        pooled: dict[str, list[float]] = {}
        batch = zip(
            inputs.states, inputs.query_lens, inputs.seq_lens, inputs.token_ends, strict=True
        )
        for st, q, end, stop in batch:
            if not st.sampling_params.embed:
                continue
            rows = hidden[stop - q : stop].float()
            if end - q == 0 or st.pool_sum is None:
                st.pool_sum = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
            st.pool_sum += rows.sum(dim=0)
            if end < len(st.all_token_ids):
                continue
            vector = st.pool_sum / end if self.config.pooling == "mean" else rows[-1]
            pooled[st.req_id] = torch.nn.functional.normalize(vector, dim=0).tolist()
            st.pool_sum = None
        return pooled

    def _choose_sample_rows(self, inputs: StepInputs, so: SchedulerOutput) -> SampleRows:
        """Every request whose known tokens (and proposals) are all computed after this step
        samples; one named in num_samples (an n > 1 request at its first token, the scheduler
        decides) draws that many samples from the same logits, and one with proposals
        (so.spec_token_ids) verifies them, a logits row per position. Sample i > 0 draws with
        its own seeded generator, kept here until the core's fork message for it arrives."""
        rows = SampleRows([], np.empty(0, np.int64), [], [], [], [], [], [], [], {})
        hidden_rows: list[int] = []
        batch = zip(inputs.states, inputs.seq_lens, inputs.token_ends, strict=True)
        for st, end, token_end in batch:
            drafts = so.spec_token_ids.get(st.req_id, [])
            if end != len(st.all_token_ids) + len(drafts) or st.sampling_params.embed:
                continue
            rows.requests.append(st)
            if drafts:
                rows.drafts[st.req_id] = drafts
                num = len(drafts) + 1
                hidden_rows.extend(range(int(token_end) - num, int(token_end)))
                rows.logits_states.extend([st] * num)
                rows.repeats.extend([1] * num)
                rows.num_rows.append(num)
                rows.row_states.extend([st] * num)
                rows.row_generators.extend([st.generator] * num)
                rows.row_drafts.extend([*drafts, -1])
                rows.row_num_prior.extend(range(num))
                continue
            n = so.num_samples.get(st.req_id, 1)
            hidden_rows.append(int(token_end) - 1)
            rows.logits_states.append(st)
            rows.repeats.append(n)
            rows.num_rows.append(n)
            rows.row_states.extend([st] * n)
            rows.row_drafts.extend([-1] * n)
            rows.row_num_prior.extend([0] * n)
            rows.row_generators.append(st.generator)
            for index in range(1, n):
                generator = make_generator(st.sampling_params.seed, index, self.device)
                self._child_generators[(st.req_id, index)] = generator
                rows.row_generators.append(generator)
        rows.hidden_rows = np.asarray(hidden_rows, dtype=np.int64)
        return rows

    def _sample(self, rows: SampleRows, hidden: torch.Tensor) -> SamplerOutput:
        """One token per sampler row; logits are computed once per logits row, then repeated
        for the samples of an n > 1 request."""
        logits = self._logits(hidden[torch.as_tensor(rows.hidden_rows)])
        self._apply_logit_bias(logits, rows.logits_states)
        self._apply_grammars(logits, rows)
        if len(rows.row_states) != len(rows.logits_states):
            repeats = torch.tensor(rows.repeats, device=logits.device)
            logits = torch.repeat_interleave(logits, repeats, dim=0)
        # A verifying row sees the proposals before it as output (penalties, min_tokens).
        outputs = [
            st.output_token_ids + rows.drafts[st.req_id][:prior] if prior else st.output_token_ids
            for st, prior in zip(rows.row_states, rows.row_num_prior, strict=True)
        ]
        metadata = SamplingMetadata.build(
            params=[st.sampling_params for st in rows.row_states],
            num_logprobs=[self._num_logprobs(st) for st in rows.row_states],
            generators=rows.row_generators,
            prompt_ids=[st.prompt_token_ids for st in rows.row_states],
            output_ids=outputs,
            banned=[
                self._banned_tokens(st, prior)
                for st, prior in zip(rows.row_states, rows.row_num_prior, strict=True)
            ],
            vocab_size=self.arch.vocab_size,
            device=self.device,
        )
        metadata.unseeded_generator = self._unseeded_generator
        drafts = None
        if rows.verifies:
            drafts = torch.tensor(rows.row_drafts, dtype=torch.int64, device=self.device)
        return self.sampler(logits, metadata, drafts)

    def _pack_output(
        self,
        step_id: int,
        rows: SampleRows,
        sampled: SamplerOutput | None,
        prompt_logprobs: dict[str, LogprobsLists],
    ) -> ModelRunnerOutput:
        """One entry per sampling request: its sample(s), and their logprobs when asked.

        An n > 1 request keeps its first sample; the others go to the core, which forks them.
        A verifying request emits its accepted proposals and the token of the first row that
        did not accept (a correction, or the bonus token after all of them).
        """
        req_ids: list[str] = []
        tokens_per_req: list[list[int]] = []
        logprobs_per_req: list[LogprobsLists | None] = []
        if sampled is not None:
            tokens = sampled.sampled_token_ids.tolist()
            accepted = sampled.accepted.tolist() if sampled.accepted is not None else None
            row_logprobs = self._sample_logprobs(sampled, rows.row_states)
            first = 0
            for st, n in zip(rows.requests, rows.num_rows, strict=True):
                req_ids.append(st.req_id)
                if st.req_id in rows.drafts:
                    assert accepted is not None
                    used = next(j for j in range(n) if not accepted[first + j]) + 1
                    emitted = tokens[first : first + used]
                    for token in emitted:
                        st.append(token)
                else:
                    used = n
                    emitted = tokens[first : first + n]
                    if not st.sampling_params.use_beam_search:  # the core picks a beam's token
                        st.append(emitted[0])
                tokens_per_req.append(emitted)
                lps = row_logprobs[first : first + used]
                logprobs_per_req.append(_merge_rows(lps) if lps[0] is not None else None)
                first += n
        has_logprobs = any(lp is not None for lp in logprobs_per_req)
        return ModelRunnerOutput(
            step_id=step_id,
            req_ids=req_ids,
            sampled_token_ids=tokens_per_req,
            logprobs=logprobs_per_req if has_logprobs else [],
            prompt_logprobs=prompt_logprobs,
        )

    def _propose(
        self, so: SchedulerOutput, inputs: StepInputs, rows: SampleRows
    ) -> list[list[int]]:
        """Speculative decoding: proposals for the requests that sampled (when the step
        speculates), aligned with the output's req_ids; [] when there are none. A draft model
        catches up on the step's tokens whatever the step."""
        assert self.proposer is not None
        stepped = [
            (st, end)
            for st, end in zip(inputs.states, inputs.seq_lens, strict=True)
            if not st.sampling_params.embed
        ]
        propose_for = rows.requests if so.speculate else []
        drafts = self.proposer.after_step(stepped, propose_for)
        if not any(drafts):
            return []
        return drafts

    def _apply_logit_bias(self, logits: torch.Tensor, requests: list[RequestState]) -> None:
        rows, cols, biases = [], [], []
        for i, st in enumerate(requests):
            for token, bias in (st.sampling_params.logit_bias or {}).items():
                rows.append(i)
                cols.append(token)
                biases.append(bias)
        if rows:
            dev = logits.device
            index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
            values = torch.tensor(biases, dtype=logits.dtype, device=dev)
            logits.index_put_(index, values, accumulate=True)

    def _apply_grammars(self, logits: torch.Tensor, rows: SampleRows) -> None:
        """Structured outputs: each such request's logits rows keep only the tokens its
        grammar allows next (the samples of an n > 1 request share the row). A verifying
        request's row j gets the mask after its first j proposals: the matcher walks them and
        comes back (GrammarMatcher.fill_draft_masks)."""
        states = rows.logits_states
        grammar_rows = [i for i, st in enumerate(states) if st.grammar is not None]
        if not grammar_rows:
            return
        bitmask = allocate_bitmask(len(grammar_rows), logits.shape[1])
        # One by one: llguidance's thread pool (LLExecutor) measured no faster on 2 cores
        # (9.0 vs 8.7 ms for 32 regex masks).
        k = 0
        while k < len(grammar_rows):
            st = states[grammar_rows[k]]
            assert st.grammar is not None
            drafts = rows.drafts.get(st.req_id)
            if drafts:
                st.grammar.fill_draft_masks(drafts, bitmask[k : k + len(drafts) + 1])
                k += len(drafts) + 1
            else:
                st.grammar.fill_mask(bitmask[k])
                k += 1
        apply_bitmask(logits, grammar_rows, bitmask)

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _banned_tokens(st: RequestState, num_prior: int = 0) -> list[int]:
        """Every EOS id and stop token is forbidden until min_tokens are out (counting
        `num_prior` proposals before a verifying row's position)."""
        params = st.sampling_params
        if len(st.output_token_ids) + num_prior >= params.min_tokens:
            return []
        if st.grammar is not None and st.grammar.is_stopped:
            return []  # a complete answer may only end: the grammar wins over min_tokens
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned += st.eos_token_ids
        return banned

    @staticmethod
    def _num_logprobs(st: RequestState) -> int | None:
        """Top logprobs a row returns: what the request asked for; a beam's candidates."""
        params = st.sampling_params
        if params.use_beam_search:
            return params.beam_candidates(len(st.eos_token_ids))
        return params.logprobs

    def _sample_logprobs(
        self, out: SamplerOutput, rows: list[RequestState]
    ) -> list[LogprobsLists | None]:
        if out.logprobs is None:
            return [None] * len(rows)
        ids = out.logprobs_token_ids.tolist()
        lps = out.logprobs.tolist()
        ranks = out.sampled_token_ranks.tolist()
        result: list[LogprobsLists | None] = []
        for i, st in enumerate(rows):
            k = self._num_logprobs(st)
            if k is None:
                result.append(None)
            else:
                result.append(LogprobsLists([ids[i][: k + 1]], [lps[i][: k + 1]], [ranks[i]]))
        return result

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden: torch.Tensor
    ) -> dict[str, LogprobsLists]:
        """Logprobs of each prompt token given the ones before it, for the chunk just computed."""
        result: dict[str, LogprobsLists] = {}
        batch = zip(
            inputs.states, inputs.query_lens, inputs.seq_lens, inputs.token_ends, strict=True
        )
        for st, q, end, stop in batch:
            k = st.sampling_params.prompt_logprobs
            if k is None or st.output_token_ids:
                continue
            start = end - q
            # Position p predicts token p + 1; only positions whose next token is in the prompt.
            last = min(end, len(st.prompt_token_ids) - 1)
            if last <= start:
                continue
            rows = hidden[stop - q : stop - q + (last - start)]
            logprobs = torch.log_softmax(self._logits(rows).float(), dim=-1)
            targets = torch.tensor(st.prompt_token_ids[start + 1 : last + 1], device=self.device)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(dim=1) + 1
            top_vals, top_ids = (
                logprobs.topk(k, dim=1) if k > 0 else (chosen[:, :0], targets[:, None][:, :0])
            )
            result[st.req_id] = LogprobsLists(
                token_ids=torch.cat([targets[:, None], top_ids], dim=1).tolist(),
                logprobs=torch.cat([chosen, top_vals], dim=1).tolist(),
                ranks=ranks.tolist(),
            )
        return result


def release_freed_memory(device: torch.device) -> None:
    """Hand memory freed by dropped tensors back to the system: collect cycles, then on a GPU
    empty torch's cache; on CPU ask glibc to return free heap pages (tensors below its mmap
    threshold live in the heap, which free() alone does not shrink)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is reused, not returned
        pass


def _make_proposer(
    config: EngineConfig, num_blocks: int, dtype: torch.dtype
) -> NgramProposer | DraftModelProposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    if spec.method == "draft_model":
        groups = kv_cache_groups(config.arch, config.cache.hybrid_kv_cache)
        if groups[0].sliding_window is not None:
            raise ValueError(
                "speculative draft_model needs a target with full-attention layers (the draft "
                "reads the first KV cache group's block tables)"
            )
        return DraftModelProposer(config, num_blocks, dtype)
    raise ValueError(f"speculative method {spec.method!r} is not available")


def _layer_attention(
    arch: ModelArchConfig, groups: list[KVCacheGroup], layers: range
) -> list[LayerAttention]:
    """Per layer of `layers`, which block tables and window its attention uses."""
    group_of = {layer: g for g, group in enumerate(groups) for layer in group.layers}
    return [
        LayerAttention(group_of[i], arch.sliding_window if arch.is_sliding(i) else None)
        for i in layers
    ]


def _kv_slots(groups: list[KVCacheGroup], layers: range) -> dict[int, int]:
    """Layer -> the cache tensor it uses (its place in its group), for `layers`."""
    return {layer: slot for g in groups for slot, layer in enumerate(g.layers) if layer in layers}


def _merge_rows(rows: list[LogprobsLists | None]) -> LogprobsLists:
    merged = LogprobsLists([], [], [])
    for row in rows:
        assert row is not None
        merged.extend(row)
    return merged
