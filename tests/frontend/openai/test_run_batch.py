"""`zllm run-batch`: OpenAI's batch file format answered offline through the server's own
app. One output line per request line, in input order; errors only on the malformed lines,
each naming what is wrong; the chat and completions answers equal the offline LLM's greedy
ones for the same bodies, the embeddings its vectors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zllm import LLM, SamplingParams

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The quick brown fox"


def run_batch(model_dir: str, lines: list[str], tmp_path, *extra: str, stdio: bool = False):
    """Run `zllm run-batch` on these lines; returns the output lines, parsed."""
    data = "\n".join(lines) + "\n"
    cmd = [sys.executable, "-m", "zllm.cli", "run-batch", "--model", model_dir,
           "--served-model-name", "tiny", "--kv-cache-memory-bytes", "64M",
           "--no-progress-bar", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if stdio:
        cmd += ["-i", "-", "-o", "-"]
        done = subprocess.run(cmd, input=data, capture_output=True, text=True, env=env,
                              timeout=300)  # fmt: skip
        out = done.stdout
    else:
        (tmp_path / "in.jsonl").write_text(data)
        cmd += ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        out = (tmp_path / "out.jsonl").read_text() if done.returncode == 0 else ""
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in out.splitlines()]


def line(custom_id, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat_body(max_tokens: int = 8) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}


def completion_body(max_tokens: int = 8) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}


EMBED_BODY = {"model": "tiny", "input": ["a red apple", "a green pear"]}


def test_mixed_endpoints_and_malformed_lines(tiny_llama_dir, tmp_path):
    lines = [
        line("chat", "/v1/chat/completions", chat_body()),
        "{not json",
        line("completion", "/v1/completions", completion_body()),
        line("wrong-url", "/v1/images/generations", {"model": "tiny"}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": completion_body()}),
        line("bad-field", "/v1/completions", {**completion_body(), "temperature": "hot"}),
        "",  # blank: no request, no output line
        line("embed", "/v1/embeddings", EMBED_BODY),
        line("get", "/v1/completions", completion_body(), method="GET"),
        line("stream", "/v1/completions", {**completion_body(), "stream": True}),
        line("unknown-model", "/v1/chat/completions", {**chat_body(), "model": "other"}),
    ]
    out = run_batch(tiny_llama_dir, lines, tmp_path, stdio=True)
    assert [o["custom_id"] for o in out] == [
        "chat", None, "completion", "wrong-url", None, "bad-field", "embed", "get", "stream",
        "unknown-model",
    ]  # fmt: skip
    failed = {o["custom_id"] or f"line {i}": o["error"] for i, o in enumerate(out) if o["error"]}
    assert set(failed) == {"line 1", "wrong-url", "line 4", "bad-field", "get", "stream",
                           "unknown-model"}  # fmt: skip
    assert failed["line 1"]["code"] == "invalid_json"
    assert failed["wrong-url"]["code"] == "invalid_url"
    assert "custom_id" in failed["line 4"]["message"]
    assert "POST" in failed["get"]["message"] and "stream" in failed["stream"]["message"]
    by_id = {o["custom_id"]: o for o in out if o["custom_id"]}
    # Refused by the route: its status and OpenAI error body, as the server answers.
    bad = by_id["bad-field"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
    assert by_id["unknown-model"]["response"]["status_code"] == 404
    assert by_id["wrong-url"]["response"] is None
    for o in out:
        assert o["id"].startswith("batch_req_")
        if o["error"] is None:
            assert o["response"]["status_code"] == 200 and o["response"]["request_id"]

    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=64 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    chat = by_id["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion"
    expected = llm.chat(MESSAGES, greedy, use_tqdm=False)[0].outputs[0].text
    assert chat["choices"][0]["message"]["content"] == expected
    completion = by_id["completion"]["response"]["body"]
    assert completion["object"] == "text_completion"
    expected = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
    assert completion["choices"][0]["text"] == expected
    embeddings = by_id["embed"]["response"]["body"]["data"]
    vectors = [e.outputs.embedding for e in llm.embed(EMBED_BODY["input"], use_tqdm=False)]
    for ours, ref in zip(embeddings, vectors, strict=True):
        assert max(abs(a - b) for a, b in zip(ours["embedding"], ref, strict=True)) < 1e-4


def test_a_thousand_lines_give_a_thousand_answers_errors_only_on_the_malformed(
    tiny_llama_dir, tmp_path
):
    """The issue's acceptance: 1,000 lines of mixed endpoints, every 25th malformed."""
    lines, malformed = [], set()
    for i in range(1000):
        kind = i % 3
        if i % 25 == 7:
            malformed.add(str(i))
            lines.append(line(str(i), "/v1/completions", {**completion_body(2), "n": 0}))
        elif kind == 0:
            body = {**chat_body(2), "messages": [{"role": "user", "content": f"item {i}"}]}
            lines.append(line(str(i), "/v1/chat/completions", body))
        elif kind == 1:
            lines.append(line(str(i), "/v1/completions", {**completion_body(2), "prompt": f"n{i}"}))
        else:
            lines.append(line(str(i), "/v1/embeddings", {"model": "tiny", "input": f"e{i}"}))
    out = run_batch(tiny_llama_dir, lines, tmp_path)
    assert [o["custom_id"] for o in out] == [str(i) for i in range(1000)]
    assert {o["custom_id"] for o in out if o["error"]} == malformed
    assert all(o["response"]["status_code"] == 400 for o in out if o["custom_id"] in malformed)
