"""An adapter's weights, shaped for the model's fused matmuls.

The model computes q/k/v in one matmul (qkv_proj) and gate/up in another (gate_up_proj);
PEFT adapts q_proj, k_proj, ... one by one. For each fused matmul we stack the A matrices
of its adapted parts side by side and place their B matrices block-diagonally, so one
update serves the fused output:

    x [T, in] @ a_t [in, r_q + r_v]  ->  [T, r_q + r_v]  @ b_t [r_q + r_v, q | k | v]
                                                              B_q^T at (rows r_q, cols q)
                                                              B_v^T at (rows r_v, cols v)

The zeros of b_t add exact zeros, so the result is each part's B A x, computed at once.
The scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into b_t.

Under tensor parallelism each rank keeps the part of an update that matches its part of the
base matmul (executor/parallel/shards.py `shard_of`): a column-parallel matmul (qkv, gate/up) keeps
b_t's columns of its outputs, whole a_t; a row-parallel one (o, down) keeps a_t's rows of its
input slice, whole b_t, so its partial update joins the partial product before the
all-reduce that sums them: sum over ranks of (x_r A_r) B = (x A) B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from zllm.executor.parallel.groups import SINGLE, TensorParallel
from zllm.executor.parallel.shards import shard_of
from zllm.lora import LoRAAdapter, projection_shapes
from zllm.model.arch_config import ModelArchConfig

# Each fused matmul of a decoder layer (zllm's models) and the PEFT modules it computes, in
# output order; transformers' models (the transformers backend) have one matmul per module.
FUSED_MATMULS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# Multi-head latent attention's (DeepSeek-V2/V3): the query whole (q_proj) or through its low
# rank (q_a_proj, q_b_proj), the latent projection, the output; dense layers' MLP as above.
LATENT_MATMULS = {
    **{module: (module,) for module in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")},
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
UNFUSED_MATMULS = {module: (module,) for parts in FUSED_MATMULS.values() for module in parts}
# The matmuls of the attention block (the rest: the MLP).
ATTENTION_MATMULS = (
    *("qkv_proj", "o_proj", "q_proj", "k_proj", "v_proj"),
    *("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"),
)


@dataclass(frozen=True, slots=True)
class FusedLoRA:
    """One fused matmul's low-rank update: y += (x @ a_t) @ b_t."""

    a_t: torch.Tensor  # [in_features, R]
    b_t: torch.Tensor  # [R, out_features], scaled


AdapterWeights = dict[tuple[int, str], FusedLoRA]  # (layer, fused matmul name) -> update


def load_adapter_weights(
    adapter: LoRAAdapter,
    arch: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE,
    layers: range | None = None,
    matmuls: dict[str, tuple[str, ...]] = FUSED_MATMULS,
) -> AdapterWeights:
    """Read a checked adapter (zllm.lora.read_adapter, against the whole model's `arch`)
    into per-matmul updates for `layers` (a pipeline stage's; None: all), cut to this
    tensor-parallel rank's part."""
    shapes = projection_shapes(arch)
    by_module = {(m.layer, m.module): m for m in adapter.modules}
    weights: AdapterWeights = {}
    with safe_open(adapter.weights_file, framework="pt") as f:
        for layer in layers if layers is not None else range(arch.num_layers):
            for fused, parts in matmuls.items():
                present = [by_module.get((layer, part)) for part in parts]
                if not any(present):
                    continue
                in_features = shapes[parts[0]][0]
                out_sizes = [shapes[part][1] for part in parts]
                rank = sum(m.rank for m in present if m is not None)
                a_t = torch.zeros(in_features, rank, dtype=torch.float32)
                b_t = torch.zeros(rank, sum(out_sizes), dtype=torch.float32)
                r0 = c0 = 0
                for module, width in zip(present, out_sizes, strict=True):
                    if module is not None:
                        a = f.get_tensor(module.a_name).float()  # [r, in]
                        b = f.get_tensor(module.b_name).float()  # [out, r]
                        a_t[:, r0 : r0 + module.rank] = a.t()
                        b_t[r0 : r0 + module.rank, c0 : c0 + width] = b.t() * module.scaling
                        r0 += module.rank
                    c0 += width
                a_t, b_t = _rank_part(a_t, b_t, layer, fused, arch, tp)
                weights[(layer, fused)] = FusedLoRA(
                    a_t.to(device=device, dtype=dtype), b_t.to(device=device, dtype=dtype)
                )
    return weights


def _rank_part(
    a_t: torch.Tensor,
    b_t: torch.Tensor,
    layer: int,
    fused: str,
    arch: ModelArchConfig,
    tp: TensorParallel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The update's part for this rank's part of the fused matmul (its weight's shard)."""
    block = "self_attn" if fused in ATTENTION_MATMULS else "mlp"
    shard = shard_of(f"model.layers.{layer}.{block}.{fused}.weight", arch, tp)
    if shard is None:
        return a_t, b_t
    if shard.columns is not None:  # row-parallel: its slice of the inputs
        return a_t[shard.columns].contiguous(), b_t
    return a_t, torch.cat([b_t[:, rows] for rows in shard.rows], dim=1)  # its outputs
