"""Sampling: rows to sample, logits processors, structured outputs, the vectorised sampler."""
