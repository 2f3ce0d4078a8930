"""Executor ranks as processes: every rank's step loop and rank 0's fan-out (processes.py),
Ray actors across nodes (ray_actors.py). They run the model runner, so they sit above it; the
tensor and pipeline parallel primitives the layers use are executor/parallel/'s."""
