"""The Messages API fields Claude Code sends with every request, each doing what it means
here (issue 73): system turns inside `messages`, `thinking` adaptive and `display`,
`output_config` (effort, format), top-level `cache_control`, server tools, the beta route and
headers, and the context overflow in Anthropic's own words (Claude Code reads its numbers to
retry with a smaller max_tokens).

The tiny model's template writes the system prompt, the tools and the reasoning effort it is
given into the prompt, so what a field did shows in the prompt's length; it opens a think
block unless `enable_thinking` is false (DeepSeek-R1's way), and the server that reads
thinking runs the deepseek_r1 parser. Greedy, this model (seed 5) never closes its thinking
within these tests' max_tokens.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re

import jsonschema
import pytest
from tiny_models import write_tiny_model

from zllm.frontend.anthropic.api import MessagesRequest, cache_pin_of
from zllm.text.tokenizer import load_tokenizer

TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if reasoning_effort is defined %}<|im_start|>effort\n{{ reasoning_effort }}<|im_end|>\n"
    "{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
CONTEXT = 2048
USER = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
GREEDY = {"temperature": 0.0}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("claude-code")
    path = write_tiny_model(
        root / "model",
        seed=5,
        chat_template=TEMPLATE,
        extra_tokens=["<think>", "</think>"],
        max_position_embeddings=CONTEXT,
    )
    key_file = root / "signature.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    return path, key_file


@pytest.fixture(scope="module")
def thinking_server(model, engine_pool):
    """The model served with a reasoning parser (thinking blocks)."""
    path, key_file = model
    args = ["--served-model-name", "tiny", "--reasoning-parser", "deepseek_r1"]
    args += ["--thinking-signature-key-file", str(key_file)]
    with engine_pool.serve(str(path), path.parent / "thinking.log", *args) as server:
        yield server


@pytest.fixture(scope="module")
def plain_server(model, engine_pool):
    """The same model with no reasoning parser (as `zllm serve` of the default model)."""
    path, _ = model
    args = ["--served-model-name", "tiny"]
    with engine_pool.serve(str(path), path.parent / "plain.log", *args) as server:
        yield server


def claude_of(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def prompt_tokens(message) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def rendered_length(model, messages, **template_kwargs) -> int:
    tokenizer = load_tokenizer(str(model[0]))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
    return len(tokenizer.encode(text, add_special_tokens=False))


pytestmark = pytest.mark.e2e


def test_system_turns_join_the_system_prompt(model, plain_server) -> None:
    claude = claude_of(plain_server)
    inside = claude.messages.create(
        model="tiny",
        max_tokens=8,
        system="Be brief.",
        messages=[{"role": "system", "content": "Answer in French."}, *USER],
        extra_body=GREEDY,
    )
    merged = claude.messages.create(
        model="tiny",
        max_tokens=8,
        system="Be brief.\n\nAnswer in French.",
        messages=USER,
        extra_body=GREEDY,
    )
    expected = rendered_length(
        model, [{"role": "system", "content": "Be brief.\n\nAnswer in French."}, *USER]
    )
    assert prompt_tokens(inside) == prompt_tokens(merged) == expected
    assert inside.content[0].text == merged.content[0].text
    # A system turn's text blocks, and count_tokens, the same way.
    blocks = [{"type": "text", "text": "Answer in French."}]
    counted = claude.messages.count_tokens(
        model="tiny", system="Be brief.", messages=[{"role": "system", "content": blocks}, *USER]
    )
    assert counted.input_tokens == expected


def test_adaptive_thinking_shows_or_omits_the_thinking(model, thinking_server) -> None:
    claude = claude_of(thinking_server)
    common = dict(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY)
    shown = claude.messages.create(**common, thinking={"type": "adaptive"})
    [block] = shown.content
    assert block.type == "thinking" and block.thinking  # thinking on, never closed in 12
    key = model[1].read_bytes()
    sign = lambda text: base64.b64encode(hmac.new(key, text.encode(), hashlib.sha256).digest())  # noqa: E731
    assert block.signature == sign(block.thinking).decode()

    omitted = claude.messages.create(**common, thinking={"type": "adaptive", "display": "omitted"})
    [block] = omitted.content
    assert block.type == "thinking" and block.thinking == ""
    assert block.signature == sign("").decode()
    assert omitted.usage.output_tokens == shown.usage.output_tokens == 12
    # Streamed: the block opens and closes with its signature, no thinking text.
    with claude.messages.stream(
        **common, thinking={"type": "adaptive", "display": "omitted"}
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
    assert deltas == ["signature_delta"]
    # Sent back in the next turn, the omitted block's signature verifies.
    turns = [*USER, {"role": "assistant", "content": [block.model_dump()]}, *USER]
    again = claude.messages.create(model="tiny", max_tokens=4, messages=turns, extra_body=GREEDY)
    assert again.stop_reason == "max_tokens"


def test_adaptive_thinking_without_a_parser_is_the_templates_default(plain_server) -> None:
    claude = claude_of(plain_server)
    common = dict(model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY)
    seen = len(plain_server.log.read_text())
    adaptive = claude.messages.create(**common, thinking={"type": "adaptive"})
    assert (
        "thinking.adaptive: this server has no --reasoning-parser"
        in (plain_server.log.read_text()[seen:])
    )
    default = claude.messages.create(**common)
    assert [b.type for b in adaptive.content] == ["text"]
    assert adaptive.content[0].text == default.content[0].text
    assert prompt_tokens(adaptive) == prompt_tokens(default)


def test_effort_reaches_the_templates_reasoning_effort(model, plain_server) -> None:
    claude = claude_of(plain_server)
    lengths = {}
    for effort in ("low", "high", "max"):
        message = claude.messages.create(
            model="tiny",
            max_tokens=1,
            messages=USER,
            extra_body={**GREEDY, "output_config": {"effort": effort}},
        )
        lengths[effort] = prompt_tokens(message)
    assert lengths["low"] == rendered_length(model, USER, reasoning_effort="low")
    assert (
        lengths["high"] == lengths["max"] == rendered_length(model, USER, reasoning_effort="high")
    )
    plain = claude.messages.create(model="tiny", max_tokens=1, messages=USER, extra_body=GREEDY)
    assert prompt_tokens(plain) == rendered_length(model, USER) < lengths["low"]


def test_output_format_answers_json_of_the_schema(thinking_server) -> None:
    """output_config.format: structured outputs, after the thinking (the grammar starts
    where the reasoning parser's section ends; a budget closes it here)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    claude = claude_of(thinking_server)
    message = claude.messages.create(
        model="tiny",
        max_tokens=1024 + 300,
        messages=USER,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={
            "temperature": 1.0,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[1].text), schema)


def test_server_tools_are_left_out_of_the_prompt(plain_server) -> None:
    claude = claude_of(plain_server)
    common = dict(model="tiny", max_tokens=1, messages=USER, extra_body=GREEDY)
    hosted = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    seen = len(plain_server.log.read_text())
    both = claude.messages.create(**common, tools=[WEATHER, hosted])
    assert (
        "Leaving out server tools this server cannot run: web_search (web_search_20250305)"
        in (plain_server.log.read_text()[seen:])
    )
    weather = claude.messages.create(**common, tools=[WEATHER])
    plain = claude.messages.create(**common)
    assert prompt_tokens(both) == prompt_tokens(weather) > prompt_tokens(plain)


def test_the_beta_route_and_headers_answer_as_the_plain_route(plain_server) -> None:
    claude = claude_of(plain_server)
    plain = claude.messages.create(model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY)
    # POST /v1/messages?beta=true with anthropic-beta headers, and context_management (its
    # server-side clearing of old tool results: nothing to clear on a self-hosted prompt).
    beta = claude.beta.messages.create(
        model="tiny",
        max_tokens=8,
        messages=USER,
        betas=["context-management-2025-06-27", "interleaved-thinking-2025-05-14"],
        extra_body={**GREEDY, "context_management": {"edits": []}},
    )
    assert beta.content[0].text == plain.content[0].text


def test_a_context_overflow_reads_as_anthropics(plain_server) -> None:
    """Claude Code asks max_tokens 32000 of a model it does not know, and retries with the
    numbers of Anthropic's message; the retry fits."""
    import anthropic

    claude = claude_of(plain_server)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="tiny", max_tokens=32000, messages=USER)
    message = err.value.body["error"]["message"]
    match = re.fullmatch(
        r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+), "
        r"decrease input length or `max_tokens` and try again",
        message,
    )
    assert match, message
    assert err.value.body["error"]["type"] == "invalid_request_error"
    input_tokens, max_tokens, limit = map(int, match.groups())
    assert (max_tokens, limit) == (32000, CONTEXT)
    retry = claude.messages.create(
        model="tiny", max_tokens=limit - input_tokens, messages=USER, extra_body=GREEDY
    )
    assert prompt_tokens(retry) == input_tokens
    # The OpenAI routes keep vLLM's words.
    r = plain_server.post(
        "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": CONTEXT - 2}
    )
    assert r.status_code == 400 and "maximum context length is 2048" in r.json()["error"]["message"]


def test_cache_control_at_the_top_pins_the_whole_prompt() -> None:
    """Anthropic's automatic caching: the pin covers every message (system turns in
    `messages` join the system message, so they add none)."""
    import msgspec

    body = {
        "model": "tiny",
        "max_tokens": 1,
        "system": "Be brief.",
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
        "messages": [
            {"role": "system", "content": "Answer in French."},
            *USER,
            {"role": "assistant", "content": "Oui."},
            *USER,
        ],
    }
    pin = cache_pin_of(msgspec.json.decode(json.dumps(body), type=MessagesRequest))
    assert pin is not None and pin.num_messages == 4 and pin.ttl_s == 3600
    body.pop("cache_control")
    assert cache_pin_of(msgspec.json.decode(json.dumps(body), type=MessagesRequest)) is None
