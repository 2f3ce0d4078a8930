"""Tool calls in a model's own words, turned into OpenAI tool calls (`--tool-call-parser`).

    hermes       Hermes, Qwen 2.5 and Qwen 3: free text, then one or more
                 `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks
                 ("parameters" is accepted for "arguments").
    llama3_json  Llama 3.1 / 3.2: the whole message is the call(s) when it starts (after an
                 optional `<|python_tag|>`) with `{`: `{"name": ..., "parameters": {...}}`,
                 several separated by `;`. Anything else is content.
    mistral      Mistral: `[TOOL_CALLS]` then a JSON list of calls, or `name{...}` /
                 `name[ARGS]{...}` (mistral.py).
    pythonic     Llama 3.2 / Llama 4 (also `llama4_pythonic`): `[f(x=1), g(y="a")]`, read
                 with `ast` (pythonic.py); `llama4_json` is llama3_json's, as vLLM names it.
    qwen3_xml    Qwen3-Coder: `<tool_call><function=f><parameter=x>1</parameter>...` with
                 values read by the tool's schema (qwen3_xml.py).
    deepseek_v3  DeepSeek-V3.1 (also `deepseek_v31`) and V3's older fenced form:
                 `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...`
    kimi_k2      Kimi K2: `<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}`
                 inside `<|tool_calls_section_begin|>`, the model's id kept
    glm45        GLM-4.5/4.6/4.7 (also `glm47`): `<tool_call>f` then `<arg_key>` /
                 `<arg_value>` pairs, values typed by the tool's schema
    minimax_m2   MiniMax-M2: `<minimax:tool_call><invoke name="f"><parameter name="x">...`
    gemma4       Gemma 4: `<|tool_call>call:f{city:<|"|>Paris<|"|>,days:3}<tool_call|>`, its
                 own notation read into JSON (gemma4.py)
                 (the five share sections.py: each call goes out whole at its end tag)
    openai       gpt-oss: harmony's `<|channel|>commentary to=functions.f ...<|message|>{...}`
                 (harmony.py), which gives the analysis channel as reasoning too;
                 the same parser as --reasoning-parser openai_gptoss.

Every parser is made with the request's tools (OpenAI's shape; qwen3_xml reads their
parameter schemas, the others ignore them).

A parser is fed the generated text chunk by chunk (`feed`, then `finish`) and returns what
each chunk adds: `content`, and `ToolCallDelta`s with OpenAI's streaming semantics (the first
delta of a call carries its id and name; the arguments' JSON text follows in pieces). The
pieces of a call's arguments concatenate to exactly the JSON text of its arguments object;
`parse_tool_calls` on the whole text gives the same calls and content. Text that could be
the start of a tag is held back until the next chunk settles it. A block whose JSON does not
parse stays content, as written; nothing raises. No torch here.

One module per parser (hermes.py, llama3_json.py, ...), what they share in call_text.py, and
their table here.
"""

from __future__ import annotations

from zllm.text.tool_parsers.call_text import ParsedDelta, ToolCall, ToolCallDelta, make_tool_call_id
from zllm.text.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from zllm.text.tool_parsers.gemma4 import Gemma4ToolParser
from zllm.text.tool_parsers.glm45 import Glm45ToolParser
from zllm.text.tool_parsers.harmony import TOOL_PARSER_NAME, HarmonyParser
from zllm.text.tool_parsers.hermes import HermesToolParser
from zllm.text.tool_parsers.kimi_k2 import KimiK2ToolParser
from zllm.text.tool_parsers.llama3_json import Llama3JsonToolParser
from zllm.text.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from zllm.text.tool_parsers.mistral import MistralToolParser
from zllm.text.tool_parsers.pythonic import PythonicToolParser
from zllm.text.tool_parsers.qwen3_xml import Qwen3XmlToolParser

__all__ = ["TOOL_PARSERS", "ParsedDelta", "ToolCall", "ToolCallDelta", "make_tool_call_id"]


TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,  # (vLLM's name for Llama 4's)
    "llama4_json": Llama3JsonToolParser,  # (vLLM's name for Llama 4 writing llama3_json's)
    "qwen3_xml": Qwen3XmlToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,
    "minimax_m2": MiniMaxM2ToolParser,
    "gemma4": Gemma4ToolParser,
    TOOL_PARSER_NAME: HarmonyParser,
}


def parse_tool_calls(
    parser_name: str, text: str, tools: list[dict] | None = None
) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer, as the streamed pieces would assemble."""
    parser = TOOL_PARSERS[parser_name](tools)
    out = parser.feed(text)
    out.add(parser.finish())
    calls: dict[int, ToolCall] = {}
    for d in out.tool_calls:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.name or "", "", d.id or make_tool_call_id())
        calls[d.index].arguments += d.arguments
    return out.content, [calls[i] for i in sorted(calls)]
