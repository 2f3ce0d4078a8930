"""A random-weight model of Llama-3.2-1B's shape, as a Hugging Face directory (bf16 safetensors).

Speed depends on shapes, not values, and no 1B model is reachable from these machines: this
writes Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 KV heads of 64, MLP 8192,
tied embeddings, its RoPE) with SmolLM2's tokenizer (vocabulary 49,152, read from the default
model's GGUF), and weights drawn at the scale a trained model's have (normal, std 0.02; norms
1). benchmarks/compare.sh converts it with llama.cpp's converter and quantizes it with
llama-quantize (MODEL=llama1b-q4km). Written outside the repository, never committed.

    python benchmarks/make_llama1b.py OUT_DIR [--shape llama1b|qwen3b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

# Llama-3.2-1B's config.json (the vocabulary aside: SmolLM2's tokenizer), and for c=1 runs a
# Qwen2.5-3B-shaped one (36 layers, hidden 2048, 16 query / 2 KV heads of 128, MLP 11008).
SHAPES = {
    "llama1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    ),
    "qwen3b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        hidden_act="silu",
    ),
}


def tensors(cfg: dict, seed: int):
    """(name, bf16 tensor) of the checkpoint, one at a time (a 3B model's fp32 draw at once
    would want 12 GB)."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    yield "model.embed_tokens.weight", normal(cfg["vocab_size"], hidden)
    yield "model.norm.weight", ones(hidden)
    bias = cfg["model_type"] == "qwen2"  # Qwen2's q/k/v carry biases
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", ones(hidden)
        yield p + "post_attention_layernorm.weight", ones(hidden)
        for proj, rows in (
            ("q", heads * head_dim),
            ("k", kv_heads * head_dim),
            ("v", kv_heads * head_dim),
        ):
            yield f"{p}self_attn.{proj}_proj.weight", normal(rows, hidden)
            if bias:
                yield f"{p}self_attn.{proj}_proj.bias", normal(rows)
        yield p + "self_attn.o_proj.weight", normal(hidden, heads * head_dim)
        yield p + "mlp.gate_proj.weight", normal(inter, hidden)
        yield p + "mlp.up_proj.weight", normal(inter, hidden)
        yield p + "mlp.down_proj.weight", normal(hidden, inter)


def write_model(out: str, shape: str, tokenizer_gguf: str, seed: int = 0) -> None:
    from transformers import AutoTokenizer

    os.makedirs(out, exist_ok=True)
    folder, name = os.path.split(tokenizer_gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    cfg = dict(SHAPES[shape])
    cfg.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16",
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    # One safetensors shard per ~2 GB, as transformers writes them.
    shard: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = []
    size = 0
    for tensor_name, tensor in tensors(cfg, seed):
        if size + tensor.nbytes > 2 << 30 and shard:
            shards.append(shard)
            shard, size = {}, 0
        shard[tensor_name] = tensor
        size += tensor.nbytes
    shards.append(shard)
    index = {}
    for n, part in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, os.path.join(out, file), metadata={"format": "pt"})
        index.update(dict.fromkeys(part, file))
    total = sum(t.nbytes for part in shards for t in part.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=2)
    print(f"{out}: {shape}, {total / 1e9:.2f} GB of bf16 weights in {len(shards)} shard(s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    parser.add_argument("--tokenizer-gguf", default=None, help="default: SmolLM2's GGUF")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gguf = args.tokenizer_gguf
    if gguf is None:
        from zllm.model.files import resolve_model

        gguf = resolve_model("smollm2")
    write_model(args.out, args.shape, gguf, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
