"""Scoring and reranking (issue 61): vLLM's /score, Jina's and Cohere's /rerank and
`LLM.score`, by a cross-encoder (a tiny random `Qwen3ForSequenceClassification` of one
label: each pair one sequence through the tokenizer's pair template, its sigmoid score equal
to transformers'; a tiny BERT cross-encoder equal to sentence-transformers' `CrossEncoder`)
or by an embedding model (the cosine of the two texts' vectors, equal to
sentence-transformers'); encoder classifiers' probabilities; each bad input's 400."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pooling_models import (
    st_vectors,
    write_classifier,
    write_encoder_classifier,
    write_st_model,
)

from zllm import LLM

QUERY = "what keeps keys and values in blocks"
DOCUMENTS = ["paged attention", "a recipe for bread", "the KV cache in blocks of 16 tokens"]
POOL = 32 << 20


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return write_classifier(tmp_path_factory.mktemp("ce") / "model", "qwen3", ["relevant"])


def hf_scores(path, pairs: list[tuple[str, str]]) -> list[float]:
    """transformers: the tokenizer's pair encoding through the classifier, sigmoid."""
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    scores = []
    with torch.inference_mode():
        for a, b in pairs:
            ids = torch.tensor([tokenizer(a, b)["input_ids"]])
            scores.append(float(torch.sigmoid(model(input_ids=ids).logits[0, 0])))
    return scores


def test_cross_encoder_scores_as_transformers(cross_encoder) -> None:
    llm = LLM(str(cross_encoder), kv_cache_memory_bytes=POOL)
    one_to_many = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    expected = hf_scores(cross_encoder, [(QUERY, d) for d in DOCUMENTS])
    assert one_to_many == pytest.approx(expected, abs=1e-5)
    zipped = llm.score(DOCUMENTS[:2], [QUERY, DOCUMENTS[2]], use_tqdm=False)
    expected = hf_scores(cross_encoder, [(DOCUMENTS[0], QUERY), (DOCUMENTS[1], DOCUMENTS[2])])
    assert [o.outputs.score for o in zipped] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="one text against many, or two lists of one length"):
        llm.score(DOCUMENTS[:2], DOCUMENTS)


def test_a_bert_cross_encoder_scores_as_sentence_transformers(tmp_path) -> None:
    """BertForSequenceClassification of one label: the pair as [CLS] a [SEP] b [SEP] with
    segment ids (b's are 1), its head over [CLS] (BERT's pooler, then the classifier)."""
    from sentence_transformers import CrossEncoder

    path = write_encoder_classifier(tmp_path / "ce", "bert", ["relevant"])
    llm = LLM(str(path), kv_cache_memory_bytes=POOL, max_num_batched_tokens=256)
    ours = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    expected = CrossEncoder(str(path), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    assert ours == pytest.approx([float(x) for x in expected], abs=1e-5)


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_encoder_classifiers_as_transformers(tmp_path, arch) -> None:
    from transformers import AutoModelForSequenceClassification

    path = write_encoder_classifier(tmp_path / "cls", arch, ["negative", "neutral", "positive"])
    llm = LLM(str(path), kv_cache_memory_bytes=POOL, max_num_batched_tokens=256)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    for out in llm.classify([QUERY, *DOCUMENTS], use_tqdm=False):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0]
        expected = torch.softmax(logits.float(), dim=0)
        assert torch.allclose(torch.tensor(out.outputs.probs), expected, atol=1e-5)


