"""Matmul modules: what a model's projections are, and what the weight loaders, quantization
and LoRA swap them for.

    dense.py       empty_linear (every model's nn.Linear), DenseRowsLinear (fp32 rows at
                   decode sizes through csrc/cpu/dense_rows.h)
    gguf.py        GGUF blocks and 16-bit rows read in place by the CPU and GPU kernels
                   (GGUFLinear, GGUFSplitLinear, GGUFEmbedding), and their GPU layout
    act_order.py   a quantized checkpoint's act-order column permutation
    parallel.py    a row-parallel matmul (the transformers backend's tensor-parallel cut)
    tiled.py       --deterministic: every matmul in fixed-size row tiles

Which matrix becomes which module is decided in executor/weights/ (blocks.py,
quantization.py), not here.
"""
