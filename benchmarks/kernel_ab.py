"""Two builds of the CPU kernels side by side in one process (issue 20): A/B of a kernel change.

This machine's speed drifts by tens of percent within minutes, so two builds timed in separate
runs cannot be compared; here both are loaded into one process and called alternately, call by
call, on the same inputs. Each SIDE is a git revision (its csrc/ as committed) or a csrc
directory. Sections:

- `types`: `gguf_linear` on each GGUF type at M rows (benchmarks/gguf_types.py's shapes:
  4096 x 640, K-quants 4096 x 1024), median of REPEATS calls per build;
- `logits`: Gemma 3 270M's Q8_0 logits shape (262,144 x 640, 178 MB: read from DRAM);
- `layer`: a model's layer-0 matmuls (attention q/k/v/output, ffn gate/up/down) as its GGUF
  file stores them (`--gguf PATH`), summed per call size: prefill's shapes and types.
- `kquant-float`: each side's `gguf_linear_int8` against the second side's float `gguf_linear`
  on those matrices at prefill row counts (where the integer path stops paying).
- `kquant`: `gguf_linear_int8` (`--quantization gguf-int8`'s csrc/cpu/kquant_int8.h) on one
  Llama-3.2-1B layer's matrices as the decode step calls them (qkv 3072 x 2048, o 2048 x 2048,
  gate/up 16384 x 2048 Q4_K, down 2048 x 8192 Q6_K: a Q4_K_M file's types), random blocks
  with sane fp16 scales; per matrix and the layer summed. With `--gguf PATH`, also every
  Q4_K/Q6_K matrix of that file in turn (one token's matmuls, each streamed from memory).
  $ZLLM_CPU_ISA=avx2 makes a build that has an AVX-512 VNNI variant run its AVX2 code
  (csrc/cpu/cpu_isa.h).
- `f16`: `gguf_linear` on every matrix of a 16-bit GGUF file (`--gguf`, F16) as the decode
  step calls them (q/k/v and gate/up fused, the tied embedding as the logits), once as F16
  and once converted to BF16 (a bf16 checkpoint's rows): one token's matmuls, each streamed
  from memory, beside a torch sum over the same bytes (the read bandwidth the machine gives).

    OMP_NUM_THREADS=2 python benchmarks/kernel_ab.py 7786bdb HEAD --rows 1 2 3 4
    OMP_NUM_THREADS=2 python benchmarks/kernel_ab.py 7786bdb HEAD --section logits
    OMP_NUM_THREADS=2 python benchmarks/kernel_ab.py HEAD~1 HEAD --section layer \
        --gguf ~/.cache/zllm/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --rows 16 128 512
    OMP_NUM_THREADS=2 python benchmarks/kernel_ab.py main HEAD --section kquant --rows 1 2 4 8 16
    OMP_NUM_THREADS=2 python benchmarks/kernel_ab.py main HEAD --section kquant --rows 1 \
        --gguf ~/.cache/zllm-peers/models/llama1b/llama1b-Q4_K_M.gguf --repeats 30
    OMP_NUM_THREADS=2 python benchmarks/kernel_ab.py HEAD csrc --section f16 --rows 1 2 4 \
        --gguf ~/.cache/zllm-peers/models/llama1b/llama1b-F16.gguf --repeats 20

Each side is copied to a temporary directory and built under its own name
(`ZLLM_CSRC_DIR`, cached in ~/.cache/torch_extensions like any build); its pybind classes are
made module-local in the copy, so two builds can be imported at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_types import TYPES, blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def csrc_copy(side: str, into: Path) -> Path:
    """side's csrc/ (a directory, or a git revision's) copied into `into`, pybind classes
    module-local (two builds each registering FusedMatmul globally cannot both import)."""
    if Path(side).is_dir():
        shutil.copytree(side, into)
    else:
        into.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", side, "csrc"], check=True, capture_output=True
        ).stdout
        subprocess.run(
            ["tar", "-x", "-C", str(into), "--strip-components=1"], input=archive, check=True
        )
    ops = into / "cpu" / "ops.cpp"
    ops.write_text(
        re.sub(r'(py::class_<\w+>\(m, "\w+")\)', r"\1, py::module_local())", ops.read_text())
    )
    return into


def build(csrc: Path) -> ModuleType:
    """Build (or find cached) the extension of csrc in a child process, then import it here."""
    code = "from zllm.executor.kernels import cpu; print(cpu.load().__file__)"
    env = {**os.environ, "ZLLM_CSRC_DIR": str(csrc)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, text=True, capture_output=True
    ).stdout
    path = out.strip().splitlines()[-1]
    spec = importlib.util.spec_from_file_location(Path(path).name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alternate(builds: list[ModuleType], call, repeats: int) -> list[float]:
    """Median seconds of `call(build)` per build, the builds called in turn each round."""
    times: list[list[float]] = [[] for _ in builds]
    for _ in range(repeats + 1):  # the first round warms up
        for build_, spent in zip(builds, times, strict=True):
            start = time.perf_counter()
            call(build_)
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent[1:]) for spent in times]


def layer_zero(builds: list[ModuleType], args: argparse.Namespace) -> None:
    """Layer 0's matmuls from args.gguf at each row count, ms per layer summed per build."""
    from gguf import GGUFReader

    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    weights = []
    for tensor in GGUFReader(args.gguf).tensors:
        if tensor.name.removesuffix(".weight") in {f"blk.0.{n}" for n in names}:
            in_features = int(tensor.shape[0])  # gguf lists the contiguous dimension first
            qweight = torch.from_numpy(tensor.data.copy()).view(torch.uint8)
            weights.append((tensor.name, qweight.reshape(int(tensor.shape[1]), -1), in_features,
                            int(tensor.tensor_type)))  # fmt: skip
    print(", ".join(f"{n} {q.shape[0]}x{k} type {t}" for n, q, k, t in weights))
    for m in args.rows:
        inputs = {k: torch.randn(m, k) for _, _, k, _ in weights}

        def call(build: ModuleType, inputs: dict[int, torch.Tensor] = inputs) -> None:
            for _, q, k, t in weights:
                build.gguf_linear(inputs[k], q, t)

        old, new = alternate(builds, call, args.repeats)
        print(f"layer 0, M={m}: {old * 1e3:.3f} / {new * 1e3:.3f} ms ({old / new:.2f}x)")


