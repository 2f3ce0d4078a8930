"""Attention: the backend chosen per model, its metadata, the torch/CPU and CUDA paths."""
