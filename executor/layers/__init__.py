"""The building blocks our models are made of (nano-vllm's `layers/`): each a module that
knows its arithmetic and its device paths, and no model. Models import layers; layers import
the attention backends, the kernels and the parallel primitives below them, never a model.

    norms.py           RMSNorm (with the residual add), Gemma's (1 + weight) norm, Qwen 3's
                       per-head q/k norms
    activations.py     activations by their Hugging Face names; act(gate) * up
    mlp.py             the dense gated MLP (SwiGLU, GeGLU)
    rope.py            rotary embeddings, every rope_scaling kind, partial rotation
    attention.py       self-attention with a fused q/k/v projection over the backends
    decoder_stack.py   the step every rotary decoder of ours takes: embed, layers, norm, logits
    stack_parts.py     a decoder stack described by role (what the fused CPU decode step reads)
    linear/            matmul modules: dense, GGUF blocks and 16-bit rows, act-order,
                       tensor-parallel rows, --deterministic's tiles
    moe/               the mixture-of-experts layer: routers, experts, shared experts
"""
