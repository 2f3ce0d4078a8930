"""CUDA graphs: decode-only steps by batch size, and piecewise graphs for the rest."""
