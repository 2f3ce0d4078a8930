"""Image prompts through `zllm serve` against transformers (and, where given, llama-server's
mtmd path) on the same model and inputs (issue 60): TTFT and output tok/s at concurrency 1
and 8, and the encoder cache (TTFT of a request whose image was seen before, against first
sight).

Two models with random weights, written once under --model-dir:
- gemma3 (the default): Gemma3ForConditionalGeneration, the language model Gemma 3 270M's
  shape (18 layers, width 640) and the vision tower SigLIP base's (12 layers, width 768,
  224-pixel images in 16-pixel patches, pooled to 49 tokens an image), the real Gemma 3
  tokenizer. Images 320+seed x 240 (every one resized to 224 x 224).
- qwen2_5_vl: Qwen2_5_VLForConditionalGeneration, the language model Qwen2.5-0.5B's shape
  (24 layers, width 896, 14 heads, 2 KV heads, MLP 4864) over the SmolLM2 vocabulary with
  Qwen's three image tokens (49,280 rows, not Qwen's 151,936: our tokenizer fits it), and
  Qwen2.5-VL's vision encoder at its real shape (--vision-depth layers, 32 by default; width
  1280, 16 heads, MLP 3420, windows of 112 pixels, full attention in blocks 7/15/23/31).
  max_pixels 72,000: each 320 x 240 image is resized to 308 x 224, 22 x 16 patches, 88
  tokens.

Every request: a chat turn with one distinct image and a short question, max_tokens output
tokens, greedy. transformers runs the same processed inputs (the prompt ids zllm built, the
processor's pixels, Qwen's image_grid_thw and mm_token_type_ids) with `generate` on one
thread pool: batch 1, then the 8 prompts as one batch (equal lengths, no padding). With
--llama-server, llama-server serves the model's GGUFs (benchmarks/image_gguf.py writes them)
and gets the same HTTP requests as zllm. Medians over the runs.

    python benchmarks/image_serve.py [--model gemma3|qwen2_5_vl] [--runs 3] [--max-tokens 32]
        [--no-transformers] [--llama-server BIN --gguf TEXT.gguf --mmproj MMPROJ.gguf]
        [--peer-url http://127.0.0.1:PORT --peer-label vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from servers import start_server, stop_server  # noqa: E402
from vision_models import (  # noqa: E402
    QWEN_VL_IMAGE_TOKENS,
    QWEN_VL_TEMPLATE,
    png,
    qwen_vl_tokenizer,
    write_gemma3_vlm_tokenizer,
)

from zllm.model.files import resolve_model  # noqa: E402

GEMMA3_TEXT = dict(
    vocab_size=262208, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
    max_position_embeddings=32768,
)  # fmt: skip
GEMMA3_VISION = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    image_size=224, patch_size=16,
)  # fmt: skip
GEMMA3_IMAGE_TOKEN = 262144
# Qwen2.5-0.5B's decoder over the SmolLM2 vocabulary plus Qwen's image tokens; head_dim 64,
# so M-RoPE's sections (16/24/24 of 64 frequencies in the 128-dim models) are halved.
QWEN_TEXT = dict(
    vocab_size=49280, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
QWEN_VISION = dict(
    hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=896,
    window_size=112, fullatt_block_indexes=[7, 15, 23, 31], patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2,
)  # fmt: skip
QWEN_MAX_PIXELS = 72000  # 320 x 240 -> 308 x 224: 22 x 16 patches, 11 x 8 = 88 tokens
QWEN_IMAGE_PAD = QWEN_VL_IMAGE_TOKENS["<|image_pad|>"]
QUESTION = "Describe this picture in detail."


def write_gemma3(path: Path, vision_depth: int) -> None:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    del vision_depth  # SigLIP base's 12 layers always
    torch.manual_seed(0)
    config = Gemma3Config(
        text_config=GEMMA3_TEXT, vision_config=GEMMA3_VISION, mm_tokens_per_image=49
    )
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 224, "width": 224}).save_pretrained(path)
    write_gemma3_vlm_tokenizer(path, resolve_model("gemma3"))


def write_qwen(path: Path, vision_depth: int) -> None:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    torch.manual_seed(0)
    ids = QWEN_VL_IMAGE_TOKENS
    config = Qwen2_5_VLConfig(
        text_config=QWEN_TEXT,
        vision_config={**QWEN_VISION, "depth": vision_depth},
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        video_token_id=49155,
        tie_word_embeddings=True,
    )
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=QWEN_MAX_PIXELS).save_pretrained(path)
    qwen_vl_tokenizer(resolve_model("smollm2")).backend.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": QWEN_VL_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def gemma3_inputs(model_dir: Path, prompt: torch.Tensor, images: list[bytes]) -> dict:
    from zllm.executor.models.vision.gemma3 import pixel_values

    return {
        "pixel_values": pixel_values(str(model_dir), images),
        "token_type_ids": (prompt == GEMMA3_IMAGE_TOKEN).long(),
    }


def qwen_inputs(model_dir: Path, prompt: torch.Tensor, images: list[bytes]) -> dict:
    import io

    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model_dir)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    processed = processor(images=pictures, return_tensors="pt")
    return {
        "pixel_values": processed["pixel_values"],
        "image_grid_thw": processed["image_grid_thw"],
        "mm_token_type_ids": (prompt == QWEN_IMAGE_PAD).int(),
    }


@dataclass(frozen=True, slots=True)
class Bench:
    """One benchmarked model: how to write it, its images, transformers' class and inputs."""

    served_name: str
    default_dir: str
    write: Callable[[Path, int], None]
    image_size: Callable[[int], tuple[int, int]]
    hf_class: str
    hf_inputs: Callable[[Path, torch.Tensor, list[bytes]], dict]


