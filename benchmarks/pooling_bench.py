"""Pooling models against sentence-transformers on the same model and machine (issue 61):
embeddings of 1,000 passages of 256 tokens (passages a second: zllm's `LLM.embed` against
`SentenceTransformer.encode`), and reranking 100 documents a query (queries a second:
`LLM.score` against `CrossEncoder.predict`).

The models: random weights at all-MiniLM-L6-v2's and cross-encoder/ms-marco-MiniLM-L-6-v2's
shape (BERT: 6 layers, width 384, 12 heads, 1536 inner, a 30,522-token vocabulary), with
tests/pooling_models.py's WordPiece tokenizer (each passage word one token), saved by
sentence-transformers under --model-dir. Both engines on this process's torch threads,
fp32; each figure the median of --runs runs after a warm-up.

    python benchmarks/pooling_bench.py [--runs 3] [--passages 1000] [--queries 10]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from pooling_models import BERT_WORDS, bert_tokenizer  # noqa: E402

from zllm import LLM  # noqa: E402

SHAPE = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
             intermediate_size=1536, max_position_embeddings=512, pad_token_id=0)  # fmt: skip
TOKENIZER_CONFIG = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                    "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": 512}  # fmt: skip


def write_models(folder: Path) -> tuple[Path, Path]:
    """(the embedding model, the cross-encoder), written once."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    embedder, reranker = folder / "minilm-embed", folder / "minilm-rerank"
    if not (embedder / "modules.json").is_file():
        torch.manual_seed(0)
        base = folder / "minilm-base"
        BertModel(BertConfig(**SHAPE)).save_pretrained(base)
        bert_tokenizer().save(str(base / "tokenizer.json"))
        (base / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
        transformer = models.Transformer(str(base), max_seq_length=512)
        modules = [transformer, models.Pooling(384, "mean"), models.Normalize()]
        SentenceTransformer(modules=modules).save(str(embedder))
    if not (reranker / "config.json").is_file():
        torch.manual_seed(1)
        config = BertConfig(**SHAPE, num_labels=1)
        BertForSequenceClassification(config).save_pretrained(reranker)
        bert_tokenizer().save(str(reranker / "tokenizer.json"))
        (reranker / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return embedder, reranker


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(BERT_WORDS) for _ in range(words))


def timed(fn, runs: int) -> float:
    """The median seconds of `runs` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir", default=str(Path.home() / ".cache/zllm-peers/models/pooling")
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--passages", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=10)
    args = parser.parse_args()
    from sentence_transformers import CrossEncoder, SentenceTransformer

    folder = Path(args.model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    embedder, reranker = write_models(folder)
    rng = random.Random(0)
    passages = [text(rng, 254) for _ in range(args.passages)]  # 256 tokens with [CLS], [SEP]
    queries = [(text(rng, 14), [text(rng, 96) for _ in range(100)]) for _ in range(args.queries)]
    figures: dict[str, float] = {}

    st = SentenceTransformer(str(embedder), device="cpu")
    figures["st_embed_s"] = timed(lambda: st.encode(passages, batch_size=32), args.runs)
    llm = LLM(str(embedder), kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=8192,
              max_num_seqs=64)  # fmt: skip
    figures["zllm_embed_s"] = timed(lambda: llm.embed(passages, use_tqdm=False), args.runs)
    ce = CrossEncoder(str(reranker), device="cpu")
    figures["st_rerank_s"] = timed(
        lambda: [ce.predict([(q, d) for d in docs], batch_size=32) for q, docs in queries],
        args.runs,
    )
    llm = LLM(str(reranker), kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=8192,
              max_num_seqs=128)  # fmt: skip
    figures["zllm_rerank_s"] = timed(
        lambda: [llm.score(q, docs, use_tqdm=False) for q, docs in queries], args.runs
    )
    print(json.dumps(figures))
    n, q = args.passages, args.queries
    print(f"embed:  zllm {n / figures['zllm_embed_s']:.1f} passages/s, sentence-transformers "
          f"{n / figures['st_embed_s']:.1f}: {figures['st_embed_s'] / figures['zllm_embed_s']:.2f}x")  # fmt: skip
    print(f"rerank: zllm {q / figures['zllm_rerank_s']:.2f} queries/s, CrossEncoder "
          f"{q / figures['st_rerank_s']:.2f}: {figures['st_rerank_s'] / figures['zllm_rerank_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
