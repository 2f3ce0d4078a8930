"""Soak with images (issue 60): 2,000 chat requests with one or two images each (drawn from
24 distinct pictures, so the encoder cache both fills and hits) at concurrency 16 against
the real multi-process server on a tiny random Gemma 3 vision model. Every request is
bounded by a timeout; every answer equals the offline engine's for its conversation;
afterwards nothing runs and no process's anonymous memory plus swap grew by more than
0.4 KB per request past a warm-up of 500 (after a warm-up of 200 the executor settled
+0.4-0.5 MiB above its warmed-up size whether 1,000 or 4,000 requests followed: a plateau,
not a leak; 2,000 keep it inside the bound, which a leak of 0.5 KB a request would fail)."""

from __future__ import annotations

import asyncio
import base64
import io
import random
import time

import httpx
import pytest
from PIL import Image
from servers import engine_idle, metric, start_server, stop_server, wait_until
from vision_models import png, write_tiny_gemma3_vlm

from zllm import LLM, SamplingParams
from zllm.bench.process_memory import process_memory
from zllm.runtime.heap_trim import IDLE_TRIM_S

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 2000
NUM_WARMUP = 500
CONCURRENCY = 16
NUM_PICTURES = 24
MAX_TOKENS = 3
REQUEST_TIMEOUT_S = 60.0
MEMORY_GROWTH_BOUND_KIB = NUM_REQUESTS * 400 // 1024
QUESTIONS = ["What is this?", "Compare them.", "Describe", "Which colours?"]


def conversation(rng: random.Random) -> tuple[tuple[int, ...], str]:
    """(the pictures' seeds, the question): one or two images, then text."""
    count = rng.choice((1, 2))
    return tuple(rng.sample(range(NUM_PICTURES), count)), rng.choice(QUESTIONS)


def picture_bytes(seed: int) -> bytes:
    return png(seed, (24 + seed, 20 + seed % 7))


def body(seeds: tuple[int, ...], question: str) -> dict:
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                            + base64.b64encode(picture_bytes(s)).decode()}}
        for s in seeds
    ]  # fmt: skip
    parts.append({"type": "text", "text": question})
    return {
        "model": "g3",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def expected_answers(model_dir: str, conversations: set) -> dict:
    """The offline engine's answer to each conversation, all in one batch (as the server's
    answers come from batches of up to 16: the engine's answers do not depend on the batch)."""
    llm = LLM(model_dir, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    keys = sorted(conversations)
    chats = []
    for seeds, question in keys:
        parts: list[dict] = [
            {"type": "image_pil", "image_pil": Image.open(io.BytesIO(picture_bytes(s)))}
            for s in seeds
        ]
        parts.append({"type": "text", "text": question})
        chats.append([{"role": "user", "content": parts}])
    outputs = llm.chat(chats, params, use_tqdm=False)
    return {key: out.outputs[0].text for key, out in zip(keys, outputs, strict=True)}


async def send_all(url: str, plans: list) -> tuple[list[str | None], int]:
    """Each plan's answer text (None: it failed), and how many hung past the timeout."""
    answers: list[str | None] = [None] * len(plans)
    hung = 0
    queue = list(enumerate(plans))
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:

        async def worker() -> None:
            nonlocal hung
            while queue:
                i, (seeds, question) = queue.pop()
                try:
                    r = await client.post("/v1/chat/completions", json=body(seeds, question))
                except httpx.TimeoutException:
                    hung += 1
                    continue
                if r.status_code == 200:
                    answers[i] = r.json()["choices"][0]["message"]["content"]

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return answers, hung


def test_soak_1000_requests_with_images(tmp_path_factory, gemma3_path) -> None:
    path = tmp_path_factory.mktemp("image-soak")
    model_dir = str(write_tiny_gemma3_vlm(path / "model", gemma3_gguf=gemma3_path))
    rng = random.Random(60)
    warmup = [conversation(rng) for _ in range(NUM_WARMUP)]
    plans = [conversation(rng) for _ in range(NUM_REQUESTS)]
    expected = expected_answers(model_dir, set(warmup + plans))

    server = start_server(model_dir, path / "server.log", "--served-model-name", "g3")
    try:
        answers, hung = asyncio.run(send_all(server.url, warmup))
        assert hung == 0 and None not in answers
        children = server.children()
        assert wait_until(lambda: engine_idle(server), 15)
        time.sleep(IDLE_TRIM_S + 2.0)
        watched = {"supervisor": server.proc.pid, **children}
        before = {name: process_memory(pid).total_kib for name, pid in watched.items()}

        start = time.monotonic()
        answers, hung = asyncio.run(send_all(server.url, plans))
        duration = time.monotonic() - start
        assert hung == 0, f"{hung} requests hung"
        wrong = [(p, a) for p, a in zip(plans, answers, strict=True) if a != expected[p]]
        assert not wrong, f"{len(wrong)} answers differ from offline, e.g. {wrong[0]}"
        assert wait_until(lambda: engine_idle(server), 15)
        assert server.children() == children, "a child restarted during the soak"
        time.sleep(IDLE_TRIM_S + 2.0)
        after = {name: process_memory(pid).total_kib for name, pid in watched.items()}
        text = server.get("/metrics").text
        cached = metric(text, "zllm:cache_entries", 'cache="image_encoder"')
    finally:
        stop_server(server)
    print(f"\nimage soak: {NUM_REQUESTS} requests in {duration:.1f} s "
          f"({NUM_REQUESTS / duration:.0f} req/s); {cached} images in the encoder cache")  # fmt: skip
    assert cached == NUM_PICTURES
    for name in sorted(watched):
        growth = after[name] - before[name]
        print(f"  {name:14} anon+swap {before[name] / 1024:7.1f} MiB ({growth / 1024:+.1f} MiB)")
        assert growth < MEMORY_GROWTH_BOUND_KIB, f"{name} grew by {growth / 1024:.1f} MiB"
