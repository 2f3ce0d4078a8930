"""Embedding models as sentence-transformers writes them (issue 61): tiny random decoders
(Qwen3, Llama) saved with sentence-transformers' modules (Pooling: last token, mean or CLS;
Normalize or not; a default instruction prompt; Matryoshka dimensions in config.json). zllm
reads the pooling from the files and its vectors equal sentence-transformers' `encode` on the
same model (cosine above 0.9999, and the same norms); --pooler-config overrides the files;
/v1/embeddings' `dimensions` gives a Matryoshka model's shorter vector and is refused for
others; a module zllm does not run is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pooling_models import assert_same_vectors, st_vectors, write_st_encoder, write_st_model

from zllm import LLM, PoolingParams
from zllm.errors import ParamError
from zllm.model.family import Trait
from zllm.model.registry import family_of

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps keys and values in blocks",
    "hello",
    "def add(a, b): return a + b",
]
POOL = 32 << 20
PROMPT = "Instruct: find the passage\nQuery: "


def embed(llm: LLM, texts: list[str], **kwargs) -> list[list[float]]:
    return [out.outputs.embedding for out in llm.embed(texts, use_tqdm=False, **kwargs)]


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory) -> Path:
    """Qwen3-Embedding's shape of module: last-token pooling, normalised, a query prompt
    every input gets by default, Matryoshka sizes."""
    path = tmp_path_factory.mktemp("st") / "qwen3-embedding"
    return write_st_model(
        path, "qwen3", "lasttoken", True,
        prompts={"query": PROMPT, "document": ""}, default_prompt_name="query",
        matryoshka_dimensions=[16, 32],
    )  # fmt: skip


def test_last_token_pooling_with_a_prompt_as_sentence_transformers(qwen3_embedding) -> None:
    llm = LLM(str(qwen3_embedding), kv_cache_memory_bytes=POOL)
    assert llm.config.pooler.source == "sentence-transformers"
    assert (llm.config.pooler.pooling, llm.config.pooler.prompt) == ("last", PROMPT)
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert_same_vectors([o.outputs.embedding for o in outs], st_vectors(qwen3_embedding, TEXTS))
    prefix = len(llm.tokenizer.encode(PROMPT, add_special_tokens=False))
    assert len(outs[2].prompt_token_ids) > prefix  # (the instruction went in first)
    short = embed(llm, TEXTS, pooling_params=PoolingParams(dimensions=16))
    expected = st_vectors(qwen3_embedding, TEXTS, truncate_dim=16, normalize_embeddings=True)
    assert_same_vectors(short, expected)
    with pytest.raises(ValueError, match="dimensions: 20 is not one of \\[16, 32\\]"):
        llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=20))


@pytest.mark.parametrize(("arch", "mode", "normalize"), [("llama", "mean", False), ("llama", "cls", True), ("qwen3", "mean", True)])  # fmt: skip
def test_mean_and_cls_pooling_as_sentence_transformers(tmp_path, arch, mode, normalize) -> None:
    path = write_st_model(tmp_path / "model", arch, mode, normalize)
    llm = LLM(str(path), kv_cache_memory_bytes=POOL, max_num_batched_tokens=8)  # (in chunks)
    assert (llm.config.pooler.pooling, llm.config.pooler.normalize) == (
        {"mean": "mean", "cls": "cls"}[mode],
        normalize,
    )
    assert_same_vectors(embed(llm, TEXTS), st_vectors(path, TEXTS))


def test_the_pooler_config_flag_overrides_the_files(tmp_path) -> None:
    mean = write_st_model(tmp_path / "mean", "llama", "mean", True)
    cls_raw = write_st_model(tmp_path / "cls", "llama", "cls", False)
    flag = '{"pooling_type": "CLS", "normalize": false}'
    llm = LLM(str(mean), kv_cache_memory_bytes=POOL, pooler_config=flag)
    assert llm.config.pooler.source == "--pooler-config"
    # (both folders hold the same random weights: write_tiny_model's seed)
    assert_same_vectors(embed(llm, TEXTS), st_vectors(cls_raw, TEXTS))
    with pytest.raises(ValueError, match="pooling_type 'STEP' is not one of MEAN, LAST, CLS"):
        LLM(str(mean), pooler_config='{"pooling_type": "STEP"}')
    with pytest.raises(ValueError, match="softmax not read"):
        LLM(str(mean), pooler_config='{"softmax": true}')


def test_a_base_model_checkpoint_runs_as_a_pooling_model(qwen3_embedding, tiny_llama_dir) -> None:
    """sentence-transformers saves the decoder without its LM head: --runner auto makes it a
    pooling model, which refuses generation naming why (a causal LM stays a generator, and
    pools for /v1/embeddings as ever)."""
    from zllm import SamplingParams

    llm = LLM(str(qwen3_embedding), kv_cache_memory_bytes=POOL)
    assert llm.config.runner == "pooling" and not llm.config.arch.lm_head
    with pytest.raises(ValueError, match="runs as a pooling model"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(embed(llm, TEXTS[:1])[0]) == 64  # (and it still embeds)
    with pytest.raises(ValueError, match="--runner generate: .* has no language-model head"):
        LLM(str(qwen3_embedding), runner="generate")
    causal = LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL)
    assert causal.config.runner == "generate"


def test_older_pooling_files_and_matryoshka_flags(tmp_path) -> None:
    """sentence-transformers before 6 (the Hub's checkpoints) wrote one pooling_mode_<mode>
    flag per mode; `is_matryoshka` lets a request ask any size, and a model with neither
    refuses `dimensions`."""
    path = write_st_model(tmp_path / "old", "llama", "lasttoken", True)
    old_style = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                 "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}  # fmt: skip
    (path / "1_Pooling" / "config.json").write_text(json.dumps(old_style))
    llm = LLM(str(path), kv_cache_memory_bytes=POOL)
    assert llm.config.pooler.pooling == "last"
    assert_same_vectors(embed(llm, TEXTS), st_vectors(path, TEXTS))
    with pytest.raises(ValueError, match="not a Matryoshka model"):
        llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=16))
    del llm
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    llm = LLM(str(path), kv_cache_memory_bytes=POOL)
    short = embed(llm, TEXTS, pooling_params=PoolingParams(dimensions=24))
    assert_same_vectors(short, st_vectors(path, TEXTS, truncate_dim=24, normalize_embeddings=True))


def test_the_runner_follows_the_class_names(tmp_path) -> None:
    """GPT-2's `GPT2LMHeadModel` generates though it ends in "Model"; `Qwen3Model` pools."""
    from zllm.config.pooler import runner_of
    from zllm.model.arch_config import ModelArchConfig

    arch = ModelArchConfig("gpt2", "transformers", 10, 8, 8, 1, 1, 1, 8, 1e-5, 1e4, 64, False)
    for names, runner in ((["GPT2LMHeadModel"], "generate"), (["Qwen3Model"], "pooling"),
                          (["LlamaForCausalLM"], "generate"), ([], "generate")):  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps({"architectures": names}))
        assert runner_of("auto", str(tmp_path), arch) == runner, names


