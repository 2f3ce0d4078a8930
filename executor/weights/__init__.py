"""Weights: reading them from files under Hugging Face's names, copying them into a model,
and planning which matrices keep a file's blocks (GGUF, 16-bit rows, quantized checkpoints)
and which quantization serves them; the modules that read blocks are executor/layers/linear/'s.
"""
