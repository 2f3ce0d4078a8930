"""The model host: what a rank holds for its model, built in order (vLLM's `Worker`).

    layout    RankLayout (layout.py): this rank's heads, its stage's layers, the KV
              groups, the attention backend; decided first, read by the three below
    weights   ModelWeights (model_weights.py): loaded, quantized, batch-invariant,
              LoRA-wrapped
    images    a vision model's image encoder and its cache (models/vision/features.py),
              None for a text-only model
    mrope     an M-RoPE model's positions around its images (models/vision/mrope.py), else None
    kv        KVCache (kv_cache.py): the pool sized after the load (what is left of a GPU),
              its tiers and sender, the proposer whose draft KV shares its blocks
    decode    DecodePath (decode_path.py): CUDA graphs captured over the weights and
              the pool, or the fused CPU stack

The three are memory owners, each with its own release() / restore(); sleep_mode.py calls
them by level. The step (executor/model_runner.py) reads the host; it never decides how the
model was built.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from zllm.config.engine import EngineConfig
from zllm.executor.host.decode_path import DecodePath
from zllm.executor.host.kv_cache import KVCache
from zllm.executor.host.layout import RankLayout
from zllm.executor.host.model_weights import ModelWeights
from zllm.executor.models.vision.features import ImageEncoder, ImageFeatures, image_encoder
from zllm.executor.models.vision.mrope import MRopePositions
from zllm.executor.parallel.groups import ONE_RANK, Parallel
from zllm.model.image_tokens import ImageGrid

logger = logging.getLogger(__name__)


class ModelHost:
    """This rank's layout, weights, KV cache and decode path."""

    def __init__(self, config: EngineConfig, parallel: Parallel = ONE_RANK) -> None:
        """`parallel`: this process's place among the executor's ranks: its tensor-parallel
        share of the heads (so of the KV cache too), its pipeline stage's layers."""
        torch.manual_seed(config.seed)
        start = time.perf_counter()
        self.layout = layout = RankLayout.of(config, parallel)
        # What is free before the load: the load's share of --gpu-memory-utilization.
        free_before_load = (
            torch.cuda.mem_get_info(layout.device)[0] if layout.device.type == "cuda" else 0
        )
        self.weights = ModelWeights(layout)
        # A vision-language model's image encoder, beside it (executor/models/vision/).
        self.images = _image_features(config, self.weights.model, layout.dtype)
        # An M-RoPE model's (Qwen2.5-VL's) positions around its images.
        self.mrope = _mrope(config)
        logger.info("Loaded %s in %.1f s", config.model_path, time.perf_counter() - start)
        logger.info("Attention: %s (%s)", layout.attention.name, layout.attention.description)
        self.kv = KVCache(layout, parallel, free_before_load)
        self.decode = DecodePath(layout, self.weights, self.kv)


def _image_features(
    config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype
) -> ImageFeatures | None:
    if not config.arch.vision:
        return None
    model_config = json.loads((Path(config.model_path) / "config.json").read_text())
    device = next(model.parameters()).device

    def make_encoder(language_model: torch.nn.Module) -> ImageEncoder:
        return image_encoder(config.model_path, model_config, dtype, language_model, device)

    step_bytes = config.scheduler.max_num_encoder_tokens * config.arch.hidden_size * dtype.itemsize
    return ImageFeatures(make_encoder, model, min_cache_bytes=2 * step_bytes)


def _mrope(config: EngineConfig) -> MRopePositions | None:
    if config.arch.mrope_section is None:
        return None
    return MRopePositions(ImageGrid.of_model(config.model_path))
