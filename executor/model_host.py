"""The model host: what a rank holds for its model, and how it got it (vLLM's `Worker`).

    ModelHost(config, parallel)   the layout (this rank's heads, this stage's layers, KV groups)
                                  the weights: loaded, quantized, batch-invariant, LoRA-wrapped
                                  the decode path: fused CPU stack, CUDA graphs, or the modules
                                  the KV pool: sized, allocated, its tiers and transfer sender
                                  the proposer of speculative decoding (its own weights)
    sleep(level) / wake_up(tags)  release the KV pool (and at level 2 the weights), restore them

The step (model_runner.py) reads the host; it never decides how the model was built.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from zllm.config.engine import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelArchConfig
from zllm.executor import sleep_mode
from zllm.executor.attention.backend import choose_attention_backend
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import fused_decode
from zllm.executor.kernels.batch_invariant import TILE_ROWS, make_batch_invariant, tiled
from zllm.executor.kernels.fused_decode import FusedDecode
from zllm.executor.kv.connector import KVTiers
from zllm.executor.kv.gpu_memory import (
    StepShape,
    activation_reserve_bytes,
    kv_pool_bytes,
    weight_bytes,
)
from zllm.executor.kv.pool import KVPool
from zllm.executor.kv.transfer import KVSender, transfer_layout
from zllm.executor.lora.manager import LoRAManager
from zllm.executor.models import get_model_class
from zllm.executor.models.rope import RotaryEmbedding
from zllm.executor.models.transformers_backend import TransformersForCausalLM
from zllm.executor.ranks.parallel import ONE_RANK, Parallel, local_arch, release_other_stages_ends
from zllm.executor.spec_decode.draft_model import DraftModelProposer
from zllm.executor.spec_decode.proposer import make_proposer
from zllm.executor.step_inputs import layer_attention, layer_kv_slots
from zllm.executor.weights import blocks as weight_blocks
from zllm.executor.weights import quantization
from zllm.executor.weights.loader import init_dummy_weights, load_weights
from zllm.kv.cache_groups import kv_cache_groups
from zllm.kv.kv_dtypes import row_bytes, row_width
from zllm.model.gguf import read_gguf
from zllm.protocol import SLEEP_TAGS

if TYPE_CHECKING:
    from zllm.executor.graphs.decode import CudaGraphRunner
    from zllm.executor.graphs.piecewise import PiecewiseGraphRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8}


def kv_bytes_per_token(arch: ModelArchConfig, dtype: torch.dtype) -> int:
    """K and V for every layer: 2 x layers x kv_heads x head_dim x dtype size."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * elem


