"""Agent programs people point at self-hosted servers, unmodified, against a real `zllm serve`
(issue 73):
- OpenAI's Codex CLI (`codex exec`, npm), Anthropic's Claude Code (`claude -p`, npm) and
  aider (`aider --message`, PyPI, through litellm) at pinned versions (tests/agent_clis.py),
  against the default model served as the README serves it: each completes its turn; Claude Code's first request asks max_tokens 32000 of a
  model it does not know and recovers from the context-overflow 400 as from Anthropic's own,
  and its second run reads its prompt from the prefix cache;
- the OpenAI Agents SDK through both of its model classes (Responses and Chat
  Completions), one run with a tool round trip: the model calls the tool, the SDK runs it and
  sends its output back, and the model answers.

The tiny random model is held to a call on the first turn by `tool_choice: required` (a
grammar); the SDK then resets tool_choice, and the agent's output type (a JSON schema the SDK
sends every turn) holds the answer: a random model would not end a free answer on its own,
and the SDK takes a Responses answer cut by max_output_tokens as an error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Annotated

import agent_clis
import httpx
import pytest
from pydantic import BaseModel, Field
from tool_calls import serve_tools

agents = pytest.importorskip("agents")
from openai import AsyncOpenAI  # noqa: E402


@pytest.fixture(scope="module")
def server(tools_model, engine_pool, tmp_path_factory):
    log = tmp_path_factory.mktemp("agent-clients") / "server.log"
    with serve_tools(engine_pool, tools_model, log) as server:
        yield server


class Answer(BaseModel):
    summary: Annotated[str, Field(max_length=8)]


@pytest.mark.e2e
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_the_agents_sdk_runs_a_tool_round_trip(server, api) -> None:
    agents.set_tracing_disabled(True)  # no export to OpenAI's servers
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    statuses: list[int] = []

    async def record(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    client = AsyncOpenAI(
        base_url=f"{server.url}/v1",
        api_key="none",
        max_retries=0,
        http_client=httpx.AsyncClient(event_hooks={"response": [record]}, timeout=120),
    )
    model_class = {
        "responses": agents.OpenAIResponsesModel,
        "chat_completions": agents.OpenAIChatCompletionsModel,
    }[api]
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the tools you have.",
        tools=[get_weather],
        output_type=Answer,
        model=model_class(model="tiny", openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=120
        ),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=8)
    kinds = [item.type for item in result.new_items]
    # The model called, the SDK ran the tool and sent its output back, the model answered.
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert cities and all(len(city) <= 8 for city in cities)
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, Answer)
    assert len(result.raw_responses) == kinds.count("tool_call_output_item") + 1
    # One request a turn, none refused or failed.
    assert statuses == [200] * len(result.raw_responses), statuses


# ---- the CLIs, against SmolLM2 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path, engine_pool, tmp_path_factory):
    """SmolLM2 as `zllm serve` serves it (no parser flags, its 8,192-token context), with one
    server default: greedy decoding for requests that set no temperature (`--generation-config`
    with a generation_config.json saying so; neither CLI sends one here). A sampled answer of
    the 135M model can run on for thousands of tokens; a greedy one ends in a few dozen."""
    root = tmp_path_factory.mktemp("agent-clis")
    (root / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    args = ["--served-model-name", "smollm2", "--generation-config", str(root)]
    args += ["--kv-cache-memory-bytes", "512M"]  # room for a whole context
    with engine_pool.serve(smollm2_path, root / "server.log", *args) as server:
        yield server


def installed(name: str):
    try:
        return agent_clis.cli(name)
    except agent_clis.CliUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


CODEX_CONFIG = """
model = "smollm2"
model_provider = "zllm"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.zllm]
name = "zllm"
base_url = "{url}/v1"
wire_api = "responses"

[analytics]
enabled = false
"""


@pytest.mark.slow
@pytest.mark.e2e
def test_codex_exec_completes_a_turn(smollm2_server, tmp_path) -> None:
    """Codex sends every turn: include reasoning.encrypted_content, reasoning.summary, a
    namespace tool, web_search, developer messages, tool_choice auto."""
    codex = installed("codex")
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=smollm2_server.url))
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [str(codex), "exec", "--json", "--skip-git-repo-check", "Say hello in one word."],
        cwd=work, env=agent_clis.env_for(home, CODEX_HOME=str(home / ".codex")),
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    assert "turn.failed" not in kinds and kinds[-1] == "turn.completed", kinds
    said = [e["item"] for e in events if e["type"] == "item.completed"]
    assert [i for i in said if i["type"] == "agent_message" and i["text"].strip()], said
    assert events[-1]["usage"]["input_tokens"] > 1000  # its instructions and tools


@pytest.mark.slow
@pytest.mark.e2e
def test_claude_code_completes_a_turn_and_reuses_the_cache(smollm2_server, tmp_path) -> None:
    claude = installed("claude")
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    env = agent_clis.env_for(
        home,
        ANTHROPIC_BASE_URL=smollm2_server.url,
        ANTHROPIC_API_KEY="none",
        ANTHROPIC_MODEL="smollm2",
        ANTHROPIC_SMALL_FAST_MODEL="smollm2",
        ANTHROPIC_DEFAULT_HAIKU_MODEL="smollm2",
    )
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [str(claude), "-p", "Say hello in one word.", "--output-format", "json",
             "--max-turns", "1"],
            cwd=work, env=env, capture_output=True, text=True, timeout=300,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(done.stdout)
        assert result["subtype"] == "success" and not result["is_error"], result
        assert result["result"].strip()
        runs.append(result["usage"])
    assert runs[0]["input_tokens"] > 1000  # its system prompt and tools
    # The second run's prompt starts as the first's did: read from the prefix cache.
    assert runs[1]["cache_read_input_tokens"] > 1000, runs


@pytest.mark.slow
@pytest.mark.e2e
def test_aider_answers_a_message(smollm2_server, tmp_path) -> None:
    """aider through litellm's OpenAI-compatible route (Chat Completions), with a file in
    its chat, one message, no git."""
    aider = installed("aider")
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.py").write_text("print('hi')\n")
    # aider's model list, which it would fetch from GitHub (litellm's) once a day: this one
    # model's entry, so it reaches nothing but the loopback server.
    caches = tmp_path / "home" / ".aider" / "caches"
    caches.mkdir(parents=True)
    entry = {"max_input_tokens": 8192, "max_output_tokens": 4096, "mode": "chat",
             "litellm_provider": "openai"}  # fmt: skip
    (caches / "model_prices_and_context_window.json").write_text(json.dumps({"smollm2": entry}))
    done = subprocess.run(
        [str(aider), "--model", "openai/smollm2",
         "--openai-api-base", f"{smollm2_server.url}/v1", "--openai-api-key", "unused",
         "--message", "Say hello in one word.", "--yes-always", "--no-git",
         "--no-check-update", "--analytics-disable", "--no-show-model-warnings",
         "--no-pretty", "--no-stream", "hello.py"],
        cwd=work, env=agent_clis.env_for(tmp_path / "home"), capture_output=True, text=True,
        timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # litellm's errors (a 4xx or 5xx, a failed connection) print, then aider exits 0.
    assert not re.search(r"Error|Exception|Traceback", out), out
    tokens = re.search(r"Tokens: ([\d,]+) sent, ([\d,]+) received", out)
    assert tokens is not None, out
    sent, received = (int(n.replace(",", "")) for n in tokens.group(1, 2))
    assert sent > 100 and received > 0  # its system prompt and the file; an answer
