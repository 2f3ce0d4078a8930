"""`zllm bench`: offline throughput and latency, served load, KV capacity."""
