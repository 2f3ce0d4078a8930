"""`GET /metrics` and the request log, against a real `zllm serve` on a tiny random model:
every series exists at 0 from the start, then known requests move each counter and
histogram by exactly what was sent."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import Server, start_server, stop_server

from zllm.frontend.observability.metrics import Metrics
from zllm.protocol import RequestOutputDelta, TokenizeRequest
from zllm.sampling_params import SamplingParams

MODEL = "tiny"
REASONS = ("stop", "length", "abort", "error")
ROLES = ("frontend", "tokenizer", "core", "executor", "detokenizer")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "zllm:executor_busy_seconds_total",
    "zllm:executor_idle_seconds_total",
    "zllm:engine_steps_total",
    "zllm:executor_prepare_seconds_total",
    "zllm:executor_forward_seconds_total",
    "zllm:executor_sample_seconds_total",
    "zllm:core_schedule_seconds_total",
    "zllm:core_output_seconds_total",
)
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
)

# Series whose engine label is "" for a process outside any engine (the frontend's).
KEEP_ENGINE_LABEL = ("zllm:process_up", "zllm:cache_entries", "zllm:cache_capacity")
# The bounded caches every server has from the start: (process, cache, engine).
CACHES = (
    ("frontend", "tenant_prefix_hits", ""),
    ("frontend", "tenant_rate_buckets", ""),
    ("frontend", "tenant_limited_series", ""),
    ("frontend", "ttft_window", ""),
    ("frontend", "itl_window", ""),
    ("frontend", "dashboard_timeline", ""),
    ("frontend", "chat_templates", ""),
    ("frontend", "lora_adapters", ""),
    ("core", "tenant_ledger", "0"),
    ("core", "prefix_pins", "0"),
)

Samples = dict[tuple[str, frozenset], float]


def scrape(server: Server) -> Samples:
    """Every sample of /metrics by (name, labels), with the model label checked and dropped."""
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.endswith("_created"):
                continue
            assert labels.pop("model_name", None) == MODEL, f"{s.name} lacks model_name"
            if "engine" in labels and s.name not in KEEP_ENGINE_LABEL:
                assert labels.pop("engine") == "0", f"{s.name}: one engine, engine 0"
            samples[(s.name, frozenset(labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels or ''} missing from /metrics"
    return samples[key]


def cache_key(name: str, process: str, cache: str, engine: str) -> tuple[str, frozenset]:
    """The key of a zllm:cache_entries / zllm:cache_capacity sample of one cache."""
    labels = {"process": process, "cache": cache, "engine": engine}
    return name, frozenset(labels.items())


def process_up(samples: Samples, role: str) -> float:
    """zllm:process_up of a role's process 0 (a core or executor: of engine 0)."""
    engine = "0" if role in ("core", "executor") else ""
    return value(samples, "zllm:process_up", role=role, index="0", engine=engine)


