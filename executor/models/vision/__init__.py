"""Vision encoders: an image's pixels into the embeddings a language model reads in place of
its placeholder tokens (siglip.py: the vision transformer; gemma3.py: Gemma 3's encoder and
projector)."""
