"""The kernels (csrc/) as torch sees them: the CPU extension and CUDA (NVRTC) loaders, the
row-wise layer ops, which arithmetic a GGUF matmul runs, and --deterministic's row tiles."""