def wait_for(server: Server, ok: Callable[[Samples], bool], what: str, timeout: float = 10.0):
    """Scrape until `ok` holds: counters from the core arrive with its next heartbeat."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if ok(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"/metrics never showed {what}:\n{server.log_tail()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("metrics") / "server.log"
    srv = start_server(
        tiny_llama_dir,
        log,
        "--served-model-name",
        MODEL,
        # 8 MiB of KV: 1,024 blocks; one worker of each kind is enough here.
        "--kv-cache-memory-bytes",
        "8M",
        "--tokenizer-workers",
        "1",
        "--detokenizer-workers",
        "1",
        "--enable-log-requests",
    )
    yield srv
    stop_server(srv)


@pytest.mark.e2e
def test_every_metric_is_present_at_zero_before_any_request(server):
    samples = scrape(server)
    for name in GAUGES + COUNTERS:
        assert value(samples, name) == 0, name
    for reason in REASONS:
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == 0
    for name in HISTOGRAMS:
        assert value(samples, name + "_count") == 0, name
        assert value(samples, name + "_sum") == 0, name
        assert value(samples, name + "_bucket", le="+Inf") == 0, name
    for role in ROLES:
        assert process_up(samples, role) == 1, role
    assert sum(1 for name, _ in samples if name == "zllm:process_up") == len(ROLES)
    # Each bounded cache with its bound (the core's with its first heartbeat).
    core_caches = cache_key("zllm:cache_entries", *CACHES[-1])
    samples = wait_for(server, lambda s: core_caches in s, "the core's caches")
    for key in CACHES:
        entries = samples[cache_key("zllm:cache_entries", *key)]
        capacity = samples[cache_key("zllm:cache_capacity", *key)]
        assert 0 <= entries <= capacity and capacity > 0, key


@pytest.mark.e2e
def test_counters_and_histograms_match_the_requests_sent(server, tiny_llama_dir):
    vocab = json.loads((Path(tiny_llama_dir) / "config.json").read_text())["vocab_size"]
    url = server.url + "/v1/completions"
    greedy = {"model": MODEL, "temperature": 0.0, "ignore_eos": True}

    def ids(first: int, n: int) -> list[int]:  # distinct first tokens: no shared prefixes
        return [first] + [3 + (first * 7 + i) % (vocab - 3) for i in range(n - 1)]

    long_prompt = ids(100, 40)  # two full blocks and 8 tokens
    with httpx.Client(timeout=60) as c:
        # A, then B: the same 40-token prompt; B finds 32 tokens (2 blocks) cached.
        for _ in range(2):
            r = c.post(url, json={**greedy, "prompt": long_prompt, "max_tokens": 8})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
        # C: two prompts (two engine requests), two samples each, 5 tokens per sample.
        body = {
            "model": MODEL,
            "prompt": [ids(200, 20), ids(300, 12)],
            "max_tokens": 5,
            "n": 2,
            "temperature": 1.0,
            "seed": 7,
            "ignore_eos": True,
        }
        r = c.post(url, json=body)
        assert r.status_code == 200, r.text
        assert [ch["finish_reason"] for ch in r.json()["choices"]] == ["length"] * 4
        # E: every token is a stop token once 3 are out: finished by "stop".
        body = {
            **greedy,
            "prompt": ids(400, 6),
            "max_tokens": 10,
            "min_tokens": 3,
            "stop_token_ids": list(range(vocab)),
        }
        r = c.post(url, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert r.json()["usage"]["completion_tokens"] == 3
        # F: a prompt longer than the model's context is refused (400): it counts nowhere.
        r = c.post(url, json={**greedy, "prompt": ids(50, 600), "max_tokens": 4})
        assert r.status_code == 400, r.text
        # D: a stream whose client leaves after two events: aborted.
        body = {**greedy, "prompt": ids(10, 10), "max_tokens": 490, "stream": True}
        with c.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break

    samples = wait_for(
        server,
        # Every prompt admitted (D's last) and none waiting or running: a heartbeat sent
        # after D was aborted, so the tokens it generated are in.
        lambda s: (
            value(s, "vllm:request_success_total", finished_reason="abort") == 1
            and value(s, "vllm:prompt_tokens_total") == 128
            and value(s, "vllm:num_requests_waiting") == 0
            and value(s, "vllm:num_requests_running") == 0
        ),
        "the aborted stream and every prompt counted",
    )
    # The engine's side, from the heartbeat.
    assert value(samples, "vllm:prompt_tokens_total") == 40 + 40 + 20 + 12 + 6 + 10
    finished_generation = 8 + 8 + 2 * 2 * 5 + 3
    aborted_generation = value(samples, "vllm:generation_tokens_total") - finished_generation
    assert 2 <= aborted_generation < 490  # it streamed two events and was stopped early
    assert value(samples, "vllm:prefix_cache_queries_total") == 128
    assert value(samples, "vllm:prefix_cache_hits_total") == 32
    assert value(samples, "vllm:num_preemptions_total") == 0
    assert value(samples, "vllm:num_requests_waiting") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0
    assert value(samples, "zllm:engine_steps_total") > 0
    assert value(samples, "zllm:executor_busy_seconds_total") > 0
    assert value(samples, "zllm:executor_idle_seconds_total") >= 0
    # The step's parts are inside the step, and each was measured.
    parts = [
        value(samples, f"zllm:executor_{p}_seconds_total") for p in ("prepare", "forward", "sample")
    ]
    assert all(p > 0 for p in parts)
    assert sum(parts) <= value(samples, "zllm:executor_busy_seconds_total")
    assert value(samples, "zllm:core_schedule_seconds_total") > 0
    assert value(samples, "zllm:core_output_seconds_total") > 0
    for role in ROLES:
        assert process_up(samples, role) == 1, role

    # The frontend's side: one observation per engine request (per prompt).
    success = {r: value(samples, "vllm:request_success_total", finished_reason=r) for r in REASONS}
    assert success == {"stop": 1, "length": 4, "abort": 1, "error": 0}
    # TTFT and queue time: every request that got a token (A, B, C0, C1, E, D).
    for name in ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds"):
        assert value(samples, name + "_count") == 6, name
        assert value(samples, name + "_bucket", le="+Inf") == 6, name
    assert value(samples, "vllm:time_to_first_token_seconds_sum") > 0
    # Sizes and e2e: the requests the engine finished (not D, cut off by its client).
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 5
    assert value(samples, "vllm:request_prompt_tokens_count") == 5
    assert value(samples, "vllm:request_prompt_tokens_sum") == 40 + 40 + 20 + 12 + 6
    assert value(samples, "vllm:request_generation_tokens_count") == 5
    assert value(samples, "vllm:request_generation_tokens_sum") == finished_generation
    assert value(samples, "vllm:request_prompt_tokens_bucket", le="50.0") == 5
    assert value(samples, "vllm:request_generation_tokens_bucket", le="5.0") == 1  # E
    # One inter-token latency per token after a sample's first: A 7, B 7, C 2 x 2 x 4, E 2,
    # and D's (at least one, at most what the engine generated for it).
    itl = value(samples, "vllm:inter_token_latency_seconds_count") - (7 + 7 + 16 + 2)
    assert 1 <= itl <= aborted_generation - 1

    # The request log: one text-free line per engine request as it ends.
    lines = re.findall(r"request finished: (.*)", server.log.read_text())
    records = [dict(kv.split("=", 1) for kv in line.split()) for line in lines]
    assert len(records) == 7, lines  # A, B, C0, C1, E, F (rejected) and D
    by_reason = sorted(r["finish_reason"] for r in records)
    assert by_reason == ["abort", "length", "length", "length", "length", "rejected", "stop"]
    a, b = (r for r in records if r["prompt_tokens"] == "40")
    assert (a["generation_tokens"], a["cached_tokens"]) == ("8", "0")
    assert (b["generation_tokens"], b["cached_tokens"]) == ("8", "32")
    for r in records:
        assert set(r) == {
            "id",
            "prompt_tokens",
            "generation_tokens",
            "cached_tokens",
            "ttft_s",
            "e2e_s",
            "queue_s",
            "n",
            "finish_reason",
        }
        assert r["id"].startswith("cmpl-")
        if r["finish_reason"] not in ("abort", "rejected"):
            assert 0 < float(r["ttft_s"]) <= float(r["e2e_s"])


@pytest.mark.e2e
def test_compiled_grammars_show_within_their_bound(server):
    """The executor's compiled grammars (one per distinct grammar) reach /metrics through
    its step outputs and the core's heartbeat, below their bound."""
    url = server.url + "/v1/completions"
    choices = [["yes", "no"], ["red", "green", "blue"], ["up", "down"]]
    with httpx.Client(timeout=60) as c:
        for choice in choices:
            body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 8, "temperature": 1.0}
            r = c.post(url, json={**body, "structured_outputs": {"choice": choice}})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] in choice
    grammars = ("executor", "structured_output_grammars", "0")
    entries = cache_key("zllm:cache_entries", *grammars)
    samples = wait_for(server, lambda s: s.get(entries, 0) >= len(choices), "the grammars")
    assert samples[entries] == len(choices)
    assert samples[entries] <= samples[cache_key("zllm:cache_capacity", *grammars)] == 256
    for key in CACHES:
        assert (
            samples[cache_key("zllm:cache_entries", *key)]
            <= samples[cache_key("zllm:cache_capacity", *key)]
        ), key
    # The requests' latencies filled the frontend's windows (TTFT: one per request at least).
    assert samples[cache_key("zllm:cache_entries", "frontend", "ttft_window", "")] >= 3


