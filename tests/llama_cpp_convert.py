"""llama.cpp's own converter (convert_hf_to_gguf.py), for the tests that load GGUF files as
people get them: a tiny Hugging Face model directory in, a GGUF file out, through the script
users run, not a writer of our own.

The converter ships in the llama-cpp-python sdist (vendor/llama.cpp/), pinned below by version
and hash. `converter_dir` finds it extracted in a cache outside the repository
($ZLLM_LLAMA_CPP_DIR, else ~/.cache/zllm-tests/llama.cpp-<version>), or downloads the sdist
with pip and extracts only what the converter imports: the script, its `conversion` package
and its own `gguf-py` (newer than the installed gguf: run with it first on the path).

The tiny models here have a SentencePiece tokenizer (tokenizer.model), the converter's first
choice for Llama, Mistral, Qwen 2/3 and Phi-3 checkpoints alike. A byte-level BPE tokenizer
(tokenizer.json only) is identified by the hash of its ids on a fixed text, which matches only
the real tokenizers the converter lists: a tiny one trained here would be refused. The Qwen-MoE
and DeepSeek-V2 classes read only such a tokenizer (no SentencePiece path), so for them the
script runs with their set_vocab pointed at the converter's own SentencePiece reader
(SPM_VOCAB_CLASSES): only where the vocabulary comes from changes; the tensors and metadata are
the converter's.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import os
import select
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tiny_models import _CORPUS, randomize_norms_and_biases, tiny_hf_config, tiny_hf_model

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_VENDORED = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
# What convert_hf_to_gguf.py imports (models/ holds only templates and vocabularies that the
# architectures tested here never read), and the released models' chat templates llama.cpp
# keeps for its own tests (models/templates/: the tool-call parsers' tests render them).
_CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# ... and what the tests read beside it: the released models' chat templates llama.cpp keeps
# (the tool-call parsers' tests render them) and its vocabulary test files (a vocabulary-only
# GGUF per pre-tokenizer with texts and llama.cpp's expected ids: the tokenizer's tests).
_TEMPLATES = "models/templates/"
# (llama-vocab.cpp: the pre-tokenizer names its vocabulary loader knows.)
_EXTRAS = (_TEMPLATES, "models/ggml-vocab-", "src/llama-vocab.cpp")
OUTTYPES = ("f32", "f16", "q8_0")

# The SentencePiece tokenizer's ids: unknown, begin and end of sequence, then chat markers.
SPM_VOCAB_SIZE = 400
BOS_ID, EOS_ID = 1, 2
CHAT_MARKERS = ["<|im_start|>", "<|im_end|>"]


def converter_dir() -> Path:
    """The directory holding convert_hf_to_gguf.py, extracted once per machine."""
    default = Path.home() / ".cache" / "zllm-tests" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    root = Path(os.environ.get("ZLLM_LLAMA_CPP_DIR") or default)
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
        sdist = _download_sdist(Path(scratch))
        extracted = Path(scratch) / "extracted"
        _extract_converter(sdist, extracted)
        try:
            extracted.rename(root)  # atomic: a concurrent test worker may have won the race
        except OSError:
            if not (root / "convert_hf_to_gguf.py").is_file():
                raise
    return root


def _extract(sdist: Path, target: Path, wanted: tuple[str, ...]) -> None:
    """The sdist's vendor/llama.cpp files under the `wanted` prefixes, into `target`."""
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            inner = member.name.removeprefix(_VENDORED)
            if inner != member.name and inner.startswith(wanted) and member.isfile():
                member.name = inner
                members.append(member)
        tar.extractall(target, members=members, filter="data")


def chat_template(name: str) -> str:
    """A released model's chat template as llama.cpp's sdist keeps it ("GLM-4.6.jinja")."""
    return sdist_file(_TEMPLATES + name).read_text()


def sdist_file(relative: str) -> Path:
    """A file of the sdist's vendor/llama.cpp beside the converter (one of _EXTRAS),
    extracted on first use (a converter extracted before they were lacks them)."""
    root = converter_dir()
    path = root / relative
    if not path.is_file():
        with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
            extracted = Path(scratch) / "extras"
            _extract(_download_sdist(Path(scratch)), extracted, _EXTRAS)
            for file in extracted.rglob("*"):
                target = root / file.relative_to(extracted)
                if file.is_file() and not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    file.replace(target)
    if not path.is_file():
        raise FileNotFoundError(f"{_SDIST} has no {_VENDORED}{relative}")
    return path