@pytest.mark.parametrize(("arch", "mode"), [("bert", "mean"), ("roberta", "cls"), ("modernbert", "mean")])  # fmt: skip
def test_encoders_as_sentence_transformers(tmp_path, arch, mode) -> None:
    """BERT, RoBERTa and ModernBERT (tiny, random, a WordPiece tokenizer's [CLS] ... [SEP])
    on the transformers backend: every token attends to its whole prompt (ModernBERT's local
    layers within their 8-token window, which the longer texts pass), each prompt computed in
    one step beside others (RoBERTa's positions past its padding index)."""
    path = write_st_encoder(tmp_path / "model", arch, mode, True)
    llm = LLM(str(path), kv_cache_memory_bytes=POOL, max_num_batched_tokens=256)
    assert family_of(llm.config.arch).has(Trait.ENCODER) and llm.config.runner == "pooling"
    assert llm.config.model_impl == "transformers"
    assert_same_vectors(embed(llm, TEXTS), st_vectors(path, TEXTS))
    with pytest.raises(ValueError, match="computes each prompt in one step, up to --max-model-len"):
        LLM(str(path), max_num_batched_tokens=64)


def test_an_encoders_prompt_is_never_cut_into_chunks() -> None:
    from zllm.core.request import Request
    from zllm.sampling_params import SamplingParams

    req = Request("a", list(range(40)), SamplingParams(max_tokens=1, embed=True), whole_prompt=True)
    assert req.chunk_end(0, 40) == 40
    assert req.chunk_end(0, 39) == 0  # (a later step with room for all 40 takes it)


def test_modules_zllm_does_not_run_are_refused(tmp_path) -> None:
    path = write_st_model(tmp_path / "dense", "llama", "mean", True)
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="sentence-transformers module Dense \\(2_Dense\\)"):
        LLM(str(path))
    pooling = path / "1_Pooling" / "config.json"
    (path / "modules.json").write_text(json.dumps([m for m in modules if m["path"] != "2_Dense"]))
    pooling.write_text(json.dumps({"embedding_dimension": 64, "pooling_mode": "max"}))
    with pytest.raises(ValueError, match="pooling \\['max'\\]: zllm pools by one of"):
        LLM(str(path))


