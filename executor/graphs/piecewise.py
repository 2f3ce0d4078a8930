"""CUDA graphs for the steps the decode graphs do not take: prefills, and steps that mix a
prefill chunk with decodes (`--cudagraph-mode full_and_piecewise`, as vLLM captures them).

A prefill's attention runs over ragged sequences whose shapes change every step, so such a
step cannot be one graph. Everything else in the model (the embedding, norms, projections,
RoPE and the KV write, the MLP, the final norm) depends only on how many tokens the step
has. So for each of a few token counts the forward is captured in pieces, one graph from
one attention call to the next:

    capture(size):  the model's forward over `size` padding tokens, each attention layer
                    swapped for a site that closes the current graph, keeps the q, k, v it
                    was given (they live in the graphs' memory pool: the same addresses on
                    every replay), hands back a static output buffer and opens the next graph
    run():          the step's ids, positions and slots into the static inputs (padding
                    rows: token 0, position 0, slot -1: their KV writes land nowhere), then
                    replay piece 0, attend layer 0 eagerly with the step's own metadata into
                    its output buffer, replay piece 1, ..., and return the last piece's
                    hidden states [:n]

L layers make L + 1 pieces and L eager attention calls: a 30-layer model's mixed step is 31
replays and 30 attention calls instead of some 300 kernel launches from Python.

The pieces are recorded by a `PieceRecorder`: CUDA graphs on a GPU (`CudaPieces`), or, on a
machine without one, `RecordedOps`, which records the aten ops torch dispatches and replays
them on the same tensors: what a CUDA graph does with kernels, so the capture, the static
buffers and the replay order are tested on CPU. (Calls that bypass torch's dispatcher, our C++
extensions' row ops, are invisible to it; its tests turn those off. On a GPU their kernels are
captured like any other.)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zllm.executor.attention.backend import metadata_per_layer
from zllm.executor.attention.layer_groups import LayerAttention
from zllm.executor.attention.paged import PagedAttentionBase
from zllm.executor.graphs.decode import attention_sets, sizes_to_capture, smallest_holding
from zllm.model.arch_config import ModelArchConfig

logger = logging.getLogger(__name__)

# Token counts captured (those up to the step budget). Larger steps run eagerly: their GEMMs
# outweigh the launches a graph saves.
DEFAULT_PIECEWISE_SIZES = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def static_bytes(arch: ModelArchConfig, max_num_tokens: int, dtype_bytes: int) -> int:
    """What the captured pieces keep for good: per size and layer, the q/k/v projection the
    attention reads at replay and its output buffer, and the final hidden states."""
    tokens = sum(sizes_to_capture(max_num_tokens, DEFAULT_PIECEWISE_SIZES))
    q_width = arch.num_heads * arch.head_dim
    per_token = arch.num_layers * (2 * q_width + 2 * arch.num_kv_heads * arch.head_dim)
    return tokens * (per_token + arch.hidden_size) * dtype_bytes


class Replayable(Protocol):
    def replay(self) -> None: ...


class PieceRecorder(Protocol):
    """Records the work between begin() and end() as one replayable piece."""

    def session(self) -> contextlib.AbstractContextManager[None]:
        """Around one size's warm-up and capture."""
        ...

    def begin(self) -> None: ...

    def end(self) -> Replayable: ...


