"""What runs a step in place of the model's modules, one by one: CUDA graphs of decode-only
steps by batch size (decode.py), piecewise graphs for the rest (piecewise.py), and on CPU
the fused decode stack (fused_decode.py); the decode path (executor/host/decode_path.py)
takes the first that serves a step."""
