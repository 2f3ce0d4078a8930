"""`--gpu-memory-utilization` (executor/kv/gpu_memory.py): the KV pool's share of a GPU, as vLLM
means the flag. The arithmetic and the shapes' byte counts here; the GPU run
(tests/test_cuda.py) checks the engine's measured peak stays within its share."""

from __future__ import annotations

import pytest
from tiny_models import arch_config_of, tiny_hf_config, tiny_hf_model

from zllm.config.arg_utils import unit_fraction
from zllm.executor.kv.gpu_memory import (
    FIXED_RESERVE_BYTES,
    StepShape,
    activation_reserve_bytes,
    kv_pool_bytes,
    weight_bytes,
)

GIB = 1 << 30


def test_alone_on_the_gpu_the_pool_takes_the_share_less_load_and_reserve() -> None:
    total = 80 * GIB
    budget = kv_pool_bytes(total, 79 * GIB, 63 * GIB, 2 * GIB, 0.9)  # the load took 16 GiB
    assert budget.pool_bytes == int(total * 0.9) - 16 * GIB - 2 * GIB
    assert "16.00 GiB loaded" in budget.explanation
    assert "other processes" not in budget.explanation


def test_beside_another_process_the_pool_takes_only_what_is_free() -> None:
    """Another job holds 40 GiB: 0.9 of the GPU is not there to take; the pool gets what is
    free after the load, less the activations' reserve, so the first long prefill fits."""
    total = 80 * GIB
    budget = kv_pool_bytes(total, 39 * GIB, 23 * GIB, 2 * GIB, 0.9)
    assert budget.pool_bytes == 21 * GIB
    assert "other processes hold the rest" in budget.explanation


def test_nothing_left_is_zero_and_a_share_outside_0_1_is_refused() -> None:
    assert kv_pool_bytes(80 * GIB, 79 * GIB, 10 * GIB, 12 * GIB, 0.9).pool_bytes == 0
    assert kv_pool_bytes(80 * GIB, 79 * GIB, 63 * GIB, 2 * GIB, 0.2).pool_bytes == 0
    with pytest.raises(ValueError, match="at most 1"):
        kv_pool_bytes(80 * GIB, 79 * GIB, 63 * GIB, 2 * GIB, 1.5)
    for bad in ("0", "1.01", "-0.5"):
        with pytest.raises(Exception, match="above 0 and at most 1"):
            unit_fraction(bad)
    assert unit_fraction("1") == 1.0


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_counts_a_models_parameters(tied) -> None:
    """A draft model's weights are reserved from its shapes before it loads: the count
    matches transformers' own model of those shapes (norms and biases aside)."""
    config = tiny_hf_config(tie_word_embeddings=tied, vocab_size=1000)
    arch = arch_config_of(config)
    params = sum(p.numel() for p in tiny_hf_model(config).parameters())
    norms = (2 * arch.num_layers + 1) * arch.hidden_size
    assert weight_bytes(arch, 2) == 2 * (params - norms)


def test_the_reserve_grows_with_the_step_and_holds_the_logits() -> None:
    """The sampled rows' fp32 logits and the sampler's copies are in the reserve: at a
    Llama-3-8B-like vocabulary and 256 rows they are most of it."""
    arch = arch_config_of(tiny_hf_config(vocab_size=128_256, hidden_size=256))
    small = StepShape(max_tokens=512, max_sampled_rows=8, max_context=2048, dtype_bytes=2)
    wide = StepShape(max_tokens=512, max_sampled_rows=256, max_context=2048, dtype_bytes=2)
    long = StepShape(max_tokens=8192, max_sampled_rows=8, max_context=2048, dtype_bytes=2)
    assert activation_reserve_bytes(arch, small) < activation_reserve_bytes(arch, long)
    logits = 256 * 128_256 * 4
    assert activation_reserve_bytes(arch, wide) - FIXED_RESERVE_BYTES > 3 * logits
