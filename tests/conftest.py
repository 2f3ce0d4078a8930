"""Shared fixtures: a tiny random Llama in Hugging Face layout, and the real SmolLM2 GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching lets requests join and leave every step.",
    "1234567890 + 42 = 1234567932",
    "Emoji 🙂 and CJK 你好世界 and accents: café, naïve, Ångström.",
]


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on a few sentences: fast, and covers every byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return tok


def write_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random model + tokenizer in Hugging Face layout under `path`."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 512,
            }
        )
    )
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        # A wide init keeps logits far from ties, so greedy parity is exact, not luck.
        initializer_range=0.2,
    )
    common.update(overrides)
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real default model (98 MB GGUF), from the model cache or the installed package."""
    from zllm.model_files import resolve_model

    try:
        return resolve_model("smollm2")
    except Exception as e:
        if os.environ.get("CI"):
            raise  # CI installs everything it needs: a missing model is a failure there
        pytest.skip(f"SmolLM2 GGUF not available here (no package, no network?): {e}")


def pytest_configure(config):
    # Tests run beside each other on 2 cores: keep torch from oversubscribing them.
    os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_sessionstart(session):
    # Build csrc/cpu once, up front (~35 s on a fresh machine, cached after), rather than
    # inside whichever server or test first needs it, where it would eat their time limits.
    # A failure here is not fatal: the engine falls back to torch, the kernel tests fail.
    from zllm.executor import cpu_kernels

    try:
        cpu_kernels.load()
    except cpu_kernels.CpuKernelError as exc:
        print(f"\nCPU kernels unavailable: {exc}")


def pytest_terminal_summary(terminalreporter):
    from parity import FLIPS

    if FLIPS:
        terminalreporter.write_line(f"greedy parity: {len(FLIPS)} near-tie flip(s) accepted:")
        for line in FLIPS:
            terminalreporter.write_line(f"  {line}")
    else:
        terminalreporter.write_line("greedy parity: no near-tie flips (all exact)")
