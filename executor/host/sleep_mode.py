"""Sleep mode (vLLM's `sleep(level)` / `wake_up(tags)`): which of the model host's memory
owners release at which level, and when each comes back. The owners release and restore
themselves (release(level) / restore()); this module only decides when, and keeps which
parts are asleep.

    sleep(1)        the KV cache (pool and proposer) and the decode path's graphs; the
                    weights move to pinned host memory on a GPU (on CPU they are there
                    already, so the pool is all that is freed)
    sleep(2)        the same, and the weights dropped (the fused CPU stack with them): waking
                    reads the model file
    wake_up(tags)   "weights" (ModelWeights.restore), "kv_cache" (KVCache.restore: a fresh,
                    empty pool), in either order; awake once both are back, and only then
                    what reads both: the decode path and the proposer (a draft model's
                    weights beside its KV)

Either level loses the KV cache's contents: the core resets its prefix cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from zllm.executor.host.model_weights import release_freed_memory
from zllm.protocol import SLEEP_TAGS

if TYPE_CHECKING:
    import torch

    from zllm.executor.host.decode_path import DecodePath
    from zllm.executor.host.kv_cache import KVCache
    from zllm.executor.host.model_weights import ModelWeights
    from zllm.executor.models.vision.features import ImageFeatures

logger = logging.getLogger(__name__)


class SleepMode:
    """The level rules over the three owners, and the tags (SLEEP_TAGS) still asleep."""

    def __init__(
        self,
        weights: ModelWeights,
        kv: KVCache,
        decode: DecodePath,
        device: torch.device,
        images: ImageFeatures | None = None,
    ) -> None:
        """`images`: a vision model's encoder and its cache, which sleep with the weights."""
        self._weights, self._kv, self._decode = weights, kv, decode
        self._images = images
        self._device = device  # where freed memory is handed back (release_freed_memory)
        self.sleeping: set[str] = set()  # the parts released (SLEEP_TAGS)

    @property
    def asleep(self) -> bool:
        return bool(self.sleeping)

    def sleep(self, level: int) -> None:
        """Release the KV cache and the graphs, and the weights as `level` says (1 or 2)."""
        if self.asleep:
            return
        self._kv.release(level)
        self._decode.release(level)
        self._weights.release(level)
        if self._images is not None:
            self._images.release(level)
        self.sleeping = set(SLEEP_TAGS)
        release_freed_memory(self._device)
        logger.info("Asleep (level %d): KV cache%s released", level, " and weights" * (level >= 2))

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """Restore the parts named that are asleep; once none is, what reads both."""
        start, was_asleep = time.perf_counter(), self.asleep
        if "weights" in tags and "weights" in self.sleeping:
            self._weights.restore()
            if self._images is not None:
                self._images.restore(self._weights.model)
            self.sleeping.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.sleeping:
            self._kv.restore()
            self.sleeping.discard("kv_cache")
        if was_asleep and not self.sleeping:
            self._decode.restore()  # graphs over the pool and the weights, the fused stack
            self._kv.restore_proposer()
        still = f" (still asleep: {', '.join(sorted(self.sleeping))})" if self.sleeping else ""
        logger.info("Woke %s in %.1f s%s", "+".join(tags), time.perf_counter() - start, still)
