"""What the executor keeps of each request between steps (state.py: its tokens, block
tables, generator, images) and its grammar matcher for structured outputs
(structured_output.py, with the compiler and the bitmask the sampler applies). Below the
models (a vision model reads a request's images), the proposers and the sampler.
"""