# (name, output rows, input features, ggml type): Llama-3.2-1B (hidden 2048, MLP 8192, 32 x 64
# query heads, 8 KV heads) as the fused decode step calls it, fused parts concatenated.
LLAMA_1B_LAYER = (
    ("qkv", 3072, 2048, 12),
    ("o", 2048, 2048, 12),
    ("gate_up", 16384, 2048, 12),
    ("down", 2048, 8192, 14),
)


def random_kquant(rows: int, cols: int, ggml_type: int, rng: np.random.Generator) -> torch.Tensor:
    """[rows, bytes per row] of random Q4_K (12) or Q6_K (14) blocks, their fp16 d (and
    Q4_K's dmin) set to small positive values: the kernel's work does not depend on the
    values, only finite scales keep the outputs numbers."""
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    q = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    scale_at = (0, 2) if ggml_type == 12 else (208,)
    for at in scale_at:
        d = rng.uniform(0.5e-3, 1.5e-3, len(q)).astype(np.float16)
        q[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(q.reshape(rows, -1))


def kquant_layer(builds: list[ModuleType], args: argparse.Namespace) -> None:
    """gguf_linear_int8 on LLAMA_1B_LAYER at each row count: ms per call, per matrix and summed."""
    rng = np.random.default_rng(0)
    weights = [(name, random_kquant(n, k, t, rng), k, t) for name, n, k, t in LLAMA_1B_LAYER]
    print("; ".join(f"{name} {q.shape[0]}x{k} type {t}" for name, q, k, t in weights))
    for m in args.rows:
        inputs = {k: torch.randn(m, k) for _, _, k, _ in weights}
        cells = []
        for name, q, k, t in weights:
            old, new = alternate(
                builds,
                lambda b, x=inputs[k], q=q, t=t: b.gguf_linear_int8(x, q, t),
                args.repeats,
            )
            cells.append(f"{name} {old * 1e3:.3f} / {new * 1e3:.3f} ({old / new:.2f}x)")

        def layer(build: ModuleType, inputs: dict[int, torch.Tensor] = inputs) -> None:
            for _, q, k, t in weights:
                build.gguf_linear_int8(inputs[k], q, t)

        old, new = alternate(builds, layer, args.repeats)
        print(f"M={m:2}: layer {old * 1e3:.3f} / {new * 1e3:.3f} ({old / new:.2f}x); "
              + "; ".join(cells), flush=True)  # fmt: skip
    if args.gguf is None:
        return
    from gguf import GGUFReader

    matrices = []
    for tensor in GGUFReader(args.gguf).tensors:
        if int(tensor.tensor_type) in (12, 14):
            qweight = torch.from_numpy(tensor.data.copy()).view(torch.uint8)
            matrices.append((qweight.reshape(int(tensor.shape[1]), -1), int(tensor.shape[0]),
                             int(tensor.tensor_type)))  # fmt: skip
    gigabytes = sum(q.numel() for q, _, _ in matrices) / 1e9
    print(f"{args.gguf.name}: {len(matrices)} Q4_K/Q6_K matrices, {gigabytes * 1e3:.0f} MB")
    for m in args.rows:
        inputs = {k: torch.randn(m, k) for _, k, _ in matrices}

        def token(build: ModuleType, inputs: dict[int, torch.Tensor] = inputs) -> None:
            for q, k, t in matrices:
                build.gguf_linear_int8(inputs[k], q, t)

        old, new = alternate(builds, token, args.repeats)
        print(f"M={m:2}: a token's matmuls {old * 1e3:.2f} / {new * 1e3:.2f} ms "
              f"({old / new:.2f}x; {gigabytes / old:.1f} / {gigabytes / new:.1f} GB/s)", flush=True)  # fmt: skip


def kquant_against_float(builds: list[ModuleType], args: argparse.Namespace) -> None:
    """Each side's gguf_linear_int8 against the second side's float gguf_linear on
    LLAMA_1B_LAYER's matrices, the layer summed, at each row count (prefill sizes: where the
    integer path stops paying, GGUFLinear's int8_max_rows)."""
    rng = np.random.default_rng(0)
    weights = [(random_kquant(n, k, t, rng), k, t) for _, n, k, t in LLAMA_1B_LAYER]
    flops = sum(2 * q.shape[0] * k for q, k, _ in weights)
    for m in args.rows:
        inputs = {k: torch.randn(m, k) for _, k, _ in weights}
        kernels = [b.gguf_linear_int8 for b in builds] + [builds[-1].gguf_linear]

        def call(kernel, inputs: dict[int, torch.Tensor] = inputs) -> None:
            for q, k, t in weights:
                kernel(inputs[k], q, t)

        spent = alternate(kernels, call, max(3, args.repeats // max(1, m // 4)))
        cells = [f"{t * 1e3:.1f} ms ({flops * m / t / 1e9:.0f} GOP/s)" for t in spent]
        print(
            f"M={m:4}: int8 {cells[0]} / int8 {cells[1]} / float {cells[2]}; "
            f"{spent[2] / spent[1]:.2f}x float's speed",
            flush=True,
        )


def sixteen_bit_matrices(path: Path) -> list[tuple[torch.Tensor, int]]:
    """(F16 rows as uint8 [N, 2 K], K) of every matrix of a 16-bit GGUF file in decode order:
    per layer q/k/v fused, o, gate/up fused, down; the token embedding last (the logits). Each
    in torch's own memory, as the engine's fused matrices are."""
    from gguf import GGUFReader

    fused = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up",
             "ffn_up": "gate_up"}  # fmt: skip
    groups: dict[str, list[torch.Tensor]] = {}
    for tensor in GGUFReader(path).tensors:
        if int(tensor.tensor_type) != 1 or len(tensor.shape) != 2:
            continue
        parts = tensor.name.removesuffix(".weight").split(".")
        key = parts[0] if len(parts) == 1 else f"{parts[1]}.{fused.get(parts[2], parts[2])}"
        groups.setdefault(key, []).append(torch.from_numpy(tensor.data).view(torch.uint8))
    order = {"qkv": 0, "attn_output": 1, "gate_up": 2, "ffn_down": 3}

    def rank(key: str) -> tuple[int, int]:
        if "." not in key:
            return (1 << 30, 0)
        layer, part = key.split(".")
        return (int(layer), order[part])

    keys = sorted(groups, key=rank)
    return [(torch.cat(groups[key]), groups[key][0].shape[1] // 2) for key in keys]


def sixteen_bit_token(builds: list[ModuleType], args: argparse.Namespace) -> None:
    """gguf_linear on every matrix of args.gguf (F16), then the same values as BF16, at each
    row count: one token's matmuls per call, ms and GB/s per build."""
    f16 = sixteen_bit_matrices(args.gguf)
    bf16 = [(q.view(torch.float16).to(torch.bfloat16).view(torch.uint8), k) for q, k in f16]
    gigabytes = sum(q.numel() for q, _ in f16) / 1e9
    print(f"{args.gguf.name}: {len(f16)} matmuls a token, {gigabytes * 1e3:.0f} MB")
    as_float = [q.view(torch.float32) for q, _ in f16]
    (read,) = alternate([None], lambda _: [t.sum() for t in as_float], args.repeats)
    print(f"torch sum over the same bytes: {read * 1e3:.2f} ms ({gigabytes / read:.1f} GB/s)")
    for name, ggml_type, matrices in (("F16", 1, f16), ("BF16", 30, bf16)):
        for m in args.rows:
            inputs = {k: torch.randn(m, k) for _, k in matrices}

            def token(build: ModuleType, inputs=inputs, matrices=matrices, t=ggml_type) -> None:
                for q, k in matrices:
                    build.gguf_linear(inputs[k], q, t)

            old, new = alternate(builds, token, args.repeats)
            print(f"{name:4} M={m}: a token's matmuls {old * 1e3:.2f} / {new * 1e3:.2f} ms "
                  f"({old / new:.3f}x; {gigabytes / old:.1f} / {gigabytes / new:.1f} GB/s)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sides", nargs=2, metavar="SIDE", help="git revision or csrc directory")
    parser.add_argument(
        "--section",
        choices=["types", "logits", "layer", "kquant", "kquant-float", "f16"],
        default="types",
    )
    parser.add_argument("--gguf", type=Path, help="the model file (section layer)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        builds = [
            build(csrc_copy(side, Path(tmp) / f"side{i}")) for i, side in enumerate(args.sides)
        ]
    a, b = args.sides
    print(f"threads {torch.get_num_threads()}; ms per call, {a} / {b} (speed-up of {b})")
    if args.section == "layer":
        layer_zero(builds, args)
        return
    if args.section == "kquant":
        kquant_layer(builds, args)
        return
    if args.section == "f16":
        sixteen_bit_token(builds, args)
        return
    if args.section == "kquant-float":
        kquant_against_float(builds, args)
        return
    if args.section == "logits":
        q = torch.randint(0, 256, (262144, 20 * 34), dtype=torch.uint8)
        q.view(262144, 20, 34)[:, :, :2] = torch.tensor([0, 0x20], dtype=torch.uint8)  # d ~ 2^-7
        for m in args.rows:
            x = torch.randn(m, 640)
            old, new = alternate(builds, lambda k, x=x: k.gguf_linear(x, q, 8), args.repeats // 6)
            print(f"logits M={m}: {old * 1e3:.2f} / {new * 1e3:.2f} ({old / new:.2f}x)")
        return
    for ggml_type in TYPES:
        block = GGML_QUANT_SIZES[ggml_type][0]
        cols = 640 if block == 32 else 1024
        q, _ = blocks(4096, cols, ggml_type)
        cells = []
        for m in args.rows:
            x = torch.randn(m, cols)
            old, new = alternate(
                builds, lambda k, x=x, q=q, t=int(ggml_type): k.gguf_linear(x, q, t), args.repeats
            )
            cells.append(f"M={m} {old * 1e3:.3f} / {new * 1e3:.3f} ({old / new:.2f}x)")
        print(f"{ggml_type.name:5} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
