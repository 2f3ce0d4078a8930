"""Sampling: rows to sample, logits processors (grammar masks from executor/requests/), the
vectorised sampler."""
