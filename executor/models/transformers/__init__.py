"""The transformers backend (`--model-impl transformers`): transformers' own modeling code
for any causal LM or encoder zllm has no model of its own for, over zllm's paged KV cache.

    backend.py           TransformersForCausalLM: load, the attention hook, the forward
    tp.py                tensor parallelism by the architecture's own plan
    pp.py                pipeline stages: the base model's forward over a stage's layers
    quant.py             its matmuls swapped for zllm's GGUF-block and 16-bit-row modules
    encoder_matmuls.py   an fp32 encoder's matmuls as oneDNN GEMMs, bias and GELU fused
"""
