"""From what the user typed (a model name and vLLM-named options) to an `EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from zllm.config import CacheConfig, EngineConfig, SchedulerConfig
from zllm.model_files import read_arch_config, resolve_model


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    quantization: str | None = None
    enforce_eager: bool = False

    def create_engine_config(self) -> EngineConfig:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}."
            )
        if self.quantization not in (None, "gguf", "int8", "none"):
            raise ValueError(
                f"quantization must be 'gguf', 'int8', 'none' or unset, got {self.quantization!r}."
            )
        model_path = resolve_model(self.model)
        arch = read_arch_config(model_path)
        max_model_len = arch.max_position_embeddings
        if self.max_model_len is not None:
            if not 1 < self.max_model_len <= arch.max_position_embeddings:
                raise ValueError(
                    f"max_model_len must be in [2, {arch.max_position_embeddings}] "
                    f"(the model's context length), got {self.max_model_len}."
                )
            max_model_len = self.max_model_len
        device = self.device
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        dtype = self.dtype
        if dtype == "auto":
            # bf16 is emulated on most CPUs, so fp32 is both the reference and the fast path there.
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        return EngineConfig(
            model=self.model or "smollm2",
            model_path=model_path,
            arch=arch,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                num_blocks=self.num_gpu_blocks_override,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            seed=self.seed,
            dtype=dtype,
            device=device,
            quantization=self.quantization,
            enforce_eager=self.enforce_eager,
        )


def _cuda_available() -> bool:
    """Whether a CUDA device is visible, without importing torch into this process."""
    import os

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
