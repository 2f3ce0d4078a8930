"""The peers of benchmarks/pooling_bench.py on the same texts: vLLM's CPU build (its offline
`LLM.embed` and `LLM.score`, run under its own venv's python) and llama-server (the
models converted to F32 GGUFs by llama.cpp's converter; `/v1/embeddings` with every
passage in one request, `/v1/rerank` a query at a time, 8 slots of 2,048-token batches).
Each returns {"embed_s", "rerank_s"}: medians of `runs` runs after a warm-up.

Run as a script, this file is vLLM's side: `VLLM_PYTHON pooling_peers.py TEXTS.json embed|rerank`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

_MARK = "pooling-peers seconds: "
Workload = tuple[list[str], list[tuple[str, list[str]]]]  # passages, (query, documents)


def timed(fn, runs: int) -> float:
    """The median seconds of `runs` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- vLLM -----------------------------------------------------------------------------------
def run_vllm(python: str, embedder: Path, reranker: Path, work: Workload, runs: int) -> dict:
    """vLLM's figures from runs of this file under `python` (vLLM's venv), one process per
    model (a second vLLM engine in one process aborts at its start)."""
    passages, queries = work
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"embedder": str(embedder), "reranker": str(reranker), "runs": runs,
                   "passages": passages, "queries": queries}, f)  # fmt: skip
    threads = f"0-{len(os.sched_getaffinity(0)) - 1}"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=threads)
    figures = {}
    try:
        for task in ("embed", "rerank"):
            done = subprocess.run([python, __file__, f.name, task], env=env,
                                  capture_output=True, text=True, timeout=1800)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(
                    f"vLLM {task} failed ({done.returncode}):\n{done.stderr[-3000:]}"
                )
            # (vLLM logs to stdout too: the figure is the line with the marker)
            line = next(x for x in done.stdout.splitlines() if x.startswith(_MARK))
            figures[f"{task}_s"] = float(line[len(_MARK) :])
    finally:
        os.unlink(f.name)
    return figures


def _vllm_side(texts_file: str, task: str) -> None:
    from vllm import LLM

    spec = json.loads(Path(texts_file).read_text())
    passages, queries, runs = spec["passages"], spec["queries"], spec["runs"]
    if task == "embed":
        llm = LLM(spec["embedder"], runner="pooling", dtype="float32", max_model_len=512)
        seconds = timed(lambda: llm.embed(passages, use_tqdm=False), runs)
    else:
        llm = LLM(spec["reranker"], runner="pooling", dtype="float32", max_model_len=512)
        seconds = timed(lambda: [llm.score(q, docs, use_tqdm=False) for q, docs in queries], runs)
    print(f"{_MARK}{seconds}", flush=True)


# ---- llama-server ---------------------------------------------------------------------------
def to_gguf(model_dir: Path, llama_cpp: Path) -> Path:
    """An F32 GGUF of `model_dir` beside it, made once by llama.cpp's converter. The
    converter names a tokenizer's pre-tokenizer by hashing its output, which knows only
    published tokenizers; a WordPiece vocabulary is split by llama.cpp's own rules anyway,
    so the name is set to its default."""
    out = model_dir.with_suffix(".f32.gguf")
    if out.is_file():
        return out
    script = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']\n"
        "import convert_hf_to_gguf\nfrom conversion import base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'\n"
        "sys.argv = ['convert_hf_to_gguf.py', sys.argv[2], '--outtype', 'f32', '--outfile', sys.argv[3]]\n"
        "convert_hf_to_gguf.main()\n"
    )  # fmt: skip
    subprocess.run([sys.executable, "-c", script, str(llama_cpp), str(model_dir), str(out)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    return out


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())


def _serve(binary: Path, gguf: Path, flags: list[str], port: int) -> subprocess.Popen:
    threads = str(len(os.sched_getaffinity(0)))
    args = [str(binary), "-m", str(gguf), *flags, "-c", "8192", "-b", "2048", "-ub", "2048",
            "-np", "8", "-t", threads, "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    server = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"llama-server did not come up on port {port}")


def run_llama_server(
    binary: Path, llama_cpp: Path, embedder: Path, reranker: Path, work: Workload, runs: int,
    port: int = 8191,
) -> dict:  # fmt: skip
    passages, queries = work
    figures = {}
    server = _serve(
        binary, to_gguf(embedder, llama_cpp), ["--embedding", "--pooling", "mean"], port
    )
    try:
        figures["embed_s"] = timed(lambda: _post(port, "/v1/embeddings", {"input": passages}), runs)
    finally:
        server.kill()
        server.wait()
    server = _serve(binary, to_gguf(reranker, llama_cpp), ["--reranking"], port)
    try:
        rerank = [{"query": q, "documents": docs, "top_n": len(docs)} for q, docs in queries]
        figures["rerank_s"] = timed(lambda: [_post(port, "/v1/rerank", r) for r in rerank], runs)
    finally:
        server.kill()
        server.wait()
    return figures


if __name__ == "__main__":
    _vllm_side(sys.argv[1], sys.argv[2])
