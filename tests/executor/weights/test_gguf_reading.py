"""executor/weights/gguf_reading.py: `PlainMapGGUFReader` reads what gguf-py's reader reads, and
within `gguf_parsed_once` transformers' GGUF loading parses a file once and builds gguf-py's
tensor-name map once, giving exactly what it gives without it; outside it gguf-py is as it
was. (The suite installs its own session-wide reader, tests/shared_gguf_reader.py, a subclass
of the plain-map one, which the context keeps.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.gguf_reader import GGUFReader as GgufPyReader  # gguf-py's own, whatever is installed
from gguf_files import write_llama_gguf

from zllm.executor.weights.gguf_reading import PlainMapGGUFReader, gguf_parsed_once


@pytest.fixture(scope="module")
def q4k_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reading") / "q4k.gguf"
    write_llama_gguf(path, lambda name: T.Q4_K)
    return path


def test_the_plain_map_reader_reads_gguf_pys_fields_and_tensors(q4k_file) -> None:
    theirs, ours = GgufPyReader(q4k_file), PlainMapGGUFReader(q4k_file)
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        assert ours.fields[name].contents() == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, their in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == their.tensor_type and np.array_equal(mine.data, their.data)


def test_one_reader_a_file_and_one_map_an_architecture_then_gguf_as_before(q4k_file) -> None:
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(q4k_file)
        assert gguf.GGUFReader(str(q4k_file)) is first  # the same file by another spelling
        assert isinstance(first, PlainMapGGUFReader) and first.fields
        with gguf_parsed_once():  # re-entrant: the outer one's readers stay
            assert gguf.GGUFReader(q4k_file) is first
        llama = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(llama, 2) is gguf.get_tensor_name_map(llama, 2)
        assert gguf.get_tensor_name_map(llama, 3) is not gguf.get_tensor_name_map(llama, 2)
    assert gguf.GGUFReader is reader_cls and gguf.get_tensor_name_map is name_map
    with pytest.raises(RuntimeError), gguf_parsed_once():  # restored after an error too
        raise RuntimeError
    assert gguf.GGUFReader is reader_cls and gguf.get_tensor_name_map is name_map


def test_transformers_reads_the_same_config_weights_and_names_within_it(q4k_file) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    from zllm.executor.models.transformers.quant import gguf_names_of

    def read() -> tuple[dict, dict, dict]:
        folder, name = q4k_file.parent, q4k_file.name
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config)
        names = gguf_names_of(model, TensorProcessor(config=config.to_dict()))
        return config.to_dict(), model.state_dict(), names

    plain_config, plain_weights, plain_names = read()
    with gguf_parsed_once():
        config, weights, names = read()
    assert names == plain_names and len(names) == len(plain_weights)
    assert config == plain_config
    assert weights.keys() == plain_weights.keys()
    assert all(weights[k].equal(plain_weights[k]) for k in weights)
