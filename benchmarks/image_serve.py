"""Image prompts through `zllm serve` against transformers on the same model and inputs
(issue 60): TTFT and output tok/s at concurrency 1 and 8, and the encoder cache (TTFT of a
request whose image was seen before, against first sight).

The model: Gemma3ForConditionalGeneration with random weights at published shapes, the
language model Gemma 3 270M's (18 layers, width 640) and the vision tower SigLIP base's
(12 layers, width 768, 224-pixel images in 16-pixel patches, pooled to 49 tokens an image),
with the real Gemma 3 tokenizer; written once under --model-dir. Every request: a chat turn
with one distinct image and a short question, max_tokens output tokens, greedy. transformers
runs the same processed inputs (the prompt ids zllm built, the processor's pixels) with
`generate` on one thread pool: batch 1, then the 8 prompts as one batch (equal lengths, no
padding). Medians over the runs.

    python benchmarks/image_serve.py [--runs 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from servers import start_server, stop_server  # noqa: E402
from vision_models import png, write_gemma3_vlm_tokenizer  # noqa: E402

from zllm.executor.models.vision.gemma3 import pixel_values  # noqa: E402
from zllm.model.files import resolve_model  # noqa: E402

TEXT = dict(
    vocab_size=262208, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
    max_position_embeddings=32768,
)  # fmt: skip
VISION = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    image_size=224, patch_size=16,
)  # fmt: skip
QUESTION = "Describe this picture in detail."


def write_model(path: Path) -> Path:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=49)
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 224, "width": 224}).save_pretrained(path)
    write_gemma3_vlm_tokenizer(path, resolve_model("gemma3"))
    return path


def image(seed: int) -> bytes:
    return png(seed, (320 + seed, 240))


def chat_body(seed: int, max_tokens: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image(seed)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return {
        "model": "g3", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip


async def one(client: httpx.AsyncClient, seed: int, max_tokens: int) -> tuple[float, float]:
    """(TTFT s, the request's whole time s)."""
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=chat_body(seed, max_tokens)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first is None and '"content"' in line:
                first = time.perf_counter()
    return (first or time.perf_counter()) - start, time.perf_counter() - start


async def zllm_runs(url: str, seeds: list[list[int]], max_tokens: int) -> list[list[tuple]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        results = []
        for batch in seeds:
            results.append(await asyncio.gather(*(one(client, s, max_tokens) for s in batch)))
        return results


def prompt_ids(url: str, seed: int) -> list[int]:
    body = chat_body(seed, 1)
    r = httpx.post(url + "/tokenize", json={"model": "g3", "messages": body["messages"]})
    return r.json()["tokens"]


def hf_runs(model_dir: Path, ids: list[int], seeds: list[int], max_tokens: int) -> tuple:
    """transformers: (TTFT s, total s) for batch 1 of seeds[0]; (TTFT, total) for all seeds
    as one batch."""
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval()

    def run(batch: list[int], new: int) -> float:
        prompt = torch.tensor([ids] * len(batch))
        pixels = pixel_values(str(model_dir), [image(s) for s in batch])
        types = (prompt == 262144).long()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=prompt, pixel_values=pixels, token_type_ids=types,
                attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                do_sample=False,
            )  # fmt: skip
        return time.perf_counter() - start

    run(seeds[:1], 2)  # warm-up
    one_first, one_total = run(seeds[:1], 1), run(seeds[:1], max_tokens)
    many_first, many_total = run(seeds, 1), run(seeds, max_tokens)
    return (one_first, one_total), (many_first, many_total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir", default=str(Path.home() / ".cache/zllm-peers/models/gemma3-vlm-bench")
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    model_dir = write_model(Path(args.model_dir))
    log = Path("/tmp/image_serve.log")
    # Every core for the executor's torch, as transformers gets them below (the test
    # harness's default is one thread).
    threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    server = start_server(str(model_dir), log, "--served-model-name", "g3",
                          "--kv-cache-memory-bytes", "1G", env=threads)  # fmt: skip
    figures: dict = {}
    try:
        ids = prompt_ids(server.url, 0)
        asyncio.run(zllm_runs(server.url, [[1000]], 2))  # warm-up (its own image)
        c1, seen, c8 = [], [], []
        for run in range(args.runs):
            base = 100 * (run + 1)
            c1 += asyncio.run(zllm_runs(server.url, [[base]], args.max_tokens))[0]
            seen += asyncio.run(zllm_runs(server.url, [[base]], args.max_tokens))[0]
            c8.append(asyncio.run(zllm_runs(server.url, [list(range(base + 10, base + 18))], args.max_tokens))[0])  # fmt: skip
    finally:
        stop_server(server)
    n = args.max_tokens
    figures["zllm_c1_ttft_s"] = statistics.median(t for t, _ in c1)
    figures["zllm_c1_tok_s"] = statistics.median(n / total for _, total in c1)
    figures["zllm_seen_ttft_s"] = statistics.median(t for t, _ in seen)
    figures["zllm_c8_ttft_s"] = statistics.median(statistics.median(t for t, _ in r) for r in c8)
    figures["zllm_c8_tok_s"] = statistics.median(8 * n / max(total for _, total in r) for r in c8)
    hf = [
        hf_runs(model_dir, ids, list(range(200 + 10 * r, 208 + 10 * r)), n)
        for r in range(args.runs)
    ]
    figures["hf_c1_ttft_s"] = statistics.median(a[0] for a, _ in hf)
    figures["hf_c1_tok_s"] = statistics.median(n / a[1] for a, _ in hf)
    figures["hf_c8_ttft_s"] = statistics.median(b[0] for _, b in hf)
    figures["hf_c8_tok_s"] = statistics.median(8 * n / b[1] for _, b in hf)
    figures["prompt_tokens"] = len(ids)
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
