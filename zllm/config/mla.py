"""What a multi-head latent attention model (DeepSeek-V2, ModelArchConfig.mla) runs with, and
the engine options it refuses at start, each naming why. No torch here.

Its layers attend by executor/attention/mla.py: a torch path that reads and writes the latent
rows in the model's dtype on one rank. So it runs with prefix caching, chunked prefill, pipeline
stages, KV tiers and transfers (a block is bytes to them), sleep mode, ngram speculation, beam
search and GGUF blocks (a Q8_0 file's matmuls read in place, kv_b_proj dequantized). What it
does not run yet is refused here, before any process starts.
"""

from __future__ import annotations

from zllm.config.engine import EngineConfig


def mla_refusals(config: EngineConfig) -> list[str]:
    """Why each option in `config` cannot run a multi-head latent attention model (empty: the
    config runs as asked, or the model has no latent attention)."""
    if config.arch.mla is None:
        return []
    reasons = []
    if config.tensor_parallel_size > 1:
        reasons.append(
            f"--tensor-parallel-size {config.tensor_parallel_size}: the latent attention's "
            "heads are not split over ranks yet"
        )
    if config.cache.kv_cache_dtype is not None:
        reasons.append(
            f"--kv-cache-dtype {config.cache.kv_cache_dtype}: the latent pool is kept in the "
            f"model's dtype ({config.dtype})"
        )
    if config.model_impl == "transformers":
        reasons.append(
            "--model-impl transformers: transformers' MLA hands the attention keys and values "
            "of different head sizes, which the paged cache does not hold (zllm's own code runs "
            "it: --model-impl auto)"
        )
    if config.lora is not None:
        reasons.append("--enable-lora: adapters target q/k/v projections this model lacks")
    if config.deterministic:
        reasons.append("--deterministic: the latent attention has no batch-invariant decode yet")
    spec = config.speculative
    if spec is not None and spec.draft_arch is not None and spec.draft_arch.mla is not None:
        reasons.append("a draft model with latent attention (the draft runs Llama-family code)")
    return reasons


def check_mla(config: EngineConfig) -> None:
    """Refuse (ValueError) the options a latent attention model cannot run with."""
    reasons = mla_refusals(config)
    if reasons:
        raise ValueError(
            f"{config.arch.architecture} (multi-head latent attention) cannot run with "
            + "; ".join(reasons)
        )
