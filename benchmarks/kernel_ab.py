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

    OMP_NUM_THREADS=2 python benchmarks/kernel_ab.py 7786bdb HEAD --rows 1 2 3 4
    OMP_NUM_THREADS=2 python benchmarks/kernel_ab.py 7786bdb HEAD --section logits
    OMP_NUM_THREADS=2 python benchmarks/kernel_ab.py HEAD~1 HEAD --section layer \
        --gguf ~/.cache/zllm/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --rows 16 128 512

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

import torch
from gguf import GGML_QUANT_SIZES

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
    code = "from zllm.executor import cpu_kernels; print(cpu_kernels.load().__file__)"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sides", nargs=2, metavar="SIDE", help="git revision or csrc directory")
    parser.add_argument("--section", choices=["types", "logits", "layer"], default="types")
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
