"""Kimi K2's tool calls (`--tool-call-parser kimi_k2`): free text, then

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>...<|tool_calls_section_end|>

as its chat template writes them. The call's id is the model's own (`functions.NAME:N`: the
template matches tool results to calls by it), its name the part between. (sections.py: each
call goes out when its end tag arrives.) No torch here.
"""

from __future__ import annotations

from zllm.text.tool_parsers.sections import ReadCall, SectionToolParser, json_object

CALL_BEGIN, ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"


class KimiK2ToolParser(SectionToolParser):
    OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_END = "<|tool_call_end|>"

    def read_call(self, text: str) -> ReadCall | None:
        text = text.strip()
        if not text.startswith(CALL_BEGIN) or ARGUMENTS not in text:
            return None
        call_id, _, rest = text[len(CALL_BEGIN) :].partition(ARGUMENTS)
        call_id = call_id.strip()
        name = call_id.removeprefix("functions.").rpartition(":")[0] or call_id
        arguments = json_object(rest.strip())
        return ReadCall(name, arguments, call_id) if name and arguments is not None else None
