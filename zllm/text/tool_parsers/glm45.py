"""GLM-4.5's, 4.6's and 4.7's tool calls (`--tool-call-parser glm45`, also `glm47`): free text,
then one block per call,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

as their chat templates write them (4.7's without the newlines): a string value as text, any
other as JSON. A value is read
as the tool's schema types it (qwen3_xml.py's read_value), with no schema as JSON where it reads
as JSON. (sections.py: each call goes out when its end tag arrives.) No torch here.
"""

from __future__ import annotations

import json
import re

from zllm.text.tool_parsers.sections import ReadCall, SectionToolParser

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45ToolParser(SectionToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    CALL_END = CLOSE  # one call per block

    def read_call(self, text: str) -> ReadCall | None:
        # The name ends at its line's end (GLM-4.5, 4.6) or at the first key (4.7's template
        # writes no newlines).
        text = text.strip()
        end = min(i for i in (text.find("\n"), text.find("<arg_key>"), len(text)) if i >= 0)
        name, rest = text[:end].strip(), text[end:]
        if not name or "<" in name:
            return None
        pairs = _PAIR.findall(rest)
        if _PAIR.sub("", rest).strip():  # anything but key/value pairs: not a call
            return None
        arguments = {key.strip(): self.typed(name, key.strip(), value) for key, value in pairs}
        return ReadCall(name, json.dumps(arguments, ensure_ascii=False))
