"""Quantized Hugging Face checkpoints (compressed-tensors, GPTQ, AWQ, fp8) read as the CPU
kernel's blocks: checkpoint.py reads a checkpoint's tensors module by module, formats.py
unpacks each method's packing into plain integer codes, scales and zero points (or fp8
values), and to_blocks.py lays those out as GGUF blocks the kernels already multiply, the
weights staying about their stored size. The rules of which method a checkpoint takes live
in zllm/config/quantization.py.
"""
