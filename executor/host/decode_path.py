"""The decode path: what runs a step in place of the model's modules, one by one, when it can;
a memory owner sleep mode releases and restores.

    graph_runner       on a GPU: CUDA graphs of decode-only steps (decode.py)
    piecewise_runner   on a GPU with --cudagraph-mode full_and_piecewise: graphs of the pieces
                       between attention calls of prefill and mixed steps (piecewise.py)
    fused              on CPU: the whole decoder stack in one C++ call for decode-only steps
                       (fused_decode.py)
    run(...)           the first of them that takes the step; None: the modules run it

It lives in graphs/ beside the runners it holds: the fused CPU stack is the CPU's stand-in
for a decode graph (one call for the whole stack), so choosing among them is one job; the
stack's kernels stay in kernels/. Each reads other owners' memory: the graphs were captured
over the KV pool's addresses and the weights, the fused stack over the weights. So sleep
drops the graphs at either level and the fused stack with the weights (level 2), and waking
rebuilds them once both are back (sleep_mode.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from zllm.executor.graphs import fused_decode
from zllm.executor.graphs.fused_decode import FusedDecode
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.model.family import Feature
from zllm.model.registry import code_family

if TYPE_CHECKING:
    from zllm.executor.attention.backend import StepAttentionMetadata
    from zllm.executor.graphs.decode import CudaGraphRunner
    from zllm.executor.graphs.piecewise import PiecewiseGraphRunner
    from zllm.executor.host.kv_cache import KVCache
    from zllm.executor.host.layout import RankLayout
    from zllm.executor.host.model_weights import ModelWeights

logger = logging.getLogger(__name__)


class DecodePath:
    """The CUDA graphs or the fused CPU stack over `weights` and `kv`, as they apply."""

    def __init__(self, layout: RankLayout, weights: ModelWeights, kv: KVCache) -> None:
        self.layout = layout
        self._weights, self._kv = weights, kv
        self._fused_released = False  # sleep level 2: rebuilt on waking
        self.fused = self._build_fused()
        self.graph_runner = self._capture_cuda_graphs()
        self.piecewise_runner = self._capture_piecewise_graphs()

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: StepAttentionMetadata | Sequence[StepAttentionMetadata],
        stream: torch.Tensor | None = None,
        final_norm: bool = True,
    ) -> torch.Tensor | None:
        """Hidden states from a decode graph's replay (decode-only batches on a GPU, never a
        pipeline stage), else the pieces of a piecewise one (prefill and mixed steps), else
        the fused CPU stack (decode-only steps); None: none of them takes the step.
        `stream`, `final_norm`: a pipeline stage's (model_runner.py)."""
        hidden = None
        if self.graph_runner is not None:
            hidden = self.graph_runner.run(input_ids, positions, attn_metadata)
        if hidden is None and self.piecewise_runner is not None:
            hidden = self.piecewise_runner.run(input_ids, positions, attn_metadata)
        if hidden is None and self.fused is not None:
            hidden = self.fused.run(
                input_ids, positions, self._kv.caches, attn_metadata,
                stream=stream, final_norm=final_norm,
            )  # fmt: skip
        return hidden

    # ---- memory owner -------------------------------------------------------------------------
    def release(self, level: int) -> None:
        """Either level: the graphs (captured over the pool's addresses); level 2: the fused
        stack too (it holds the weights, which go)."""
        self.graph_runner = None
        self.piecewise_runner = None
        if level >= 2:
            self.fused = None
            self._fused_released = True

    def restore(self) -> None:
        """With the weights and the pool back: the graphs captured again, the fused stack
        rebuilt if it went."""
        if self._fused_released:
            self.fused = self._build_fused()
            self._fused_released = False
        self.graph_runner = self._capture_cuda_graphs()
        self.piecewise_runner = self._capture_piecewise_graphs()

    # ---- building -----------------------------------------------------------------------------
    def _build_fused(self) -> FusedDecode | None:
        """On CPU: the fused stack, where it covers the model and the features in use."""
        layout, config = self.layout, self.layout.config
        if layout.device.type != "cpu" or not (fused_decode.enabled() and cpu_kernels.enabled()):
            return None
        family = code_family(layout.arch, config.model_impl)
        skip = (
            family.lacks[Feature.FUSED_CPU_DECODE]
            if not family.supports(Feature.FUSED_CPU_DECODE)
            else "LoRA"
            if self._weights.lora is not None
            else "deterministic mode"
            if config.deterministic
            else "--enforce-eager"
            if config.enforce_eager
            else "tensor parallel (an all-reduce inside each layer)"
            if layout.tp.enabled
            else None
        )
        if skip is None:
            try:
                fused = FusedDecode.build(self._weights.model)
            except (fused_decode.Unsupported, cpu_kernels.CpuKernelError, RuntimeError) as exc:
                # RuntimeError: a shape DecodeStack's checks refuse (say, RoPE tables of
                # different widths); the modules serve such a model.
                skip = str(exc)
            else:
                logger.info("Decode steps: the fused CPU path (csrc/cpu/decode_stack.h)")
                return fused
        logger.info("Decode steps: the module path (fused CPU path not used: %s)", skip)
        return None

    def _graphs_apply(self) -> bool:
        """Whether this engine's steps may replay CUDA graphs at all."""
        if not self.layout.graphs_run_here():
            return False
        lora = self._weights.lora
        if lora is not None and lora.slots is None:
            # The segmented update's calls follow each step's adapters (lora/layers.py).
            logger.info("LoRA without slot buffers (--deterministic): no CUDA graphs")
            return False
        return True

    def _capture_cuda_graphs(self) -> CudaGraphRunner | None:
        """On a GPU: CUDA graphs for decode-only steps (csrc/); None elsewhere."""
        layout, config = self.layout, self.layout.config
        if not self._graphs_apply():
            return None
        from zllm.executor.graphs.decode import CudaGraphRunner

        torch.cuda.set_device(layout.device)
        graph_runner = CudaGraphRunner(
            self._weights.model,
            self._kv.caches,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_blocks_per_seq=-(-config.scheduler.max_model_len // layout.block_size),
            block_size=layout.block_size,
            num_heads=layout.arch.num_heads,
            head_dim=layout.arch.head_dim,
            enabled=not config.enforce_eager,
            layer_attention=list(layout.layer_attention),
        )
        graph_runner.capture()
        return graph_runner

    def _capture_piecewise_graphs(self) -> PiecewiseGraphRunner | None:
        """On a GPU with --cudagraph-mode full_and_piecewise: graphs for the pieces between
        attention calls (piecewise.py)."""
        config = self.layout.config
        if not config.piecewise_cuda_graphs or config.enforce_eager or not self._graphs_apply():
            return None
        family = code_family(self.layout.arch, config.model_impl)
        if not family.supports(Feature.PIECEWISE_CUDA_GRAPHS):
            why = family.lacks[Feature.PIECEWISE_CUDA_GRAPHS]
            logger.info("%s: decode graphs only, no piecewise graphs (%s)", family.title, why)
            return None
        if self.layout.arch.vision:
            # A prefill with images feeds encoder features and (M-RoPE) [3, T] positions that
            # the pieces' static buffers do not hold; decode steps are text tokens.
            logger.info("A vision model: decode graphs only, no piecewise graphs")
            return None
        from zllm.executor.graphs.piecewise import CudaPieces, PiecewiseGraphRunner

        runner = PiecewiseGraphRunner(
            self._weights.model,
            self._kv.caches,
            CudaPieces(self.layout.device),
            max_num_tokens=config.scheduler.max_num_batched_tokens,
            layer_attention=list(self.layout.layer_attention),
        )
        return runner if runner.capture() else None