def _download_sdist(directory: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
    cmd += ["--no-binary", ":all:", "--no-deps", "--quiet", "-d", str(directory)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    sdist = directory / _SDIST
    if result.returncode != 0 or not sdist.is_file():
        raise RuntimeError(f"pip download of {_SDIST} failed:\n{result.stderr[-3000:]}")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != _SDIST_SHA256:
        raise RuntimeError(f"{_SDIST} has sha256 {digest}, expected {_SDIST_SHA256}")
    return sdist


def _extract_converter(sdist: Path, target: Path) -> None:
    _extract(sdist, target, (*_CONVERTER_FILES, *_EXTRAS))
    if not (target / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{_SDIST} has no {_VENDORED}convert_hf_to_gguf.py")


# Checkpoint architectures whose converter class has no SentencePiece path -> (module of
# conversion/, class) whose set_vocab the tests point at _set_vocab_sentencepiece.
SPM_VOCAB_CLASSES = {
    "Qwen2MoeForCausalLM": ("qwen", "Qwen2MoeModel"),
    "Qwen3MoeForCausalLM": ("qwen", "Qwen2MoeModel"),  # (Qwen3MoeModel's defers to it)
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2Model"),  # (a DeepSeek tokenizer's hash only)
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV2Model"),  # (its class is V2's)
    "GptOssForCausalLM": ("gpt_oss", "GptOssModel"),  # (reads o200k's BPE only)
    # Qwen3-Next's class, and Qwen3.5's and Qwen3.5-MoE's below it (a Qwen tokenizer's BPE)
    "Qwen3NextForCausalLM": ("qwen", "Qwen3NextModel"),
    "Qwen3_5ForCausalLM": ("qwen", "Qwen3NextModel"),
    "Qwen3_5MoeForCausalLM": ("qwen", "Qwen3NextModel"),
    "NemotronHForCausalLM": ("nemotron", "NemotronHModel"),  # (reads a BPE tokenizer only)
    "Olmo2ForCausalLM": ("olmo", "Olmo2Model"),  # (TextModel's default: a BPE tokenizer)
    "Olmo3ForCausalLM": ("olmo", "Olmo2Model"),
    "Glm4MoeForCausalLM": ("glm", "Glm4MoeModel"),  # (a GLM tokenizer's BPE only)
    "MiniMaxM2ForCausalLM": ("minimax", "MiniMaxM2Model"),  # (TextModel's BPE default)
    "Llama4ForCausalLM": ("llama", "Llama4Model"),  # (reads a BPE tokenizer only)
}


def convert_hf_to_gguf(model_dir: Path, outfile: Path, outtype: str) -> Path:
    """`python convert_hf_to_gguf.py MODEL_DIR --outfile F --outtype T`, as a user runs it
    (in this test process's converter process: see _Converter)."""
    return convert_many([(model_dir, outfile, outtype)])[0]


def convert_many(jobs: list[tuple[Path, Path, str]]) -> list[Path]:
    """convert_hf_to_gguf for each (model_dir, outfile, outtype)."""
    global _converter
    for _, _, outtype in jobs:
        if outtype not in OUTTYPES:
            raise ValueError(f"outtype {outtype!r} is not one of {OUTTYPES}")
    for model_dir, outfile, outtype in jobs:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures")
        patch = SPM_VOCAB_CLASSES.get((architectures or [""])[0])
        if _converter is None or _converter.proc.poll() is not None:
            _converter = _Converter()
        _converter.convert(model_dir, outfile, outtype, patch)
    return [f for _, f, _ in jobs]


# The converter's imports (torch, transformers, its classes) cost seconds of CPU, once a
# process: a test process's conversions all run in one converter process, which runs the script
# once a model (runpy, as `python convert_hf_to_gguf.py` runs it), each SPM_VOCAB_CLASSES patch
# undone after its model. Jobs come as JSON lines on its stdin; each one's result (null, or
# the traceback) goes back as a JSON line on the stdout it started with, while everything the
# script prints goes to its stderr, a log file.
_SERVE_JOBS = """
import importlib, json, os, runpy, sys, traceback
root = sys.argv[1]
sys.path.insert(0, root)
script = f"{root}/convert_hf_to_gguf.py"
results = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
for line in sys.stdin:
    model_dir, outfile, outtype, patch = json.loads(line)
    converter = original = None
    error = None
    try:
        if patch is not None:
            converter = getattr(importlib.import_module(f"conversion.{patch[0]}"), patch[1])
            original = converter.__dict__.get("set_vocab")
            converter.set_vocab = lambda self: self._set_vocab_sentencepiece()
        sys.argv = [script, model_dir, "--outfile", outfile, "--outtype", outtype]
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        error = None if e.code in (None, 0) else f"exit status {e.code}"
    except BaseException:
        error = traceback.format_exc()
    finally:
        if converter is not None:
            if original is None:
                del converter.set_vocab
            else:
                converter.set_vocab = original
    results.write(json.dumps(error) + "\\n")
"""
CONVERT_TIMEOUT_S = 300


class _Converter:
    def __init__(self) -> None:
        root = converter_dir()
        env = {**os.environ, "PYTHONPATH": str(root / "gguf-py"), "OMP_NUM_THREADS": "1"}
        self.log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-c", _SERVE_JOBS, str(root)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env
        )
        atexit.register(self.close)

    def convert(self, model_dir: Path, outfile: Path, outtype: str, patch) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = [str(model_dir), str(outfile), outtype, patch]
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], CONVERT_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if not line:  # it died, or took too long
            self.close()
            what = "timed out" if not ready else f"exited with {self.proc.returncode}"
            raise RuntimeError(f"converting {model_dir} {what}:\n{self.log_tail()}")
        error = json.loads(line)
        if error is not None or not outfile.is_file():
            raise RuntimeError(f"converting {model_dir} failed:\n{error}\n{self.log_tail()}")

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_converter: _Converter | None = None


def write_spm_tokenizer(directory: Path) -> None:
    """tokenizer.model: a SentencePiece BPE with byte fallback trained on tiny_models' corpus
    (ids 0-2 <unk>, <s>, </s>; the chat markers whole), and the tokenizer_config.json a Llama
    checkpoint has beside it."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 20),
        model_writer=model,
        vocab_size=SPM_VOCAB_SIZE,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=CHAT_MARKERS,
        num_threads=1,
        minloglevel=2,
    )
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    tokenizer_config = {
        "tokenizer_class": "LlamaTokenizer",  # Phi-3's converter reads it
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def write_convertible_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A tiny random `arch` model (tiny_models.tiny_hf_config with `overrides`) in Hugging Face
    layout with norms drawn away from one, and a SentencePiece tokenizer: what the converter
    takes."""
    path.mkdir(parents=True, exist_ok=True)
    write_spm_tokenizer(path)
    ids = dict(vocab_size=SPM_VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    config = tiny_hf_config(arch, **{**ids, **overrides})
    tiny_hf_model(config, seed).save_pretrained(path, safe_serialization=True)
    return randomize_norms_and_biases(path, seed)


def rounded_as_stored(name: str, weight, tiled_heads: tuple[int, int, int] | None = None):
    """What llama.cpp's converter stores of a checkpoint tensor at Q8_0, read back as fp32:
    matrices in Q8_0 blocks along their rows; the routers, the conv and vectors kept F32. A
    Qwen3.5 file's out_proj has its columns in llama.cpp's tiled value-head order
    (`tiled_heads`: key heads, value heads per key head, value head size), so it is rounded
    in that order."""
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf import dequantize, quantize

    routers = ("mlp.gate.weight", "_gate.weight", "router.layer.weight")
    if weight.dim() < 2 or "conv1d" in name or name.endswith(routers):
        return weight
    tiled = tiled_heads is not None and name.endswith("out_proj.weight")
    if tiled:
        weight = weight.view(weight.shape[0], *tiled_heads).transpose(1, 2).reshape(weight.shape)
    rows = weight.reshape(-1, weight.shape[-1]).numpy()
    out = torch.from_numpy(dequantize(quantize(rows, T.Q8_0), T.Q8_0).reshape(weight.shape))
    if tiled:
        groups, per_group, size = tiled_heads
        out = out.view(out.shape[0], per_group, groups, size).transpose(1, 2).reshape(out.shape)
    return out
