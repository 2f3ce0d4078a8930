"""A random-weight model of a real model's shape, as a Hugging Face directory (bf16 safetensors).

Speed depends on shapes, not values, and no 1B model is reachable from these machines: this
writes Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 KV heads of 64, MLP 8192,
tied embeddings, its RoPE) with SmolLM2's tokenizer (vocabulary 49,152, read from the default
model's GGUF), and weights drawn at the scale a trained model's have (normal, std 0.02; norms
1). benchmarks/compare.sh converts it with llama.cpp's converter and quantizes it with
llama-quantize (MODEL=llama1b-q4km). Written outside the repository, never committed.

Issue 57's shapes: qwen3-1.7b (Qwen3-1.7B, dense, qk-norm, tied), qwen3moe-a3b (Qwen3-30B-A3B's
layers, 128 experts top-8, 4 of its 48 layers) and gpt-oss-20b (gpt-oss-20b's layers, 32
experts top-4, sliding window 128 alternating, attention sinks, 2 of its 24 layers): fewer
layers so they fit the 23 GB machine; a decode step's shape per layer is the real model's.
Issue 74's: qwen35moe-a3b (Qwen3.5-35B-A3B's layers: three Gated DeltaNet state layers and one
gated full-attention layer, 256 experts top-8 and a shared expert; 4 of its 40 layers).
Issue 75's: llama4-scout (Llama-4-Scout-17B-16E's text layers: 16 experts top-1 and a shared
expert on each; 4 of its 48 layers: three chunked-attention RoPE layers, one NoPE layer).

    python benchmarks/make_llama1b.py OUT_DIR [--shape llama1b|qwen3b|qwen3-1.7b|...]
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
    "qwen3-1.7b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_bias=False,
    ),
    "qwen3moe-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
    ),
    # Issue 74's: Qwen3.5-35B-A3B's layers (a Gated DeltaNet hybrid), 4 of its 40: three state
    # layers and a gated full-attention one, each MLP 256 experts (8 a token) and a shared one.
    "qwen35moe-a3b": dict(
        architectures=["Qwen3_5MoeForCausalLM"],
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=256,
        num_experts_per_tok=8,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25
        ),
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
    ),
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        experts_per_token=4,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=128,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        attention_bias=True,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=4096,
            truncate=False,
        ),
        initial_context_length=4096,
        max_position_embeddings=131072,
        swiglu_limit=7.0,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    # Llama 4 Scout's text layers (issue 75): 16 experts of 8192, one a token, beside a
    # shared expert, on every layer; 40 query / 8 KV heads of 128 with the qk L2 norm; chunked
    # local attention (8192) on RoPE layers, every fourth layer NoPE and global: 4 of its 48
    # layers here, the real pattern (llama.cpp reads every fourth layer of a GGUF as the NoPE
    # one, and its server stops at its first step on a file with none).
    "llama4-scout": dict(
        architectures=["Llama4ForCausalLM"],
        model_type="llama4_text",
        hidden_size=5120,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        num_hidden_layers=4,
        no_rope_layers=[1, 1, 1, 0],
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        attention_chunk_size=8192,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=16.0,
            low_freq_factor=1.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=10485760,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
}


def tensors(cfg: dict, seed: int):
    """(name, bf16 tensor) of the checkpoint, one at a time (a 3B model's fp32 draw at once
    would want 12 GB)."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg.get("intermediate_size")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    yield "model.embed_tokens.weight", normal(cfg["vocab_size"], hidden)
    # (a hybrid's norms are zero-centred: it multiplies by 1 + weight)
    centred = cfg["model_type"] == "qwen3_5_moe_text"
    yield (
        "model.norm.weight",
        torch.zeros(hidden, dtype=torch.bfloat16) if centred else ones(hidden),
    )
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", normal(cfg["vocab_size"], hidden)
    kind = cfg["model_type"]
    if kind == "qwen3_5_moe_text":
        yield from qwen35_moe_layers(cfg, normal, g)
        return
    if kind == "llama4_text":
        yield from llama4_layers(cfg, normal, ones)
        return
    bias = kind in ("qwen2", "gpt_oss")  # their q/k/v carry biases (gpt-oss's o_proj too)
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
        if kind == "gpt_oss":
            yield p + "self_attn.o_proj.bias", normal(hidden)
            yield p + "self_attn.sinks", normal(heads)
        if kind in ("qwen3", "qwen3_moe"):  # per-head RMSNorm of q and k
            yield p + "self_attn.q_norm.weight", ones(head_dim)
            yield p + "self_attn.k_norm.weight", ones(head_dim)
        if kind == "qwen3_moe":
            yield from qwen3_moe_experts(cfg, p, normal)
        elif kind == "gpt_oss":
            yield from gpt_oss_experts(cfg, p, normal)
        else:
            yield p + "mlp.gate_proj.weight", normal(inter, hidden)
            yield p + "mlp.up_proj.weight", normal(inter, hidden)
            yield p + "mlp.down_proj.weight", normal(hidden, inter)


def qwen3_moe_experts(cfg: dict, p: str, normal):
    """Qwen3-MoE's router and its experts, one tensor per expert and projection."""
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    yield p + "mlp.gate.weight", normal(cfg["num_experts"], hidden)
    for e in range(cfg["num_experts"]):
        q = f"{p}mlp.experts.{e}."
        yield q + "gate_proj.weight", normal(inter, hidden)
        yield q + "up_proj.weight", normal(inter, hidden)
        yield q + "down_proj.weight", normal(hidden, inter)


