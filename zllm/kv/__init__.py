"""The KV cache's shared rules: block hashes, cache groups, offload tiers, prefix pinning."""
