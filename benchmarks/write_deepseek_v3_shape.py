"""DeepSeek-V3's layers as a Q4_K_M GGUF file written directly, with random blocks.

The other shapes go HF bf16 directory -> llama.cpp's converter -> F16 -> llama-quantize
(benchmarks/make_llama1b.py, compare.sh). DeepSeek-V3's MoE layer is 11.3 billion values (256
experts of 3 x 7168 x 2048): 22.5 GB in bf16 and 15 GB in fp32 inside llama-quantize, per
layer, which a 23 GB machine cannot hold. Speed depends on shapes and block types, not
values, so this writes the quantized file itself:

- metadata: llama.cpp's converter run with --vocab-only on the shape's config.json (every
  hyper-parameter key it writes for DeepSeek-V3, and SmolLM2's vocabulary as the other shapes
  have), file type Q4_K_M;
- tensors: the names, layouts and types llama-quantize gives a 3-layer deepseek2 file at
  Q4_K_M (llama.cpp's src/llama-quant.cpp): Q4_K, and Q6_K for output.weight and for the
  ffn_down tensors of the layers its use_more_bits rule picks (with 3 layers: the last);
  attn_k_b's 128-value rows fall back to Q5_0; norms, the router and its score bias F32;
- blocks: random bytes with each block's scale set so values spread like a trained model's
  (std ~0.02), the router normal with std 0.02, norms 1, score biases 0.

Real layer shapes: hidden 7168, 128 heads of MLA (q_lora 1536, kv_lora 512, 128 + 64 key
dims, 128 value dims), dense MLP 18432, 256 experts of 2048 (8 a token, 4 of 8 groups) and a
shared expert; `--layers 3 --dense 1`: one dense layer then two MoE layers (14.5 GB).

    python benchmarks/write_deepseek_v3_shape.py OUT.gguf [--layers 3] [--dense 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import numpy as np

# DeepSeek-V3's config.json, its layer count aside (--layers, --dense).
CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    topk_method="noaux_tc",
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    hidden_act="silu",
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4096,
    ),
    tie_word_embeddings=False,
    attention_bias=False,
)

Q4_K, Q6_K, Q5_0, F32 = "Q4_K", "Q6_K", "Q5_0", "F32"
# (values per block, bytes per block, byte offset of the fp16 scale d, d for std ~0.02)
# Q4_K: d * sc * q - dmin * m, sc and m 6-bit, q 4-bit (dmin = 7.5 d centres it);
# Q6_K: d * sc * (q - 32), sc int8; Q5_0: d * (q - 16).
BLOCKS = {Q4_K: (256, 144, 0, 1.4e-4), Q6_K: (256, 210, 208, 1.5e-5), Q5_0: (32, 22, 0, 2e-3)}
FILE_TYPE_Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quant.cpp's rule for which layers' ffn_down (and attn_v) get Q6_K at Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(cfg: dict, vocab: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape as ggml's ne: innermost first, type) of every tensor, in the order
    llama.cpp's converter writes them."""
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    experts, expert_ff = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    yield "output.weight", (hidden, vocab), Q6_K
    yield "token_embd.weight", (hidden, vocab), Q4_K
    for i in range(layers):
        p = f"blk.{i}."
        down = Q6_K if use_more_bits(i, layers) else Q4_K
        yield p + "attn_norm.weight", (hidden,), F32
        if i < cfg["first_k_dense_replace"]:
            ff = cfg["intermediate_size"]
            yield p + "ffn_down.weight", (ff, hidden), down
            yield p + "ffn_gate.weight", (hidden, ff), Q4_K
            yield p + "ffn_up.weight", (hidden, ff), Q4_K
        else:
            shared = expert_ff * cfg["n_shared_experts"]
            yield p + "ffn_down_exps.weight", (expert_ff, hidden, experts), down
            yield p + "ffn_gate_exps.weight", (hidden, expert_ff, experts), Q4_K
            yield p + "ffn_up_exps.weight", (hidden, expert_ff, experts), Q4_K
            yield p + "exp_probs_b.bias", (experts,), F32
            yield p + "ffn_gate_inp.weight", (hidden, experts), F32
            yield p + "ffn_down_shexp.weight", (shared, hidden), down
            yield p + "ffn_gate_shexp.weight", (hidden, shared), Q4_K
            yield p + "ffn_up_shexp.weight", (hidden, shared), Q4_K
        yield p + "ffn_norm.weight", (hidden,), F32
        yield p + "attn_kv_a_norm.weight", (kv_lora,), F32
        yield p + "attn_kv_a_mqa.weight", (hidden, kv_lora + rope), Q4_K
        yield p + "attn_k_b.weight", (nope, kv_lora, heads), Q5_0  # (128-value rows: no Q4_K)
        yield p + "attn_v_b.weight", (kv_lora, v, heads), Q4_K
        yield p + "attn_output.weight", (heads * v, hidden), Q4_K
        yield p + "attn_q_a_norm.weight", (q_lora,), F32
        yield p + "attn_q_a.weight", (hidden, q_lora), Q4_K
        yield p + "attn_q_b.weight", (q_lora, heads * (nope + rope)), Q4_K
    yield "output_norm.weight", (hidden,), F32


