"""Tool calling's fixtures, for the tests of tools through the chat, responses and schema
routes: two function tools (get_weather, get_time), a Qwen 2.5-style tools template with its
<tool_call> tokens and a tiny model with it, and a tiny model served with a think block and
the deepseek_r1 reasoning parser."""

from __future__ import annotations

from pathlib import Path

from engine_pool import EnginePool
from tiny_models import write_tiny_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]

# Qwen 2.5's layout, in our own words: tools in the system turn, calls as <tool_call> JSON,
# results as <tool_response> in a user turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou can call these tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for call in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>\n{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# DeepSeek-R1's way: the think block opens in the prompt unless `enable_thinking` is false,
# where an empty one is closed (the Anthropic thinking tests, thinking_token_budget's).
SWITCHABLE_THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
CALL_TOKENS = ["<tool_call>", "</tool_call>"]


def write_think_model(path: Path) -> Path:
    """A tiny model whose template opens a think block (conftest's `think_model`)."""
    return write_tiny_model(
        path, chat_template=THINK_TEMPLATE, extra_tokens=["<think>", "</think>"]
    )


def write_tools_model(path: Path) -> Path:
    """A tiny model with the Qwen 2.5-style tools template and its <tool_call> tokens
    (conftest's `tools_model`)."""
    return write_tiny_model(
        path,
        chat_template=TOOLS_TEMPLATE,
        extra_tokens=CALL_TOKENS,
        max_position_embeddings=2048,  # the tools' JSON in byte-level tokens is long
    )


def serve_think(engine_pool: EnginePool, model: Path, log: Path):
    """The think model served with the deepseek_r1 reasoning parser as "tiny", for a `with`
    block (EnginePool.serve)."""
    return engine_pool.serve(
        str(model), log, "--reasoning-parser", "deepseek_r1", "--served-model-name", "tiny"
    )


def serve_tools(engine_pool: EnginePool, model: Path, log: Path):
    """The tools model served with the hermes tool-call parser as "tiny", for a `with` block
    (EnginePool.serve)."""
    return engine_pool.serve(
        str(model), log, "--served-model-name", "tiny", "--tool-call-parser", "hermes"
    )


def allowed_count(matcher, vocab_size: int) -> int:
    """How many tokens a GrammarMatcher allows next (its mask's set bits)."""
    from zllm.executor.requests.structured_output import allocate_bitmask

    mask = allocate_bitmask(1, vocab_size)
    matcher.fill_mask(mask[0])
    return sum(bin(w & 0xFFFFFFFF).count("1") for w in mask[0].tolist())
