"""How big the KV pool is on a GPU: `--gpu-memory-utilization`, as vLLM means it.

The engine may hold `utilization` of the GPU's total memory: its weights (and whatever else
it loaded: a draft model, LoRA buffers, the CUDA context's share the allocator sees), the
peak of a step's activations, and the KV pool in what is left. Other processes' memory is
measured too: the pool never takes more than is free after the load, less the activations'
peak, so a GPU shared with another job gets a smaller pool instead of an out-of-memory error
in the first long prefill.

    total x utilization ─┬─ weights and the rest of the load   free before the load - free after
                         ├─ activation reserve                 activation_reserve_bytes (shapes)
                         └─ KV pool                            kv_pool_bytes

A draft model (speculative decoding) loads after the pool is sized: its weights, counted
from its shapes (`weight_bytes`), are reserved with the activations.

The activation reserve is computed from the shapes of the largest step the scheduler can
make (max_num_batched_tokens tokens, max_num_seqs sampled rows), not profiled: a profiling
forward would need a KV pool to attend to before the pool is sized. tests/test_cuda.py
checks it against torch's measured peak of such steps on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from zllm.model.arch_config import ModelArchConfig

# cuBLAS and FlashAttention workspaces, the CUDA graphs' memory pool, the allocator's
# rounding and fragmentation: what the shapes below do not name.
FIXED_RESERVE_BYTES = 512 << 20
# torch's caching allocator rounds and keeps freed blocks for reuse: headroom on the peak.
RESERVE_SLACK = 1.25


@dataclass(frozen=True, slots=True)
class StepShape:
    """The largest step the engine can run: what its activations are sized by."""

    max_tokens: int  # max_num_batched_tokens: prompt and decode tokens of one step
    max_sampled_rows: int  # max_num_seqs: logits rows sampled at once
    max_context: int  # max_model_len: the keys a prefill chunk may attend to
    dtype_bytes: int  # the activations' element size


def activation_reserve_bytes(arch: ModelArchConfig, step: StepShape) -> int:
    """Bytes a step's activations may take at their peak, for the largest step: one layer's
    live tensors (layers run one after another), the packed keys and values of a prefill's
    context, and the fp32 logits with the sampler's copies of them."""
    t, b = step.max_tokens, step.dtype_bytes
    q_width = arch.num_heads * arch.head_dim
    kv_width = arch.num_kv_heads * arch.head_dim
    stream = 3 * t * arch.hidden_size * b  # the residual, the normed input, a layer's output
    attention = t * (2 * q_width + 2 * kv_width) * b  # q, k, v and the attention output
    mlp = 3 * t * arch.intermediate_size * b  # gate and up side by side, the activation
    # The varlen prefill gathers each prefilling sequence's keys and values by slot: a chunk
    # after a long context reads up to max_model_len of them, besides the step's own.
    context = 2 * (t + step.max_context) * kv_width * b
    # Logits for every sampled row in fp32, then the processed copy, the probabilities and a
    # top-p sort's values and int64 indices.
    logits = step.max_sampled_rows * arch.vocab_size * (4 + 4 + 4 + 12)
    peak = stream + max(attention + context, mlp) + logits
    return int(peak * RESERVE_SLACK) + FIXED_RESERVE_BYTES


def dequantized_matrix_bytes(arch: ModelArchConfig, dtype_bytes: int) -> int:
    """The largest decoder matrix in the model's dtype: the temporary a quantized
    checkpoint's prefill dequantizes its blocks into (executor/kernels/cuda_blocks.py)."""
    q_width = arch.num_heads * arch.head_dim
    kv_width = arch.num_kv_heads * arch.head_dim
    widest = max(q_width + 2 * kv_width, 2 * arch.intermediate_size)
    return widest * max(arch.hidden_size, q_width, arch.intermediate_size) * dtype_bytes


def weight_bytes(arch: ModelArchConfig, dtype_bytes: int) -> int:
    """A dense decoder's weights from its shapes: embeddings (and an untied head), each
    layer's attention and MLP matrices (norms and biases are noise next to them)."""
    q_width = arch.num_heads * arch.head_dim
    kv_width = arch.num_kv_heads * arch.head_dim
    per_layer = arch.hidden_size * (2 * q_width + 2 * kv_width)
    per_layer += 3 * arch.hidden_size * arch.intermediate_size
    embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    return (embeddings + arch.num_layers * per_layer) * dtype_bytes


@dataclass(frozen=True, slots=True)
class KVBudget:
    pool_bytes: int
    explanation: str  # the arithmetic, for the log and for errors


def kv_pool_bytes(
    total: int, free_before_load: int, free_now: int, reserve: int, utilization: float
) -> KVBudget:
    """The KV pool's bytes: `utilization` of `total` less what the load took and the
    activation reserve, and never more than is free now less that reserve (memory other
    processes hold is not ours to take)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be above 0 and at most 1, got {utilization}")
    loaded = max(0, free_before_load - free_now)
    ours = int(total * utilization) - loaded - reserve
    free_after_reserve = free_now - reserve
    pool = min(ours, free_after_reserve)
    gib = 1 << 30
    explanation = (
        f"{utilization:.2f} x {total / gib:.1f} GiB = {total * utilization / gib:.1f} GiB for "
        f"this engine: {loaded / gib:.2f} GiB loaded, {reserve / gib:.2f} GiB kept for "
        f"activations, {max(ours, 0) / gib:.2f} GiB left for the KV cache; "
        f"{free_now / gib:.1f} GiB is free on the device"
    )
    if free_after_reserve < ours:
        explanation += " (other processes hold the rest: the pool takes what is free)"
    return KVBudget(max(pool, 0), explanation)
