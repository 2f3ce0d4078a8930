"""MiniMax-M2's tool calls (`--tool-call-parser minimax_m2`): free text, then

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

as its chat template writes them (several invokes in one block): a string value as text, any
other as JSON, read as the tool's schema types it (with no schema, as JSON where it reads as
JSON). (sections.py: each call goes out when its `</invoke>` arrives.) No torch here.
"""

from __future__ import annotations

import json
import re

from zllm.text.tool_parsers.sections import ReadCall, SectionToolParser

_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*)\Z', re.DOTALL)
_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


class MiniMaxM2ToolParser(SectionToolParser):
    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
    CALL_END = "</invoke>"

    def read_call(self, text: str) -> ReadCall | None:
        invoke = _INVOKE.match(text)
        if invoke is None:
            return None
        name, body = invoke.group(1).strip(), invoke.group(2)
        if _PARAMETER.sub("", body).strip():  # anything but parameters: not a call
            return None
        arguments = {key: self.typed(name, key, value) for key, value in _PARAMETER.findall(body)}
        return ReadCall(name, json.dumps(arguments, ensure_ascii=False))
