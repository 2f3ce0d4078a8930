"""The KV pool in torch: its stored form, its size on a GPU, tiers and disaggregated transfer."""
