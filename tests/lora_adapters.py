"""LoRA adapters made with PEFT for the tests that serve or compose adapters: three unlike
each other (ADAPTERS), each written by make_adapter with non-zero random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three adapters unlike each other: every projection; attention only with rsLoRA; MLP only
# at a higher rank.
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS),
    "qv-rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def make_adapter(base_dir: str, out: Path, seed: int, b_std: float | None = None, **config) -> Path:
    """A PEFT adapter of base_dir with random A and non-zero random B (PEFT's own init
    makes B zero: the adapter would change nothing). `b_std`: draw every LoRA weight from
    N(0, b_std) instead of PEFT's uniform init (a real model stays fluent). Skips the test
    where PEFT is not installed."""
    import transformers

    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **config))
    if b_std is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, b_std)
    model.save_pretrained(out)
    return out