def test_a_causal_lm_scores_by_two_tokens_as_qwen3_reranker(tmp_path) -> None:
    """vLLM's --hf-overrides for Qwen3-Reranker: a causal LM's LM-head rows of two tokens
    make a one-label classifier whose score is the softmax of the pair's logits at the
    second ("yes" over "no"), on the last token of the pair read as one sequence."""
    from tiny_models import write_tiny_model
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = write_tiny_model(tmp_path / "lm", arch="qwen3")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    no, yes = tokenizer.convert_ids_to_tokens([60, 61])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": [no, yes], "is_original_qwen3_reranker": True}  # fmt: skip
    llm = LLM(str(path), kv_cache_memory_bytes=POOL, hf_overrides=overrides)
    assert llm.config.runner == "pooling"
    ours = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    expected = []
    with torch.inference_mode():
        for doc in DOCUMENTS:
            ids = torch.tensor([tokenizer(QUERY, doc)["input_ids"]])
            logits = model(input_ids=ids).logits[0, -1]
            expected.append(float(torch.softmax(logits[[60, 61]], dim=0)[1]))
    assert ours == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="--hf-overrides: rope_scaling not read"):
        LLM(str(path), hf_overrides={"rope_scaling": {}})


def test_an_embedding_model_scores_by_cosine(tmp_path) -> None:
    path = write_st_model(tmp_path / "emb", "qwen3", "lasttoken", True)
    llm = LLM(str(path), kv_cache_memory_bytes=POOL)
    ours = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    vectors = st_vectors(path, [QUERY, *DOCUMENTS])
    expected = [float(np.dot(vectors[0], v) / np.linalg.norm(vectors[0]) / np.linalg.norm(v))
                for v in vectors[1:]]  # fmt: skip
    assert ours == pytest.approx(expected, abs=1e-4)


@pytest.mark.e2e
def test_served_score_and_rerank(cross_encoder, tiny_llama_dir, engine_pool, tmp_path) -> None:
    expected = hf_scores(cross_encoder, [(QUERY, d) for d in DOCUMENTS])
    with engine_pool.serve(str(cross_encoder), tmp_path / "server.log", "--served-model-name",
                          "ce", "--max-model-len", "48") as server:  # fmt: skip
        for path in ("/score", "/v1/score"):
            answer = server.post(path, {"model": "ce", "text_1": QUERY, "text_2": DOCUMENTS})
            assert answer.status_code == 200, answer.text
            data = answer.json()["data"]
            assert [d["index"] for d in data] == [0, 1, 2]
            assert [d["score"] for d in data] == pytest.approx(expected, abs=1e-5)
        order = sorted(range(3), key=lambda i: -expected[i])
        jina = server.post("/rerank", {"model": "ce", "query": QUERY, "documents": DOCUMENTS,
                                       "top_n": 2}).json()  # fmt: skip
        assert [r["index"] for r in jina["results"]] == order[:2]
        assert [r["document"]["text"] for r in jina["results"]] == [DOCUMENTS[i] for i in order[:2]]
        assert jina["results"][0]["relevance_score"] == pytest.approx(expected[order[0]], abs=1e-5)
        cohere = server.post("/v1/rerank", {"model": "ce", "query": QUERY, "return_documents": False,
                                            "documents": [{"text": d} for d in DOCUMENTS]}).json()  # fmt: skip
        assert [r["index"] for r in cohere["results"]] == order
        assert all("document" not in r for r in cohere["results"])
        assert cohere["usage"]["total_tokens"] > 0

        empty = server.post("/rerank", {"model": "ce", "query": QUERY, "documents": []})
        assert empty.status_code == 400 and "documents must not be empty" in empty.text
        uneven = server.post("/score", {"model": "ce", "text_1": ["a", "b"], "text_2": DOCUMENTS})
        assert uneven.status_code == 400 and "two lists of one length" in uneven.text
        long = server.post("/score", {"model": "ce", "text_1": QUERY, "text_2": "word " * 60})
        assert long.status_code == 400 and "48" in long.text, long.text
        cut = server.post("/score", {"model": "ce", "text_1": QUERY, "text_2": "word " * 60,
                                     "truncate_prompt_tokens": 40})  # fmt: skip
        assert cut.status_code == 200, cut.text
        assert server.healthy()
    with engine_pool.serve(
        tiny_llama_dir, tmp_path / "gen.log", "--served-model-name", "g"
    ) as generator:
        refused = generator.post("/score", {"model": "g", "text_1": "a", "text_2": "b"})
        assert refused.status_code == 400 and "scoring needs a pooling model" in refused.text