class ModelHost:
    """This rank's model, its decode path and its KV pool; released by sleep, reloaded by
    wake_up."""

    def __init__(self, config: EngineConfig, parallel: Parallel = ONE_RANK) -> None:
        """`parallel`: this process's place among the executor's ranks: its tensor-parallel
        share of the heads (self.arch, so its KV cache too), its pipeline stage's layers
        (self.layers)."""
        self.config = config
        self.tp, self.pp = parallel.tp, parallel.pp
        self.arch = local_arch(config.arch, self.tp)
        self.layers = self.pp.layer_range(self.arch.num_layers)  # the layers this stage holds
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = _DTYPES[config.dtype]
        # What the KV pool stores (--kv-cache-dtype; zllm/kv/kv_dtypes.py: an int8 row carries
        # its scale in row_width's last bytes).
        self.kv_dtype = _KV_DTYPES[config.kv_dtype]
        self.kv_row_width = row_width(self.arch.head_dim, config.kv_dtype)
        self.block_size = config.cache.block_size
        torch.manual_seed(config.seed)

        start = time.perf_counter()
        self.kv_groups = kv_cache_groups(self.arch, config.cache.hybrid_kv_cache)
        self.layer_attention = layer_attention(self.arch, self.kv_groups, self.layers)
        # The cache tensors this stage's layers use (every one of them on a single stage).
        self.kv_slot_of = layer_kv_slots(self.kv_groups, self.layers)
        self.attention = choose_attention_backend(self.device, self.dtype, self.arch.head_dim)
        # What is free before the load: the load's share of --gpu-memory-utilization.
        self._free_before_load = (
            torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        )
        self._load_weights()
        logger.info("Loaded %s in %.1f s", config.model_path, time.perf_counter() - start)
        logger.info("Attention: %s (%s)", self.attention.name, self.attention.description)
        self._create_kv_pool(parallel)
        self.graph_runner = self._capture_cuda_graphs()
        self.piecewise_runner = self._capture_piecewise_graphs()
        self._log_kv_cache()
        self.sleeping: set[str] = set()  # sleep mode: the parts released (SLEEP_TAGS)
        self.weights_on_host = False  # sleep level 1 on a GPU (sleep_mode.py)

    def _create_kv_pool(self, parallel: Parallel) -> None:
        """The pool, the proposer (a draft model's KV is part of the pool's blocks), the tiers
        below the pool and a disaggregation producer's sender."""
        config = self.config
        # Ranks may see different free memory (GPUs), stages hold different layers: the pool
        # is the smallest any can hold.
        self.num_blocks = parallel.min_across(config.cache.num_blocks or self.profile_num_blocks())
        config.cache.num_blocks = self.num_blocks
        self.kv_pool = KVPool([])
        self._allocate_kv_cache()
        # Before the tiers: a draft model's KV is part of every block they hold.
        self._make_proposer()
        # KV offload: the tiers below the pool (their bytes outlive sleep mode's pool); a
        # disaggregation consumer's buffer of received blocks is one too.
        offload, transfer = config.kv_offload, config.kv_transfer
        offloads = offload is not None and offload.enabled
        receives = transfer is not None and transfer.consumes
        # Each rank (every stage's tensor-parallel ranks) keeps and moves its part of a block.
        rank, ranks = parallel.rank, config.world_size
        self.kv_tiers = KVTiers(config, self.kv_pool, rank) if offloads or receives else None
        # A disaggregation producer's sender of prompt blocks.
        self.kv_sender: KVSender | None = None
        if transfer is not None and transfer.produces:
            layout = transfer_layout(config, rank)
            self.kv_sender = KVSender(transfer, self.kv_pool, layout, rank, ranks)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32; in deterministic mode in fixed-size tiles."""
        if self.config.deterministic:
            return tiled(self.model.compute_logits, hidden)
        return self.model.compute_logits(hidden)

    # ---- weights ------------------------------------------------------------------------------
    def _load_weights(self) -> None:
        """The model, quantized, made batch-invariant and LoRA-wrapped as configured."""
        config = self.config
        self.quantization = self._quantization_method()
        self.model = self._load_model()
        if isinstance(self.model, TransformersForCausalLM):
            # Its stage was cut at load (transformers_pp.py): other stages' layers, ends.
            ends_released = self.pp.enabled
        else:
            ends_released = release_other_stages_ends(self.model, self.pp)
        if config.model_path.endswith(".gguf"):
            read_gguf(config.model_path).release_pages()  # copied out: the model holds them
        if self.quantization in ("gguf", "gguf-int8", quantization.SIXTEEN_BIT) or ends_released:
            # The fp32 weights the blocks replaced, another stage's embedding / logits (and
            # on the transformers backend the other stages' layers, loaded with the model).
            release_freed_memory(self.device)
        if config.deterministic:
            wrapped = make_batch_invariant(self.model)
            logger.info("Deterministic mode: %d matmuls in %d-row tiles", wrapped, TILE_ROWS)
        # Where steps replay CUDA graphs, adapters sit in fixed slot buffers (lora/slots.py);
        # --deterministic keeps the tiled segmented updates, so LoRA steps run eagerly there.
        self.lora: LoRAManager | None = None
        if config.lora is not None:
            slots = not (config.enforce_eager or config.deterministic) and self._graphs_run_here()
            self.lora = LoRAManager(
                self.model, config, self.dtype, self.device, self.tp, slots=slots
            )
        self.fused_decode = self._build_fused_decode()

    def _load_model(self) -> nn.Module:
        """Our model code, or transformers' through the transformers backend (model_impl)."""
        config = self.config
        dummy = config.load_format == "dummy"
        if config.model_impl == "transformers":
            # The whole model's arch: each rank cuts its part of the loaded model (tp, pp).
            where = (self.dtype, self.device, self.attention)
            # (Quantized: transformers' matmuls swapped for ours after loading.)
            return TransformersForCausalLM.load(
                config.model_path, config.arch, *where, dummy, self.tp, self.pp, self.quantization
            )
        model_cls = get_model_class(self.arch.architecture)
        model = model_cls(
            config.arch, dtype=self.dtype, attention=self.attention, tp=self.tp, pp=self.pp
        )
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.keep_positions(config.scheduler.max_model_len)
        if dummy:
            init_dummy_weights(model, config.seed)
            if self.quantization != "none":
                quantization.quantize_model_(model, self.quantization, config.model_path)
            return model.to(self.device).eval()
        # GGUF blocks (or a 16-bit checkpoint's rows) serve the matrices the kernel reads:
        # those are never widened to fp32.
        plan = None
        if self.quantization in ("gguf", "gguf-int8", quantization.SIXTEEN_BIT):
            plan = weight_blocks.BlockPlan(model, config.model_path, self.quantization)
        served = plan.served if plan is not None else frozenset()
        # (A pipeline stage reads only its own layers' weights.)
        layers = getattr(model, "layer_indices", None)
        weights = load_weights(config.model_path, config.arch, layers, skip=served)
        model.load_weights(weights, served=served)
        if plan is not None:
            plan.apply(model, config.model_path)
        elif self.quantization != "none":
            quantization.quantize_model_(model, self.quantization, config.model_path)
        return model.to(self.device).eval()

    def _quantization_method(self) -> str:
        """config.quantization, checked against the model (or one picked when unset)."""
        config = self.config
        method = config.quantization
        if method is None:
            method = "none"
            if config.load_format == "dummy":
                return method  # random fp32 weights: no blocks to read
            if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.enabled():
                reason = weight_blocks.gguf_kernel_plan(config.model_path)
                if reason is None:
                    method = "gguf"
                elif config.model_path.endswith(".gguf"):
                    logger.info("GGUF kernels not used, fp32 matmuls: %s", reason)
                elif quantization.sixteen_bit_checkpoint(config.model_path):
                    method = quantization.SIXTEEN_BIT
        if method == "none":
            return method
        explicit = config.quantization is not None  # asked for: refuse what it can't serve
        if explicit:
            quantization.check_quantization(method, config.model_path, strict=True)
        if method in ("gguf", "gguf-int8", quantization.SIXTEEN_BIT):
            try:
                cpu_kernels.load()  # built (or loaded) now: a failure surfaces here, once
            except cpu_kernels.CpuKernelError as exc:
                if explicit:
                    raise
                logger.warning("GGUF kernels unavailable, using fp32 matmuls: %s", exc)
                return "none"
        return method

    # ---- the decode path ----------------------------------------------------------------------
    def _build_fused_decode(self) -> FusedDecode | None:
        """On CPU: the whole decoder stack in one C++ call for decode-only steps
        (executor/kernels/fused_decode.py), where it covers the model and the features in use."""
        config = self.config
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

    def _graphs_run_here(self) -> bool:
        """Whether this engine's device, attention and model could replay CUDA graphs."""
        if self.device.type != "cuda" or self.attention.name != "cuda":
            return False  # graphs replay the CUDA backend's kernels
        if self.config.model_impl == "transformers":
            return False  # transformers' modeling code runs eagerly
        if self.tp.enabled or self.pp.enabled:
            # Capturing NCCL collectives (and the communicator's lazy setup) is not tried yet.
            logger.info("Tensor or pipeline parallel: no CUDA graphs")
            return False
        return True

    def _graphs_apply(self) -> bool:
        """Whether this engine's steps may replay CUDA graphs at all."""
        if not self._graphs_run_here():
            return False
        if self.lora is not None and self.lora.slots is None:
            # The segmented update's calls follow each step's adapters (lora/layers.py).
            logger.info("LoRA without slot buffers (--deterministic): no CUDA graphs")
            return False
        return True

    def _capture_cuda_graphs(self) -> CudaGraphRunner | None:
        """On a GPU: CUDA graphs for decode-only steps (csrc/); None elsewhere."""
        config = self.config
        if not self._graphs_apply():
            return None
        from zllm.executor.graphs.decode import CudaGraphRunner

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
            layer_attention=list(self.layer_attention),
        )
        graph_runner.capture()
        return graph_runner

    def _capture_piecewise_graphs(self) -> PiecewiseGraphRunner | None:
        """On a GPU with --cudagraph-mode full_and_piecewise: graphs for the pieces between
        attention calls of prefill and mixed steps (executor/graphs/piecewise.py)."""
        config = self.config
        if not config.piecewise_cuda_graphs or config.enforce_eager or not self._graphs_apply():
            return None
        from zllm.executor.graphs.piecewise import CudaPieces, PiecewiseGraphRunner

        runner = PiecewiseGraphRunner(
            self.model,
            self.kv_caches,
            CudaPieces(self.device),
            max_num_tokens=config.scheduler.max_num_batched_tokens,
            layer_attention=list(self.layer_attention),
        )
        return runner if runner.capture() else None

    # ---- the KV pool --------------------------------------------------------------------------
    def profile_num_blocks(self) -> int:
        budget = self.config.cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                budget = self._gpu_kv_budget()
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        per_block = self._kv_bytes_per_slot() * self.block_size
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block ({per_block} bytes)."
            )
        return int(num_blocks)

    def _gpu_kv_budget(self) -> int:
        """--gpu-memory-utilization of the device's memory, less the load and the largest
        step's activations, within what is free (executor/kv/gpu_memory.py)."""
        config = self.config
        torch.cuda.empty_cache()  # (the load's freed fp32 copies are not ours to count)
        free, total = torch.cuda.mem_get_info(self.device)
        step = StepShape(
            max_tokens=config.scheduler.max_num_batched_tokens,
            max_sampled_rows=config.scheduler.max_num_seqs,
            max_context=config.scheduler.max_model_len,
            dtype_bytes=self.dtype.itemsize,
        )
        reserve = activation_reserve_bytes(self.arch, step)
        if config.piecewise_cuda_graphs and not config.enforce_eager:  # captured after the pool
            from zllm.executor.graphs.piecewise import static_bytes

            reserve += static_bytes(self.arch, step.max_tokens, self.dtype.itemsize)
        draft = config.speculative.draft_arch if config.speculative is not None else None
        if draft is not None:  # (loaded after the pool)
            reserve += weight_bytes(draft, self.dtype.itemsize)
        budget = kv_pool_bytes(
            total, self._free_before_load, free, reserve, config.cache.gpu_memory_utilization
        )
        logger.info("GPU memory: %s", budget.explanation)
        if budget.pool_bytes <= 0:
            raise ValueError(
                f"no GPU memory is left for the KV cache: {budget.explanation}. Raise "
                "--gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs / "
                "--max-model-len, or free the GPU"
            )
        return budget.pool_bytes

    def _kv_bytes_per_slot(self) -> int:
        """The target's bytes per slot (this stage's layers'), plus a draft model's (it shares
        the block ids)."""
        row = row_bytes(self.arch.head_dim, self.config.kv_dtype)
        draft = DraftModelProposer.kv_bytes_per_slot(self.config, self.dtype)
        # The cache tensors this stage allocates (every group's slots on one stage).
        num_tensors = len(set(self.kv_slot_of.values()))
        return 2 * num_tensors * self.arch.num_kv_heads * row + draft

    def _allocate_kv_cache(self) -> None:
        shape = (2, self.num_blocks, self.block_size, self.arch.num_kv_heads, self.kv_row_width)
        # Layer i of every KV cache group uses tensor i (kv_cache_groups.py): group_size
        # tensors, or on a pipeline stage those its layers use.
        by_slot = {
            slot: torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for slot in sorted(set(self.kv_slot_of.values()))
        }
        self.kv_tensors = list(by_slot.values())
        # One per layer of this stage, in order (self.layers).
        self.kv_caches = [by_slot[self.kv_slot_of[layer]] for layer in self.layers]
        self.kv_pool.tensors = self.kv_tensors

    def _make_proposer(self) -> None:
        """Speculative decoding's proposer; a draft model's KV tensors join the pool's blocks
        (the tiers and transfers move them with the target's, under the same key)."""
        self.proposer = make_proposer(self.config, self.num_blocks, self.dtype)
        draft = self.proposer if isinstance(self.proposer, DraftModelProposer) else None
        # Only the last pipeline stage runs the draft (it proposes after sampling): an
        # earlier stage's draft tensors are never written, so its tiers need not keep them.
        runs_draft = draft is not None and self.pp.is_last
        self.kv_pool.draft = draft.kv_caches if runs_draft else []

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block `src`'s bytes into `dst`, the draft model's too."""
        for kv in self.kv_tensors:  # a block's bytes: its group's layers, one per tensor
            kv[:, dst].copy_(kv[:, src])
        if self.proposer is not None:
            self.proposer.copy_block(src, dst)

    def _log_kv_cache(self) -> None:
        per_slot = self._kv_bytes_per_slot()
        groups = ", ".join(
            f"{len(g.layers)} layers "
            + (f"window {g.sliding_window}" if g.sliding_window else "full")
            for g in self.kv_groups
        )
        logger.info(
            "KV cache: %d blocks of %d tokens, %s (%d bytes per slot, %.2f GiB); %d group(s): %s",
            self.num_blocks,
            self.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            per_slot,
            self.num_blocks * self.block_size * per_slot / 2**30,
            len(self.kv_groups),
            groups,
        )

    # ---- sleep mode ---------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return bool(self.sleeping)

    def sleep(self, level: int) -> None:
        """vLLM's levels. 1: release the KV pool; the weights stay in host memory (on a GPU
        they move to pinned host memory, sleep_mode.py; on CPU they are there already, so the
        pool is all that is freed). 2: release the weights too; waking reads the model file.
        Either way the KV cache's contents are gone (the core resets its prefix cache), and a
        draft model (its weights beside its KV) is released and loaded again on waking."""
        if self.asleep:
            return
        self.kv_tensors, self.kv_caches = [], []
        self.kv_pool.tensors, self.kv_pool.draft = [], []
        self.graph_runner = None  # (captured over the pool's addresses)
        self.piecewise_runner = None
        self.proposer = None
        if level >= 2:
            self.model = None  # type: ignore[assignment]
            self.lora = None
            self.fused_decode = None
        elif self.device.type == "cuda":
            sleep_mode.move_weights(self.model, torch.device("cpu"), pin=True)
            self.weights_on_host = True
        self.sleeping = set(SLEEP_TAGS)
        release_freed_memory(self.device)
        logger.info("Asleep (level %d): KV cache%s released", level, " and weights" * (level >= 2))

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """Restore the parts named (vLLM's tags): "weights" (from host memory, or the model
        file after level 2), "kv_cache" (a fresh, empty pool). Awake once both are back."""
        start, was_asleep = time.perf_counter(), self.asleep
        if "weights" in tags and "weights" in self.sleeping:
            if self.model is None:
                self._load_weights()
            elif self.weights_on_host:
                sleep_mode.move_weights(self.model, self.device)
                self.weights_on_host = False
            self.sleeping.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.sleeping:
            self._allocate_kv_cache()
            self.sleeping.discard("kv_cache")
        if was_asleep and not self.sleeping:  # both back: what reads both
            self.graph_runner = self._capture_cuda_graphs()
            self.piecewise_runner = self._capture_piecewise_graphs()
            self._make_proposer()
        still = f" (still asleep: {', '.join(sorted(self.sleeping))})" if self.sleeping else ""
        logger.info("Woke %s in %.1f s%s", "+".join(tags), time.perf_counter() - start, still)


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
