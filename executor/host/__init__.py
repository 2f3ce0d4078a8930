"""The model host (vLLM's `Worker`): what a rank holds for its model, and the memory owners
sleep mode releases and restores. Above the models, weights, KV pool and decode paths it puts
together; below the step that reads it (executor/model_runner.py).

    layout.py          RankLayout: this rank's heads, layers, KV groups, device, backend
    model_weights.py   ModelWeights: the model built, loaded, quantized, wrapped
    kv_cache.py        KVCache: the pool, its tiers and sender, the proposer
    decode_path.py     DecodePath: the CUDA graphs or the fused CPU stack over both
    sleep_mode.py      which owner releases at which level, and when each comes back
    model_host.py      ModelHost: the parts, built in order
"""