class CudaPieces:
    """Pieces as CUDA graphs, captured on a side stream into one shared memory pool (they
    replay in the order they were captured, never two at once, so sharing it is safe)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self._graph: torch.cuda.CUDAGraph | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            if self._graph is not None:  # a failed capture: close it before anything else runs
                with contextlib.suppress(RuntimeError):
                    self._graph.capture_end()
                self._graph = None
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> Replayable:
        graph, self._graph = self._graph, None
        assert graph is not None
        graph.capture_end()
        return graph


class RecordedOps(TorchDispatchMode):
    """The CPU stand-in for one CUDA graph: the aten ops run inside it, replayed on the same
    tensors (a graph's kernels on the same addresses). Python between the ops does not run
    again, exactly as with a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        with torch.inference_mode():
            for func, args, kwargs, out in self.ops:
                _copy_into(out, func(*args, **kwargs))


def _copy_into(recorded: Any, fresh: Any) -> None:
    """An op's new result into the tensors its capture returned (a view or an in-place op's
    result is the same memory: the copy changes nothing)."""
    if isinstance(recorded, torch.Tensor):
        if recorded.data_ptr() != fresh.data_ptr() or recorded.stride() != fresh.stride():
            recorded.copy_(fresh)
    elif isinstance(recorded, (tuple, list)):
        for r, f in zip(recorded, fresh, strict=True):
            _copy_into(r, f)


class RecordedPieces:
    """Pieces as RecordedOps (tests on CPU)."""

    def __init__(self) -> None:
        self._mode: RecordedOps | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        try:
            yield
        finally:
            if self._mode is not None:  # a failed capture: leave no recording mode on
                self._mode.__exit__(None, None, None)
                self._mode = None

    def begin(self) -> None:
        self._mode = RecordedOps()
        self._mode.__enter__()

    def end(self) -> Replayable:
        mode, self._mode = self._mode, None
        assert mode is not None
        mode.__exit__(None, None, None)
        return mode


@dataclass(slots=True)
class _CaptureMeta:
    """What the captured forward reads of a layer's metadata outside attention: the slots
    RoPE's fused cache write (layers/rope.py rope_into_cache) stores k and v at."""

    slot_mapping: torch.Tensor


@dataclass(slots=True)
class _SiteCapture:
    """One attention call as captured: its inputs and output live at fixed addresses."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    kv_written: bool
    out: torch.Tensor


class _AttentionSite:
    """Stands in for one layer's attention while the forward is captured: ends the piece
    before it, keeps what the real attention will read at replay, opens the next piece."""

    def __init__(self, runner: PiecewiseGraphRunner, index: int) -> None:
        self.runner = runner
        self.index = index

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: Any,
        kv_written: bool = False,
    ) -> torch.Tensor:
        return self.runner._at_attention(self.index, query, key, value, kv_cache, kv_written)


class PiecewiseGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        recorder: PieceRecorder,
        *,
        max_num_tokens: int,
        capture_sizes: Sequence[int] = DEFAULT_PIECEWISE_SIZES,
        layer_attention: Sequence[LayerAttention] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """`max_num_tokens`: the step budget (max_num_batched_tokens): no size above the
        first that holds it is captured. `layer_attention`: per layer, its KV cache group
        and window (None: one for all): each distinct one gets its own static slots."""
        self.model = model
        self.kv_caches = kv_caches
        self.recorder = recorder
        self.device = torch.device(device) if device is not None else kv_caches[0].device
        self.capture_sizes = sizes_to_capture(max_num_tokens, capture_sizes)
        self.max_size = self.capture_sizes[-1] if self.capture_sizes else 0
        # Each attention layer's owner (the module holding it as an attribute), in the
        # order the forward calls them: one per decoder layer.
        self.owners = _attention_owners(model)
        self.layers = [getattr(module, name) for module, name in self.owners]
        if len(self.owners) != len(kv_caches):
            raise ValueError(f"{len(self.owners)} attention layers for {len(kv_caches)} caches")
        keys, self._set_of_layer, self._first_layer_of_set = attention_sets(
            layer_attention, len(kv_caches)
        )
        n, dev = self.max_size, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = [torch.full((n,), -1, dtype=torch.int64, device=dev) for _ in keys]
        self.pieces: dict[int, list[Replayable]] = {}
        self.sites: dict[int, list[_SiteCapture]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.steps_replayed = 0  # (tests: which steps took the pieces)
        self._capturing: list[_SiteCapture] | None = None
        self._closed: list[Replayable] = []

    # ---- capture ------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> bool:
        """Every size, largest first. False (logged; every step then runs eagerly) when the
        model's forward cannot be captured in pieces."""
        start = time.perf_counter()
        try:
            for size in reversed(self.capture_sizes):
                self._capture(size)
        except Exception as e:  # noqa: BLE001 - any capture failure leaves the eager path
            logger.warning("Piecewise CUDA graphs off: capturing them failed (%s)", e)
            self.pieces.clear()
            self.sites.clear()
            self.outputs.clear()
            return False
        logger.info(
            "Captured piecewise CUDA graphs for %d token counts (%s), %d pieces each, in %.1f s",
            len(self.pieces),
            self.capture_sizes,
            len(self.layers) + 1,
            time.perf_counter() - start,
        )
        return True

    def _capture(self, size: int) -> None:
        ids, positions = self.input_ids[:size], self.positions[:size]
        metas = [_CaptureMeta(self.slots[s][:size]) for s in self._set_of_layer]
        try:
            with self.recorder.session(), self._sites_swapped():
                # Warm-up outside the recording: kernels compile, libraries set up their
                # workspaces. The sites answer zeros: no attention runs.
                self.model(ids, positions, self.kv_caches, metas)
                self._capturing, self._closed = [], []
                self.recorder.begin()
                hidden = self.model(ids, positions, self.kv_caches, metas)
                last = self.recorder.end()
        finally:  # (a failed capture leaves no half-made state behind either)
            sites, closed = self._capturing or [], self._closed
            self._capturing, self._closed = None, []
        if len(sites) != len(self.layers):
            raise RuntimeError(f"{len(sites)} attention calls, {len(self.layers)} layers")
        self.pieces[size] = [*closed, last]
        self.sites[size] = sites
        self.outputs[size] = hidden

    @contextlib.contextmanager
    def _sites_swapped(self) -> Iterator[None]:
        for i, (module, name) in enumerate(self.owners):
            setattr(module, name, _AttentionSite(self, i))
        try:
            yield
        finally:
            for (module, name), layer in zip(self.owners, self.layers, strict=True):
                setattr(module, name, layer)

    def _at_attention(
        self,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_written: bool,
    ) -> torch.Tensor:
        if self._capturing is None:  # the warm-up
            return q.new_zeros(q.shape)
        if index != len(self._capturing):
            raise RuntimeError(f"attention layer {index} called out of order")
        self._closed.append(self.recorder.end())
        out = q.new_zeros(q.shape)  # outside any piece: a static buffer, written at replay
        self._capturing.append(_SiteCapture(q, k, v, kv_cache, kv_written, out))
        self.recorder.begin()
        return out

    # ---- replay -------------------------------------------------------------------------------

    def size_for(self, num_tokens: int) -> int | None:
        return smallest_holding(self.capture_sizes, self.pieces, num_tokens)

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: object
    ) -> torch.Tensor | None:
        """Hidden states [n, hidden] from the pieces' replays with eager attention between
        them, or None (no captured size holds the step: run the model eagerly)."""
        n = input_ids.shape[0]
        size = self.size_for(n)
        if size is None:
            return None
        metas = metadata_per_layer(attn_metadata, len(self.layers))  # type: ignore[arg-type]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        for slots, first in zip(self.slots, self._first_layer_of_set, strict=True):
            slots[:n].copy_(metas[first].slot_mapping)
            slots[n:size].fill_(-1)
        pieces = self.pieces[size]
        for i, site in enumerate(self.sites[size]):
            pieces[i].replay()
            out = self.layers[i](
                site.q[:n], site.k[:n], site.v[:n], site.kv_cache, metas[i],
                kv_written=site.kv_written,
            )  # fmt: skip
            site.out[:n].copy_(out)
        pieces[-1].replay()
        self.steps_replayed += 1
        return self.outputs[size][:n]


def _attention_owners(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(module, attribute) of each attention layer, in registration order (the layers')."""
    return [
        (module, name)
        for module in model.modules()
        for name, value in vars(module).items()
        if isinstance(value, PagedAttentionBase)
    ]