BENCHES = {
    "gemma3": Bench("g3", "gemma3-vlm-bench", write_gemma3, lambda seed: (320 + seed, 240),
                    "Gemma3ForConditionalGeneration", gemma3_inputs),
    # One size for every image: each takes the same 88 tokens, so transformers' batch of 8
    # needs no padding.
    "qwen2_5_vl": Bench("qvl", "qwen-vl-bench", write_qwen, lambda seed: (320, 240),
                        "Qwen2_5_VLForConditionalGeneration", qwen_inputs),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Answer:
    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int


def chat_body(bench: Bench, seed: int, max_tokens: int) -> dict:
    data = png(seed, bench.image_size(seed))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return {
        "model": bench.served_name, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip


async def one(client: httpx.AsyncClient, body: dict) -> Answer:
    """One streamed chat request; TTFT at the first chunk with non-empty content."""
    start = time.perf_counter()
    first = None
    usage: dict = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or [{}]
            if first is None and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter()
    end = time.perf_counter()
    return Answer(
        (first or end) - start,
        end - start,
        int(usage.get("prompt_tokens", 0)),
        int(usage.get("completion_tokens", 0)),
    )


async def wave(url: str, bench: Bench, seeds: list[int], max_tokens: int) -> list[Answer]:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        bodies = [chat_body(bench, s, max_tokens) for s in seeds]
        return list(await asyncio.gather(*(one(client, b) for b in bodies)))


def serve_runs(url: str, bench: Bench, runs: int, max_tokens: int) -> dict:
    """c=1 (first sight), c=1 (the same image again), c=8 (8 new images at once): medians."""
    asyncio.run(wave(url, bench, [1000], 2))  # warm-up (its own image)
    c1, seen, c8 = [], [], []
    for run in range(runs):
        base = 100 * (run + 1)
        c1 += asyncio.run(wave(url, bench, [base], max_tokens))
        seen += asyncio.run(wave(url, bench, [base], max_tokens))
        c8.append(asyncio.run(wave(url, bench, list(range(base + 10, base + 18)), max_tokens)))
    n = max_tokens
    return {
        "c1_ttft_s": statistics.median(a.ttft_s for a in c1),
        "c1_tok_s": statistics.median(n / a.total_s for a in c1),
        "seen_ttft_s": statistics.median(a.ttft_s for a in seen),
        "c8_ttft_s": statistics.median(statistics.median(a.ttft_s for a in r) for r in c8),
        "c8_tok_s": statistics.median(8 * n / max(a.total_s for a in r) for r in c8),
        "c1_ttft_runs_s": [round(a.ttft_s, 3) for a in c1],
        "c8_wall_runs_s": [round(max(a.total_s for a in r), 2) for r in c8],
        "prompt_tokens": c1[0].prompt_tokens,
        "completion_tokens": sorted({a.completion_tokens for r in c8 for a in r} | {c1[0].completion_tokens}),
    }  # fmt: skip


def prompt_ids(url: str, bench: Bench) -> list[int]:
    body = chat_body(bench, 0, 1)
    r = httpx.post(
        url + "/tokenize", json={"model": bench.served_name, "messages": body["messages"]}
    )
    return r.json()["tokens"]


def zllm_figures(bench: Bench, model_dir: Path, args) -> tuple[dict, list[int]]:
    log = Path(f"/tmp/image_serve_{bench.served_name}.log")
    # Every core for the executor's torch, as transformers gets them below (the test
    # harness's default is one thread).
    threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    server = start_server(str(model_dir), log, "--served-model-name", bench.served_name,
                          "--kv-cache-memory-bytes", "1G", env=threads)  # fmt: skip
    try:
        ids = prompt_ids(server.url, bench)
        return serve_runs(server.url, bench, args.runs, args.max_tokens), ids
    finally:
        stop_server(server)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_figures(bench: Bench, args) -> dict:
    """llama-server -m TEXT --mmproj MMPROJ on every core, 8 slots; the same requests."""
    port = free_port()
    threads = str(torch.get_num_threads())
    cmd = [args.llama_server, "-m", args.gguf, "--mmproj", args.mmproj, "-t", threads,
           "-tb", threads, "-np", "8", "-c", "8192", "--host", "127.0.0.1", "--port", str(port),
           *args.llama_arg]  # fmt: skip
    log = open(f"/tmp/image_serve_llama_{bench.served_name}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server not healthy in 300 s")
            time.sleep(0.5)
        return serve_runs(url, bench, args.runs, args.max_tokens)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def hf_runs(bench: Bench, model_dir: Path, ids: list[int], seeds: list[int], n: int) -> tuple:
    """transformers: (TTFT s, total s) for batch 1 of seeds[0]; (TTFT, total) for all seeds
    as one batch."""
    import transformers

    model = getattr(transformers, bench.hf_class).from_pretrained(model_dir).eval()

    def run(batch: list[int], new: int) -> float:
        prompt = torch.tensor([ids] * len(batch))
        images = [png(s, bench.image_size(s)) for s in batch]
        inputs = bench.hf_inputs(model_dir, prompt, images)
        if hasattr(model.model, "rope_deltas"):
            model.model.rope_deltas = None  # (Qwen keeps the last prompt's here)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), **inputs,
                max_new_tokens=new, min_new_tokens=new, do_sample=False,
            )  # fmt: skip
        return time.perf_counter() - start

    run(seeds[:1], 2)  # warm-up
    one_first, one_total = run(seeds[:1], 1), run(seeds[:1], n)
    many_first, many_total = run(seeds, 1), run(seeds, n)
    return (one_first, one_total), (many_first, many_total)


def hf_figures(bench: Bench, model_dir: Path, ids: list[int], args) -> dict:
    n = args.max_tokens
    hf = [
        hf_runs(bench, model_dir, ids, list(range(200 + 10 * r, 208 + 10 * r)), n)
        for r in range(args.runs)
    ]
    return {
        "c1_ttft_s": statistics.median(a[0] for a, _ in hf),
        "c1_tok_s": statistics.median(n / a[1] for a, _ in hf),
        "c8_ttft_s": statistics.median(b[0] for _, b in hf),
        "c8_tok_s": statistics.median(8 * n / b[1] for _, b in hf),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(BENCHES), default="gemma3")
    parser.add_argument("--model-dir", default=None,
                        help="default ~/.cache/zllm-peers/models/<the model's bench dir>")  # fmt: skip
    parser.add_argument("--vision-depth", type=int, default=32,
                        help="qwen2_5_vl: the encoder's layers when the model is written")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-zllm", action="store_true")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--llama-server", default=None, help="llama-server binary: a peer")
    parser.add_argument("--gguf", default=None, help="the text GGUF for llama-server")
    parser.add_argument("--mmproj", default=None, help="the vision projector GGUF")
    parser.add_argument("--llama-arg", action="append", default=[],
                        help="one more llama-server argument (repeatable)")  # fmt: skip
    parser.add_argument("--peer-url", default=None,
                        help="an OpenAI-compatible server already serving the model under the "
                        "bench's served name (g3 or qvl), e.g. vLLM: measured as a peer")  # fmt: skip
    parser.add_argument("--peer-label", default="peer")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    bench = BENCHES[args.model]
    peers = Path.home() / ".cache/zllm-peers/models"
    model_dir = Path(args.model_dir or peers / bench.default_dir)
    if not (model_dir / "config.json").is_file():
        bench.write(model_dir, args.vision_depth)
    figures: dict = {"model": args.model, "isa": os.environ.get("ZLLM_CPU_ISA", "auto")}
    ids: list[int] = []
    if not args.no_zllm:
        figures["zllm"], ids = zllm_figures(bench, model_dir, args)
        figures["zllm_prompt_ids"] = len(ids)
        print(json.dumps(figures, indent=2), flush=True)
    if args.llama_server:
        figures["llama_server"] = llama_figures(bench, args)
        print(json.dumps(figures, indent=2), flush=True)
    if args.peer_url:
        figures[args.peer_label] = serve_runs(args.peer_url, bench, args.runs, args.max_tokens)
        print(json.dumps(figures, indent=2), flush=True)
    if not args.no_transformers and ids:
        figures["transformers"] = hf_figures(bench, model_dir, ids, args)
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
