"""Vision encoders: an image's pixels into the embeddings a language model reads in place of
its placeholder tokens, and what a step needs of them.

    features.py            the step's image rows and features; the encoder cache
    siglip.py, gemma3.py   Gemma 3's SigLIP tower and pooled projector
    qwen2_5_vl.py          Qwen2.5-VL's window-attention tower and patch merger
    transformers_images.py a transformers vision-language model's own (LLaVA's)
    mrope.py               Qwen2.5-VL's M-RoPE positions around its images
"""
