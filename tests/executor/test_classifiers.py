"""Sequence-classification models (issue 61): tiny random `Qwen3ForSequenceClassification`
and `LlamaForSequenceClassification` checkpoints (a score head of one row per label in place
of the LM head) run natively as pooling models: `LLM.classify` and vLLM's /classify give each
input's label probabilities equal to transformers' (softmax over the head's logits on the last
token; one label, a sigmoid score); the routes of other tasks refuse them naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pooling_models import write_classifier

from zllm import LLM, SamplingParams

TEXTS = ["a fine day", "the worst film I have seen", "hello", "def add(a, b): return a + b"]
POOL = 32 << 20


def hf_probs(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=0)


@pytest.mark.parametrize(
    ("arch", "labels"), [("qwen3", ["negative", "neutral", "positive"]), ("llama", ["relevant"])]
)
def test_label_probabilities_as_transformers(tmp_path, arch, labels) -> None:
    path = write_classifier(tmp_path / "model", arch, labels)
    llm = LLM(str(path), kv_cache_memory_bytes=POOL, max_num_batched_tokens=8)  # (in chunks)
    assert llm.config.runner == "pooling" and llm.config.pooler.labels == tuple(labels)
    for out in llm.classify(TEXTS, use_tqdm=False):
        expected = hf_probs(path, list(out.prompt_token_ids))
        assert out.outputs.num_classes == len(labels)
        assert torch.allclose(torch.tensor(out.outputs.probs), expected, atol=1e-5)
    with pytest.raises(ValueError, match="a classifier: LLM.classify, not LLM.embed"):
        llm.embed(TEXTS)
    with pytest.raises(ValueError, match="runs as a pooling model"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_model_without_a_head_is_no_classifier(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="LLM.classify needs a sequence-classification model"):
        LLM(tiny_llama_dir, kv_cache_memory_bytes=POOL).classify("hello")


def test_classifiers_zllm_has_no_head_for_are_refused(tmp_path) -> None:
    path = write_classifier(tmp_path / "model", "qwen3", ["a", "b"])
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "starcoder2"}))
    with pytest.raises(
        ValueError, match="zllm runs classifier heads on its own models .* and on encoders"
    ):
        LLM(str(path))


@pytest.mark.e2e
def test_served_classify(engine_pool, tmp_path) -> None:
    path = write_classifier(tmp_path / "model", "qwen3", ["negative", "neutral", "positive"])
    offline = LLM(str(path), kv_cache_memory_bytes=POOL).classify(TEXTS, use_tqdm=False)
    with engine_pool.serve(
        str(path), tmp_path / "server.log", "--served-model-name", "cls"
    ) as server:
        answer = server.post("/classify", {"model": "cls", "input": TEXTS})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["object"] == "list" and body["id"].startswith("classify-")
        for item, out in zip(body["data"], offline, strict=True):
            probs = out.outputs.probs
            assert item["probs"] == pytest.approx(probs, abs=1e-6)
            assert item["label"] == ["negative", "neutral", "positive"][probs.index(max(probs))]
            assert item["num_classes"] == 3
        assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in offline)
        embeddings = server.post("/v1/embeddings", {"model": "cls", "input": "x"})
        assert embeddings.status_code == 400 and "it answers /classify" in embeddings.text
        chat = server.post("/v1/chat/completions", {"model": "cls", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert chat.status_code == 400 and "runs as a pooling model" in chat.text
        assert server.healthy()