def random_blocks(kind: str, values: int, rng: np.random.Generator) -> np.ndarray:
    """`values` values of a block type as random blocks (uint8 [blocks, bytes]), every
    block's fp16 scale d set (and Q4_K's dmin)."""
    per_block, nbytes, d_at, d = BLOCKS[kind]
    if values % per_block:
        raise ValueError(f"{values} values are not whole {kind} blocks")
    blocks = rng.integers(0, 256, size=(values // per_block, nbytes), dtype=np.uint8)
    blocks[:, d_at : d_at + 2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    if kind == Q4_K:
        blocks[:, 2:4] = np.frombuffer(np.float16(7.5 * d).tobytes(), dtype=np.uint8)
    return blocks


def float_values(name: str, count: int, rng: np.random.Generator) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(count, dtype=np.float32)
    if name.endswith("exp_probs_b.bias"):
        return np.zeros(count, dtype=np.float32)
    return rng.normal(0.0, 0.02, count).astype(np.float32)  # the router


def metadata(cfg: dict, llama_cpp: str, tokenizer_gguf: str, work: str) -> tuple[list, int]:
    """The converter's --vocab-only output for this config: its key-values as (key, value,
    type, array element type), read before `work` goes, and the vocabulary's size."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(tokenizer_gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(work)
    cfg = dict(cfg, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id)
    cfg["eos_token_id"] = tokenizer.eos_token_id
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    out = os.path.join(work, "meta.gguf")
    env = dict(os.environ, PYTHONPATH=os.path.join(llama_cpp, "gguf-py"))
    converter = os.path.join(llama_cpp, "convert_hf_to_gguf.py")
    subprocess.run(
        [sys.executable, converter, work, "--vocab-only", "--outfile", out],
        check=True,
        env=env,
        capture_output=True,
    )
    import gguf

    fields = [
        (key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
        for key, field in gguf.GGUFReader(out).fields.items()
    ]
    return fields, len(tokenizer)


def write(out: str, layers: int, dense: int, llama_cpp: str, tokenizer_gguf: str) -> None:
    cfg = dict(CONFIG, num_hidden_layers=layers, first_k_dense_replace=dense)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as work:
        fields, vocab = metadata(cfg, llama_cpp, tokenizer_gguf, work)
    import gguf

    writer = gguf.GGUFWriter(out + ".tmp", "deepseek2")
    for key, value, value_type, sub_type in fields:
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # (the writer's own)
        value = FILE_TYPE_Q4_K_M if key == "general.file_type" else value
        writer.add_key_value(key, value, value_type, sub_type)
    plan = list(tensor_plan(cfg, vocab))
    for name, ne, kind in plan:
        count = int(np.prod(ne))
        if kind == F32:
            writer.add_tensor_info(name, ne[::-1], np.dtype(np.float32), 4 * count)
        else:
            per_block, nbytes, _, _ = BLOCKS[kind]
            raw = gguf.GGMLQuantizationType[kind]
            byte_shape = (*ne[:0:-1], ne[0] // per_block * nbytes)  # (gguf-py: rows of bytes)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), count // per_block * nbytes, raw
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = 0
    for name, ne, kind in plan:
        count = int(np.prod(ne))
        data = float_values(name, count, rng) if kind == F32 else random_blocks(kind, count, rng)
        writer.write_tensor_data(data)
        total += data.nbytes
        print(f"{name:32s} {kind:5s} {'x'.join(map(str, ne)):>20s} {data.nbytes / 1e6:10.1f} MB")
    writer.close()
    os.replace(out + ".tmp", out)
    print(f"{out}: {layers} layers ({dense} dense), {total / 1e9:.2f} GB of tensors")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dense", type=int, default=1, help="leading dense layers")
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree")
    parser.add_argument("--tokenizer-gguf", default=None, help="default: SmolLM2's GGUF")
    args = parser.parse_args()
    gguf_path = args.tokenizer_gguf
    if gguf_path is None:
        from zllm.model.files import resolve_model

        gguf_path = resolve_model("smollm2")
    write(args.out, args.layers, args.dense, args.llama_cpp, gguf_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
