"""Random PEFT LoRA adapters for a served model, for benchmarks/lora.sh.

    python benchmarks/make_lora_adapters.py OUT_DIR [--model smollm2] [--count 4] [--rank 16]

Builds the model's architecture with random weights (an adapter only needs the shapes),
wraps it with PEFT on every projection zllm adapts (q/k/v/o/gate/up/down) at the given rank,
draws every LoRA weight from N(0, 0.02), and saves OUT_DIR/lora1, lora2, ... in PEFT's format.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import peft
import torch
import transformers

from zllm.lora import TARGET_MODULES
from zllm.model.arch import arch_of
from zllm.model.files import resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    arch = arch_of(resolve_model(args.model))
    config = transformers.LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    for i in range(1, args.count + 1):
        torch.manual_seed(i)
        model = peft.get_peft_model(
            transformers.LlamaForCausalLM(config),
            peft.LoraConfig(
                r=args.rank, lora_alpha=2 * args.rank, target_modules=list(TARGET_MODULES)
            ),
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        model.save_pretrained(args.out / f"lora{i}")
        print(args.out / f"lora{i}")


if __name__ == "__main__":
    main()
