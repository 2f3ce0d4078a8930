"""The tiny models test_model.py checks against transformers, and test_tensor_parallel.py
cuts over ranks: name -> (architecture, Hugging Face config fields besides BASE), and the
prompts both run."""

from __future__ import annotations

VOCAB = 256
# What every model here changes in the tiny config: a smaller vocabulary and context, a
# smaller epsilon, and untied embeddings unless a model says otherwise.
BASE = dict(
    vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (architecture, HF config fields besides BASE)
MODELS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-head32": ("llama", dict(head_dim=32, num_key_value_heads=1)),
    "llama3-rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "linear-rope": ("llama", dict(rope_parameters=LINEAR_ROPE)),
    "yarn-rope": ("llama", dict(rope_parameters=YARN_ROPE)),
    "mistral": ("mistral", dict(head_dim=16, sliding_window=None)),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
}
PROMPTS = [
    [5, 77, 3, 201, 18, 9, 140, 66, 31, 250, 2, 90, 17],
    [100, 4, 58],
    [7],
    [33, 12, 199, 45, 8, 160, 71, 29, 222, 3, 64, 11, 5, 87, 140, 19, 250, 6, 41, 93, 120],
]
