"""The core's KV cache bookkeeping: which pool block holds which tokens, never the bytes.

block_pool.py      every block, the free queue (free_blocks.py), reference counts, the
                   index of cached full blocks; knows blocks, never requests
block_manager.py   each request's block tables over the pool, prefix hits
                   (prefix_lookup.py), copy-on-write, pins (prefix_pins.py)
connector.py       the KV tiers' index and the scheduler's side of tiers and transfers;
                   fallible loads in a step of their own (prefetch.py)
"""
