"""More than one rank: tensor and pipeline parallelism, rank processes, Ray actors."""