@pytest.mark.e2e
def test_served_embeddings_as_offline(qwen3_embedding, engine_pool, tmp_path) -> None:
    """The OpenAI client: floats and base64, a batch, token-id inputs, `dimensions`; a model
    without Matryoshka sizes refuses `dimensions` with a 400."""
    import openai

    llm = LLM(str(qwen3_embedding), kv_cache_memory_bytes=POOL)
    offline = embed(llm, TEXTS)
    short = embed(llm, TEXTS[:2], pooling_params=PoolingParams(dimensions=32))
    ids = llm.tokenizer.encode(TEXTS[1], add_special_tokens=False)
    by_ids = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding
    del llm
    with engine_pool.serve(
        str(qwen3_embedding), tmp_path / "server.log", "--served-model-name", "emb"
    ) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        floats = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
        assert_same_vectors([d.embedding for d in floats.data], np.asarray(offline))
        packed = client.embeddings.create(model="emb", input=TEXTS)  # (base64 by default)
        assert_same_vectors([d.embedding for d in packed.data], np.asarray(offline))
        sized = client.embeddings.create(model="emb", input=TEXTS[:2], dimensions=32)
        assert_same_vectors([d.embedding for d in sized.data], np.asarray(short))
        tokens = client.embeddings.create(model="emb", input=[ids], encoding_format="float")
        assert_same_vectors([tokens.data[0].embedding], np.asarray([by_ids]))
        bad = server.post("/v1/embeddings", {"model": "emb", "input": "x", "dimensions": 20})
        assert bad.status_code == 400 and "dimensions: 20 is not one of" in bad.text
        chat = server.post("/v1/chat/completions", {"model": "emb", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert chat.status_code == 400 and "runs as a pooling model" in chat.text
        classify = server.post("/classify", {"model": "emb", "input": "x"})
        assert classify.status_code == 400 and "no sequence-classification head" in classify.text
        assert server.healthy()


def test_the_context_is_sentence_transformers_max_seq_length(tmp_path) -> None:
    """A sentence-transformers model takes inputs as long as sentence-transformers does (its
    max_seq_length: sentence-transformers 6 keeps it as tokenizer_config.json's
    model_max_length, older versions in sentence_bert_config.json), as vLLM reads it: an
    input of exactly that length embeds as sentence-transformers embeds it, a longer one is
    refused naming both lengths."""
    from sentence_transformers import SentenceTransformer

    path = write_st_encoder(tmp_path / "model", "bert", "mean", True)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"model_max_length": 16}))  # fmt: skip
    assert SentenceTransformer(str(path), device="cpu").max_seq_length == 16
    llm = LLM(str(path), kv_cache_memory_bytes=POOL, max_num_batched_tokens=256)
    assert llm.config.scheduler.max_model_len == 16
    fits = " ".join(["hello"] * 14)  # [CLS], 14 words, [SEP]
    assert_same_vectors(embed(llm, [fits]), st_vectors(path, [fits]))
    with pytest.raises(ParamError, match="context length is 16 tokens. However, you requested 17"):
        embed(llm, [fits + " world"])
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 12, "do_lower_case": False}))  # fmt: skip
    assert SentenceTransformer(str(path), device="cpu").max_seq_length == 12
    llm = LLM(str(path), kv_cache_memory_bytes=POOL, max_num_batched_tokens=256)
    assert llm.config.scheduler.max_model_len == 12


def test_a_prompt_may_fill_a_decoders_context_when_pooled(qwen3_embedding) -> None:
    """An embedding samples nothing, so its prompt may take every position (a generation
    request needs one free); one token more is refused."""
    llm = LLM(str(qwen3_embedding), kv_cache_memory_bytes=POOL, max_model_len=24)
    ids = llm.tokenizer.encode(" ".join(["hello"] * 40), add_special_tokens=False)[:24]
    assert len(embed(llm, [{"prompt_token_ids": ids}])[0]) == 64
    with pytest.raises(ParamError, match="context length is 24 tokens. However, you requested 25"):
        embed(llm, [{"prompt_token_ids": ids + ids[:1]}])


@pytest.mark.parametrize(("mode", "pooling"), [("lasttoken", "last"), ("mean", "mean")])
def test_a_gguf_of_an_embedding_model_pools_as_its_converter_wrote(tmp_path, mode, pooling) -> None:
    """llama.cpp's converter writes a sentence-transformers model's Pooling module into the
    GGUF (`qwen3.pooling_type`): the file runs as a pooling model by that mode, and its
    vectors equal sentence-transformers' on the checkpoint it was converted from."""
    from llama_cpp_convert import convert_hf_to_gguf, write_convertible_model

    model_dir = write_convertible_model(tmp_path / "hf", "qwen3")
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config | {"pad_token": "</s>"})
    )  # fmt: skip (batches are padded)
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (model_dir / "1_Pooling").mkdir()
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    pooling_config = {"embedding_dimension": hidden, "pooling_mode": mode}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    gguf = convert_hf_to_gguf(model_dir, tmp_path / "model-f32.gguf", "f32")
    llm = LLM(str(gguf), kv_cache_memory_bytes=POOL)
    assert llm.config.runner == "pooling"
    assert (llm.config.pooler.pooling, llm.config.pooler.source) == (pooling, "qwen3.pooling_type")
    assert_same_vectors(embed(llm, TEXTS), st_vectors(model_dir, TEXTS))


def test_a_gguf_pooling_type_zllm_does_not_run_is_refused(tmp_path) -> None:
    """llama.cpp's rank pooling (a reranker's head in the GGUF) is refused naming the field."""
    from gguf import GGUFWriter, PoolingType

    from zllm.config.pooler import gguf_pooling

    path = tmp_path / "reranker.gguf"
    writer = GGUFWriter(str(path), "qwen3")
    writer.add_pooling_type(PoolingType.RANK)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"qwen3.pooling_type 4 \(rank: a reranker's head"):
        gguf_pooling(str(path))
