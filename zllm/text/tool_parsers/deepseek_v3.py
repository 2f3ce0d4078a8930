"""DeepSeek-V3's tool calls (`--tool-call-parser deepseek_v3`, also `deepseek_v31`): free text,
then

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

as DeepSeek-V3.1's chat template writes them, or V3's and R1-0528's older form, the name after
`function<｜tool▁sep｜>` and the arguments in a fenced block:

    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>

(sections.py: each call goes out when its end tag arrives.) No torch here.
"""

from __future__ import annotations

from zllm.text.tool_parsers.sections import ReadCall, SectionToolParser, json_object

CALL_BEGIN, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(SectionToolParser):
    OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_END = "<｜tool▁call▁end｜>"

    def read_call(self, text: str) -> ReadCall | None:
        text = text.strip()
        if not text.startswith(CALL_BEGIN) or SEP not in text:
            return None
        head, _, rest = text[len(CALL_BEGIN) :].partition(SEP)
        if head == "function" and "```" in rest:  # V3's fenced form
            name, _, fenced = rest.partition("\n")
            body = fenced.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
            head, rest = name, body
        name, arguments = head.strip(), json_object(rest.strip())
        return ReadCall(name, arguments) if name and arguments is not None else None
