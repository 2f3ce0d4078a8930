"""`zllm run-batch -i in.jsonl -o out.jsonl`: a file of OpenAI batch requests, answered
offline, as `vllm run-batch` does.

Each input line is one request of OpenAI's batch file format::

    {"custom_id": "a1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and gets one output line, in input order::

    {"id": "batch_req_<hex>", "custom_id": "a1",
     "response": {"status_code": 200, "request_id": "req_<hex>", "body": {...}},
     "error": null}

The engine processes start as under `zllm serve` (`AsyncLLM.start_with`), and every line goes
through the server's own Starlette app (frontend/app.py), called in this process over ASGI:
no socket, no HTTP server. So a body is parsed, checked and answered exactly as the served
route answers it (the same 400s naming the parameter, the same response bodies). A request
the route refuses keeps its `response` (the status and the error body, as OpenAI's batch
output does) and also gets `error` (the error's type and message), so a reader finds every
failed line by `error`. A line that is no request at all (not JSON, no `custom_id`, a
method other than POST, a url other than the three below, `stream: true`) never reaches the
app: `response` is null and `error` says why. Blank lines are skipped.

Lines run concurrently (the engine batches them); a line refused because the frontend's
admission is full (503 with Retry-After) waits for others to finish and goes again.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from zllm.async_llm import AsyncLLM
from zllm.config.serve import ServeConfig
from zllm.frontend.app import build_app
from zllm.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_OVERLOADED_RETRY_S = 0.05  # a line refused by admission tries again after this


class BatchRequest(msgspec.Struct):
    """One input line (OpenAI's batch request object)."""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class BatchResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: Any


class BatchError(msgspec.Struct):
    code: str
    message: str


class BatchOutput(msgspec.Struct):
    """One output line (OpenAI's batch output object); `error` is null on success."""

    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None


class LineError(Exception):
    """An input line that is no request: answered without calling the app."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.custom_id = custom_id


def parse_line(line: str) -> BatchRequest:
    """The request a line holds, or a LineError naming what is wrong with it."""
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError as e:
        raise LineError("invalid_json", f"the line is not JSON: {e}") from None
    custom_id = raw.get("custom_id") if isinstance(raw, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) else None
    try:
        request = msgspec.convert(raw, BatchRequest)
    except msgspec.ValidationError as e:
        raise LineError("invalid_request", f"not a batch request: {e}", custom_id) from None
    if request.method.upper() != "POST":
        message = f"method must be POST, got {request.method!r}"
        raise LineError("invalid_request", message, custom_id)
    if request.url not in BATCH_URLS:
        message = f"url must be one of {', '.join(BATCH_URLS)}; got {request.url!r}"
        raise LineError("invalid_url", message, custom_id)
    if request.body.get("stream"):
        raise LineError("invalid_request", "stream is not supported in a batch", custom_id)
    return request


class BatchRunner:
    """Answers batch lines through the server's app (`build_app`), in this process."""

    def __init__(self, app: Any, api_key: str | None = None, max_in_flight: int = 256) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Lines sent at once, at most: the server's admission limit (a line past it would only
        # come back 503 and be sent again, over and over, taking time from those admitted).
        self._slots = asyncio.Semaphore(max_in_flight)
        transport = httpx.ASGITransport(app=app)
        self.http = httpx.AsyncClient(
            transport=transport, base_url="http://run-batch", headers=headers, timeout=None
        )
        self.in_flight = 0

    async def close(self) -> None:
        await self.http.aclose()

    async def answer(self, line: str) -> BatchOutput:
        output_id = f"batch_req_{uuid.uuid4().hex}"
        try:
            request = parse_line(line)
        except LineError as e:
            return BatchOutput(output_id, e.custom_id, None, BatchError(e.code, str(e)))
        request_id = f"req_{uuid.uuid4().hex}"
        async with self._slots:
            self.in_flight += 1
            try:
                r = await self._post(request, request_id)
            finally:
                self.in_flight -= 1
        body = _json_or_text(r)
        response = BatchResponse(r.status_code, request_id, body)
        return BatchOutput(output_id, request.custom_id, response, _error_of(r.status_code, body))

    async def _post(self, request: BatchRequest, request_id: str) -> httpx.Response:
        headers = {"X-Request-Id": request_id}
        while True:
            r = await self.http.post(request.url, json=request.body, headers=headers)
            # Admission full: other lines hold the room, so this one goes again after them
            # (alone, it is always admitted).
            if r.status_code == 503 and "retry-after" in r.headers and self.in_flight > 1:
                await asyncio.sleep(_OVERLOADED_RETRY_S)
                continue
            return r


def _json_or_text(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def _error_of(status: int, body: Any) -> BatchError | None:
    """A refused request's error (its body's OpenAI error), None for a 200."""
    if status == 200:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return BatchError(str(error.get("type") or status), str(error.get("message", "")))
    return BatchError(str(status), str(body))


async def answer_lines(
    runner: BatchRunner, lines: Sequence[str], out, progress: Any | None = None
) -> int:
    """Answer every line concurrently, writing each output line to `out` as soon as those
    before it are written (input order). Returns how many lines failed."""
    tasks = [asyncio.ensure_future(runner.answer(line)) for line in lines]
    failed = 0
    for task in tasks:  # in input order; the others keep running meanwhile
        output = await task
        failed += output.error is not None
        out.write(msgspec.json.encode(output).decode() + "\n")
        if progress is not None:
            progress.update(1)
    return failed


def read_lines(path: str) -> list[str]:
    """The request lines of `path` ("-": stdin), blank ones left out."""
    if path == "-":
        text = sys.stdin.read()
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    return [line for line in text.splitlines() if line.strip()]


async def run_batch(
    config: ServeConfig, input_path: str, output_path: str, progress: bool = True
) -> int:
    """Start the engine, answer the file's lines into `output_path` ("-": stdout), stop it.
    Returns how many lines failed."""
    lines = read_lines(input_path)
    tokenizer = load_tokenizer(config.engine.tokenizer_path, config.chat_template)
    # Opened before the engine starts: a bad path fails with nothing to stop.
    out = sys.stdout if output_path == "-" else open(output_path, "w", encoding="utf-8")
    llm = await AsyncLLM.start_with(config)
    runner, bar = None, None
    try:  # from here on, whatever fails, the engine's processes are stopped
        api_key = config.api_keys[0] if config.api_keys else None
        app = build_app(config, llm.client, tokenizer)
        runner = BatchRunner(app, api_key, config.max_in_flight)
        bar = _progress_bar(len(lines)) if progress else None
        failed = await answer_lines(runner, lines, out, bar)
    finally:
        if out is not sys.stdout:
            out.close()
        if bar is not None:
            bar.close()
        if runner is not None:
            await runner.close()
        await llm.shutdown()
    logger.info("run-batch: %d lines, %d failed", len(lines), failed)
    return failed


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Running batch", unit="req", dynamic_ncols=True)