# ---- the per-request bookkeeping, without a server -------------------------------------------


class _FakeClient:
    class config:  # noqa: N801 - stands in for a ServeConfig
        class engine:  # noqa: N801
            class scheduler:  # noqa: N801
                max_model_len = 512

            class cache:  # noqa: N801
                block_size = 16
                num_blocks = 64

    stats = None
    engine_stats: dict = {}
    num_engines = 1
    processes: dict = {}
    num_in_flight = 0


def _delta(index: int, tokens: list[int], finish: str | None = None, **kw) -> RequestOutputDelta:
    return RequestOutputDelta("r", index, "", tokens, finish_reason=finish, **kw)


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})


def test_a_trace_counts_samples_tokens_and_reasons():
    metrics = Metrics(_FakeClient(), MODEL)  # type: ignore[arg-type]
    request = TokenizeRequest("r", SamplingParams(n=2, max_tokens=3), prompt="x")
    trace = metrics.track(request)
    metrics.on_output(trace, _delta(1, [5], num_prompt_tokens=9))  # a forked sample first
    metrics.on_output(trace, _delta(0, [6], num_prompt_tokens=9, queue_time_s=0.25))
    metrics.on_output(trace, _delta(0, [7, 8], "length"))  # two tokens in one delta
    metrics.on_output(trace, _delta(1, [9], "stop"))
    metrics.finish(trace, "error")
    assert trace.num_prompt_tokens == 9 and trace.num_generation_tokens == 5
    assert trace.queue_time_s == 0.25  # from sample 0, not the fork
    assert trace.finish_reason == "stop"  # the last sample to finish
    assert sample(metrics, "vllm:inter_token_latency_seconds_count") == 5 - 2
    assert sample(metrics, "vllm:request_generation_tokens_sum") == 5

    # Cut short by the client after one token: an abort, with no size or e2e observation.
    trace = metrics.track(TokenizeRequest("s", SamplingParams(max_tokens=3), prompt="x"))
    metrics.on_output(trace, _delta(0, [1], num_prompt_tokens=4))
    metrics.finish(trace, "abort")
    # Refused before it ran: counts nowhere.
    refused = metrics.track(TokenizeRequest("t", SamplingParams(max_tokens=3), prompt="x"))
    metrics.finish(refused, "rejected")
    assert refused.finish_reason == "rejected"
    success = {r: sample(metrics, "vllm:request_success_total", finished_reason=r) for r in REASONS}
    assert success == {"stop": 1, "length": 0, "abort": 1, "error": 0}
    assert sample(metrics, "vllm:e2e_request_latency_seconds_count") == 1
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 2
    assert "prompt" not in trace.log_line().replace("prompt_tokens", "")
