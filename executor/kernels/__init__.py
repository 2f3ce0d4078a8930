"""The kernels (csrc/) as torch sees them: CPU extension and CUDA (NVRTC) loaders, layer ops, the fused decode stack."""
