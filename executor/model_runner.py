"""Runs one scheduled step: flat batch in, sampled tokens out.

The runner keeps each request's state (tokens, block table, seeded generator) between steps,
so the core sends a request's full data once and afterwards only what changed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from zllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelArchConfig
from zllm.executor.attention import AttentionMetadata
from zllm.executor.loader import load_weights
from zllm.executor.models import get_model_class
from zllm.executor.sampler import Sampler, SamplerOutput, SamplingMetadata
from zllm.protocol import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from zllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    generator: torch.Generator | None
    all_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


def kv_bytes_per_token(arch: ModelArchConfig, dtype: torch.dtype) -> int:
    """K and V for every layer: 2 x layers x kv_heads x head_dim x dtype size."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * elem


def make_generator(seed: int | None, sample_index: int) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator()
    # Each sample of an n > 1 request gets its own stream, derived from the request's seed.
    gen.manual_seed((seed + 1_000_003 * sample_index) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.arch = config.arch
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        torch.manual_seed(config.seed)

        start = time.perf_counter()
        model_cls = get_model_class(self.arch.architecture)
        self.model = model_cls(self.arch, dtype=self.dtype)
        self.model.load_weights(load_weights(config.model_path, self.arch))
        self.model.to(self.device).eval()
        self.quantization = self._quantize(config)
        self.cpu_attention_kernel = self._use_cpu_attention_kernel()
        logger.info("Loaded %s in %.1f s", config.model_path, time.perf_counter() - start)

        self.num_blocks = config.cache.num_blocks or self.profile_num_blocks()
        config.cache.num_blocks = self.num_blocks
        shape = (2, self.num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.arch.num_layers)
        ]
        self._setup_cuda(config)
        per_token = kv_bytes_per_token(self.arch, self.dtype)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d bytes per token, %.2f GiB): "
            "at most %d tokens in flight",
            self.num_blocks,
            self.block_size,
            per_token,
            self.num_blocks * self.block_size * per_token / 2**30,
            self.num_blocks * self.block_size,
        )
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        # Generators of n > 1 samples drawn before their fork message arrives.
        self._child_generators: dict[str, torch.Generator | None] = {}

    def _use_cpu_attention_kernel(self) -> bool:
        """Decode attention from csrc/cpu on CPU fp32 when it builds (ZLLM_CPU_KERNELS=0: off)."""
        from zllm.executor import cpu_kernels

        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False
        if not cpu_kernels.enabled() or self.arch.head_dim % 8 != 0:
            return False
        try:
            cpu_kernels.load()
        except cpu_kernels.CpuKernelError as exc:
            logger.warning("CPU kernels unavailable, decode attention stays in torch: %s", exc)
            return False
        for layer in self.model.layers:
            layer.self_attn.attn.decode_kernel = cpu_kernels.paged_decode_attention
        return True

    def _quantize(self, config: EngineConfig) -> str:
        """Apply config.quantization (or pick one when unset); returns the method in use."""
        from zllm.executor import cpu_kernels, quantization

        method = config.quantization
        if method is None:
            method = "none"
            if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.enabled():
                reason = quantization.gguf_kernel_plan(config.model_path)
                if reason is None:
                    method = "gguf"
        if method == "none":
            return method
        try:
            quantization.quantize_model_(self.model, method, config.model_path)
        except cpu_kernels.CpuKernelError as exc:
            if config.quantization is None:
                logger.warning("GGUF kernels unavailable, using fp32 matmuls: %s", exc)
                return "none"
            raise
        return method

    def _setup_cuda(self, config: EngineConfig) -> None:
        """On a GPU: our paged-attention kernels and CUDA graphs for decode (csrc/).

        Not yet verified on a GPU (see the GPU issue's notes); the CPU path is untouched.
        """
        self.graph_runner = None
        self._metadata_cls = AttentionMetadata
        if self.device.type != "cuda":
            return
        from zllm.executor.attention_cuda import CudaAttentionMetadata, use_cuda_attention
        from zllm.executor.cuda_graph import CudaGraphRunner

        torch.cuda.set_device(self.device)
        use_cuda_attention(self.model)
        self._metadata_cls = CudaAttentionMetadata
        self.graph_runner = CudaGraphRunner(
            self.model,
            self.kv_caches,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_blocks_per_seq=-(-config.scheduler.max_model_len // self.block_size),
            block_size=self.block_size,
            num_heads=self.arch.num_heads,
            head_dim=self.arch.head_dim,
            enabled=not config.enforce_eager,
        )
        self.graph_runner.capture()

    def profile_num_blocks(self) -> int:
        budget = self.config.cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.cache.gpu_memory_utilization)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        per_block = kv_bytes_per_token(self.arch, self.dtype) * self.block_size
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block ({per_block} bytes)."
            )
        return int(num_blocks)

    # ---- state updates -----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for fork in so.forked_requests:
            parent = self.requests[fork.parent_req_id]
            child = RequestState(
                req_id=fork.req_id,
                prompt_token_ids=parent.prompt_token_ids,
                output_token_ids=[fork.first_token_id],
                sampling_params=parent.sampling_params,
                block_ids=list(parent.block_ids),
                num_computed_tokens=parent.num_computed_tokens,
                eos_token_id=parent.eos_token_id,
                generator=self._child_generators.pop(fork.req_id, None),
            )
            self.requests[fork.req_id] = child
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            for key in [k for k in self._child_generators if k.startswith(req_id + "#")]:
                del self._child_generators[key]
        for new in so.new_requests:
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
                generator=make_generator(new.sampling_params.seed, new.sample_index),
            )
        for cached in so.cached_requests:
            state = self.requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.block_ids is not None:
                state.block_ids = list(cached.block_ids)
        for src, dst in so.blocks_to_copy:
            for kv in self.kv_caches:
                kv[:, dst].copy_(kv[:, src])

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        step_start = time.perf_counter()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(step_id=so.step_id, req_ids=[], sampled_token_ids=[])

        bs = self.block_size
        states: list[RequestState] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        for req_id, num in so.num_scheduled_tokens.items():
            st = self.requests[req_id]
            start = st.num_computed_tokens
            pos = np.arange(start, start + num, dtype=np.int64)
            table = np.asarray(st.block_ids, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            positions.append(pos)
            input_ids.extend(st.all_token_ids[start : start + num])
            states.append(st)
            query_lens.append(num)
            seq_lens.append(start + num)

        attn_metadata = self._metadata_cls.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=[st.block_ids for st in states],
            slot_mapping=np.concatenate(slots),
            block_size=bs,
            device=self.device,
        )
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(self.device)
        forward_start = time.perf_counter()
        hidden = None
        if self.graph_runner is not None:  # a captured CUDA graph, for decode-only batches
            hidden = self.graph_runner.run(ids_t, pos_t, attn_metadata)
        if hidden is None:
            hidden = self.model(ids_t, pos_t, self.kv_caches, attn_metadata)

        # On a GPU the forward is only enqueued here; its time then lands in sampling's wait.
        forward_end = time.perf_counter()
        timing = dict(
            prepare_time_s=forward_start - step_start, forward_time_s=forward_end - forward_start
        )
        ends = np.cumsum(query_lens)
        prompt_logprobs = self._prompt_logprobs(states, query_lens, seq_lens, ends, hidden)

        # Rows that sample: every request whose known tokens are all computed after this step.
        sample_states = [
            st for st, end in zip(states, seq_lens, strict=False) if end == len(st.all_token_ids)
        ]
        if not sample_states:
            return ModelRunnerOutput(
                step_id=so.step_id,
                req_ids=[],
                sampled_token_ids=[],
                prompt_logprobs=prompt_logprobs,
                sample_time_s=time.perf_counter() - forward_end,
                **timing,
            )
        sample_rows = [
            i
            for i, (st, end) in enumerate(zip(states, seq_lens, strict=False))
            if end == len(st.all_token_ids)
        ]
        logits = self.model.compute_logits(hidden[torch.as_tensor(ends[sample_rows] - 1)])

        # An n > 1 request sampling its first token draws n samples from the same logits.
        row_states: list[RequestState] = []
        row_generators: list[torch.Generator | None] = []
        row_of_state: list[int] = []
        child_names: list[str | None] = []
        for st in sample_states:
            row_of_state.append(len(row_states))
            n = st.sampling_params.n if self._forks_now(st) else 1
            for index in range(n):
                row_states.append(st)
                if index == 0:
                    row_generators.append(st.generator)
                    child_names.append(None)
                else:
                    name = f"{st.req_id}#{index}"
                    gen = make_generator(st.sampling_params.seed, index)
                    self._child_generators[name] = gen
                    row_generators.append(gen)
                    child_names.append(name)
        counts = [(st.sampling_params.n if self._forks_now(st) else 1) for st in sample_states]
        if len(row_states) != len(sample_states):
            logits = torch.repeat_interleave(logits, torch.tensor(counts), dim=0)

        metadata = SamplingMetadata.build(
            params=[st.sampling_params for st in row_states],
            generators=row_generators,
            prompt_ids=[st.prompt_token_ids for st in row_states],
            output_ids=[st.output_token_ids for st in row_states],
            banned=[self._banned_tokens(st) for st in row_states],
            vocab_size=self.arch.vocab_size,
            device=self.device,
        )
        out = self.sampler(logits, metadata)
        sampled = out.sampled_token_ids.tolist()
        row_logprobs = self._sample_logprobs(out, row_states)

        req_ids, tokens_per_req, logprobs_per_req = [], [], []
        for st, first_row, n in zip(sample_states, row_of_state, counts, strict=False):
            toks = sampled[first_row : first_row + n]
            st.append(toks[0])
            req_ids.append(st.req_id)
            tokens_per_req.append(toks)
            lps = row_logprobs[first_row : first_row + n]
            logprobs_per_req.append(_merge_rows(lps) if lps[0] is not None else None)
        has_logprobs = any(lp is not None for lp in logprobs_per_req)
        return ModelRunnerOutput(
            step_id=so.step_id,
            req_ids=req_ids,
            sampled_token_ids=tokens_per_req,
            logprobs=logprobs_per_req if has_logprobs else [],
            prompt_logprobs=prompt_logprobs,
            sample_time_s=time.perf_counter() - forward_end,
            **timing,
        )

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _forks_now(st: RequestState) -> bool:
        return st.sampling_params.n > 1 and not st.output_token_ids and "#" not in st.req_id

    @staticmethod
    def _banned_tokens(st: RequestState) -> list[int]:
        """EOS and stop tokens are forbidden until min_tokens are out."""
        params = st.sampling_params
        if len(st.output_token_ids) >= params.min_tokens:
            return []
        banned = list(params.stop_token_ids)
        if not params.ignore_eos and st.eos_token_id is not None:
            banned.append(st.eos_token_id)
        return banned

    @staticmethod
    def _sample_logprobs(
        out: SamplerOutput, rows: list[RequestState]
    ) -> list[LogprobsLists | None]:
        if out.logprobs is None:
            return [None] * len(rows)
        ids = out.logprobs_token_ids.tolist()
        lps = out.logprobs.tolist()
        ranks = out.sampled_token_ranks.tolist()
        result: list[LogprobsLists | None] = []
        for i, st in enumerate(rows):
            k = st.sampling_params.logprobs
            if k is None:
                result.append(None)
            else:
                result.append(LogprobsLists([ids[i][: k + 1]], [lps[i][: k + 1]], [ranks[i]]))
        return result

    def _prompt_logprobs(
        self, states, query_lens, seq_lens, ends, hidden
    ) -> dict[str, LogprobsLists]:
        """Logprobs of each prompt token given the ones before it, for the chunk just computed."""
        result: dict[str, LogprobsLists] = {}
        for st, q, end, stop in zip(states, query_lens, seq_lens, ends, strict=False):
            k = st.sampling_params.prompt_logprobs
            if k is None or st.output_token_ids:
                continue
            start = end - q
            # Position p predicts token p + 1; only positions whose next token is in the prompt.
            last = min(end, len(st.prompt_token_ids) - 1)
            if last <= start:
                continue
            rows = hidden[stop - q : stop - q + (last - start)]
            logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            targets = torch.tensor(st.prompt_token_ids[start + 1 : last + 1])
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


def _merge_rows(rows: list[LogprobsLists | None]) -> LogprobsLists:
    merged = LogprobsLists([], [], [])
    for row in rows:
        assert row is not None
        merged.extend(row)
    return merged
