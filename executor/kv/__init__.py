"""The KV pool's blocks in torch: their stored form (quant.py, which the attention paths read
and write), their size on a GPU, the tiers below the pool and disaggregated transfer. The
rank's cache as one memory owner is the model host's (executor/host/kv_cache.py)."""
