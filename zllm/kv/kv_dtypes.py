"""What the KV pool stores for one (token slot, KV head): the row format of each
--kv-cache-dtype (no torch: the core sizes blocks, the executor allocates them, the tiers and
transfers move them, all from these few facts).

    float32 / bfloat16 / float16   head_dim values
    int8                           head_dim signed bytes, then one bf16 scale (absmax / 127)
                                   per group of 32 values (16, or 8, where head_dim needs)

A scale per 32 values follows each token's and head's own range and keeps an outlier from
coarsening a whole head (Gemma 3's rows are 256 wide), at 2 bytes per 32 (68 bytes for a
row of 64, a quarter of fp32's 256 plus 6%). The scales live inside their row, so a block is
still one run of bytes of one tensor: copy-on-write, the CPU and disk tiers and
disaggregated transfers move it whole, at its stored width, without knowing the format; a
decode step's write touches only its own rows.
"""

from __future__ import annotations

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# --kv-cache-dtype's choices (vLLM spells them bfloat16/float16 too) and the dtype each names
# (ELEMENT_BYTES above: how each is stored). vLLM's fp8 spellings are accepted to be refused
# with the reason (kv_cache_dtype_of).
KV_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "int8": "int8",
}
FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", *KV_DTYPE_NAMES, *FP8_KV_DTYPES)


def kv_cache_dtype_of(name: str, dtype: str, device: str) -> str | None:
    """--kv-cache-dtype `name` as a dtype name, None where it is the model's own `dtype`;
    ValueError for what is not built."""
    if name in FP8_KV_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {name} is not built: CPUs have no fp8 arithmetic (use int8: the "
            "same byte per value, with a scale per token and head), and the CUDA attention "
            "kernels read the model's own dtype"
        )
    kv = KV_DTYPE_NAMES.get(name)
    if kv is None or kv == dtype:
        return None
    if device != "cpu":
        raise ValueError(
            f"--kv-cache-dtype {name} runs on CPU only: the CUDA attention kernels read and "
            f"write the cache in the model's dtype"
        )
    if dtype != "float32":
        raise ValueError(
            f"--kv-cache-dtype {name} needs float32 activations (the CPU path); the {dtype} "
            f"model's attention reads its cache in {dtype}"
        )
    return kv


INT8_MAX = 127  # symmetric: -127..127, so -x is representable whenever x is
INT8_SCALE_BYTES = 2  # a bf16 per group


def int8_group(head_dim: int) -> int:
    """Values per scale in an int8 row: 32, else the largest of 16 and 8 dividing head_dim
    (the CPU kernel's q8_group_shift makes the same choice)."""
    for group in (32, 16, 8):
        if head_dim % group == 0:
            return group
    raise ValueError(
        f"--kv-cache-dtype int8 needs a head_dim that is a multiple of 8, not {head_dim}"
    )


def row_width(head_dim: int, kv_dtype: str) -> int:
    """Elements in the last dimension of the pool's tensors ([2, blocks, block_size,
    kv_heads, row_width])."""
    if kv_dtype == "int8":
        return head_dim + INT8_SCALE_BYTES * (head_dim // int8_group(head_dim))
    return head_dim


def row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one (slot, KV head) row of K (or V)."""
    return row_width(head_dim, kv_dtype) * ELEMENT_BYTES[kv_dtype]