def qwen35_moe_layers(cfg: dict, normal, g: torch.Generator):
    """Qwen3.5-MoE's layers (after the embedding, final norm and head): its norms are
    zero-centred (the model multiplies by 1 + weight), the state layers' gated norm is not."""
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]  # fmt: skip
    head_dim = cfg["head_dim"]
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_heads = cfg["linear_num_value_heads"]
    value_dim = value_heads * cfg["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.bfloat16)

    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", zeros(hidden)
        yield p + "post_attention_layernorm.weight", zeros(hidden)
        if kind == "linear_attention":
            a = p + "linear_attn."
            yield a + "in_proj_qkv.weight", normal(conv_dim, hidden)
            yield a + "in_proj_z.weight", normal(value_dim, hidden)
            yield a + "in_proj_b.weight", normal(value_heads, hidden)
            yield a + "in_proj_a.weight", normal(value_heads, hidden)
            yield a + "conv1d.weight", normal(conv_dim, 1, cfg["linear_conv_kernel_dim"])
            yield a + "dt_bias", torch.ones(value_heads, dtype=torch.bfloat16)
            decay = torch.empty(value_heads).uniform_(1.0, 16.0, generator=g)
            yield a + "A_log", decay.log().to(torch.bfloat16)
            yield a + "norm.weight", torch.ones(cfg["linear_value_head_dim"], dtype=torch.bfloat16)
            yield a + "out_proj.weight", normal(hidden, value_dim)
        else:
            yield p + "self_attn.q_proj.weight", normal(2 * heads * head_dim, hidden)  # query, gate
            yield p + "self_attn.k_proj.weight", normal(kv_heads * head_dim, hidden)
            yield p + "self_attn.v_proj.weight", normal(kv_heads * head_dim, hidden)
            yield p + "self_attn.o_proj.weight", normal(hidden, heads * head_dim)
            yield p + "self_attn.q_norm.weight", zeros(head_dim)
            yield p + "self_attn.k_norm.weight", zeros(head_dim)
        yield from qwen3_moe_experts(cfg, p, normal)
        shared = cfg["shared_expert_intermediate_size"]
        yield p + "mlp.shared_expert.gate_proj.weight", normal(shared, hidden)
        yield p + "mlp.shared_expert.up_proj.weight", normal(shared, hidden)
        yield p + "mlp.shared_expert.down_proj.weight", normal(hidden, shared)
        yield p + "mlp.shared_expert_gate.weight", normal(1, hidden)


def llama4_layers(cfg: dict, normal, ones):
    """Llama 4's layers as its checkpoint stores them: every layer's experts in two tensors
    (gate and up side by side on the last axis), a router and a shared expert; q and k carry
    no norm weights (their L2 norm has none)."""
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]  # fmt: skip
    head_dim, inter, experts = cfg["head_dim"], cfg["intermediate_size"], cfg["num_local_experts"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", ones(hidden)
        yield p + "post_attention_layernorm.weight", ones(hidden)
        yield p + "self_attn.q_proj.weight", normal(heads * head_dim, hidden)
        yield p + "self_attn.k_proj.weight", normal(kv_heads * head_dim, hidden)
        yield p + "self_attn.v_proj.weight", normal(kv_heads * head_dim, hidden)
        yield p + "self_attn.o_proj.weight", normal(hidden, heads * head_dim)
        f = p + "feed_forward."
        yield f + "router.weight", normal(experts, hidden)
        yield f + "experts.gate_up_proj", normal(experts, hidden, 2 * inter)
        yield f + "experts.down_proj", normal(experts, inter, hidden)
        yield f + "shared_expert.gate_proj.weight", normal(inter, hidden)
        yield f + "shared_expert.up_proj.weight", normal(inter, hidden)
        yield f + "shared_expert.down_proj.weight", normal(hidden, inter)


def gpt_oss_experts(cfg: dict, p: str, normal):
    """gpt-oss's biased router and its experts as the bf16 checkpoint stores them: all experts
    in one tensor, gate and up interleaved along the last axis (llama.cpp's converter splits
    them; llama-quantize's MXFP4_MOE then writes them MXFP4)."""
    hidden, inter, experts = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    yield p + "mlp.router.weight", normal(experts, hidden)
    yield p + "mlp.router.bias", normal(experts)
    yield p + "mlp.experts.gate_up_proj", normal(experts, hidden, 2 * inter)
    yield p + "mlp.experts.gate_up_proj_bias", normal(experts, 2 * inter)
    yield p + "mlp.experts.down_proj", normal(experts, inter, hidden)
    yield p + "mlp.experts.down_proj_bias", normal(experts, hidden)


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
    # One safetensors shard per ~2 GB, as transformers writes them; each written as soon as it
    # fills (a MoE's 5 GB held at once would crowd the machine), renamed -of-N at the end.
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, int] = {}
    size = total = count = 0

    def flush() -> None:
        nonlocal shard, size, count
        count += 1
        save_file(shard, os.path.join(out, f"part-{count}.safetensors"), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, count))
        shard, size = {}, 0

    for tensor_name, tensor in tensors(cfg, seed):
        if size + tensor.nbytes > 2 << 30 and shard:
            flush()
        shard[tensor_name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    flush()
    files = {n: f"model-{n:05d}-of-{count:05d}.safetensors" for n in range(1, count + 1)}
    for n, file in files.items():
        os.replace(os.path.join(out, f"part-{n}.safetensors"), os.path.join(out, file))
    weight_map = {name: files[n] for name, n in index.items()}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    print(f"{out}: {shape}, {total / 1e9:.2f} GB of bf16 weights in {count} shard(s)")


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
