"""Weights: loading them, quantizing them, and the matmuls that read GGUF blocks."""
