"""gpt-oss's harmony (zllm/text/tool_parsers/harmony.py): recorded gpt-oss-shaped outputs taken apart into
reasoning, content and tool calls, whole and streamed in every way the text can be cut (by
characters, and token by token through a tokenizer with harmony's special tokens); then the
same through the chat, Responses and Messages assemblers, the prompt side (what the chat
template receives), and one served model whose output a grammar makes harmony."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass

import httpx
import msgspec
import pytest
from servers import sse_events, sse_lines
from tiny_models import build_tiny_tokenizer, write_tiny_model
from tokenizers.decoders import DecodeStream

from zllm.frontend.anthropic.output import MessageAssembler
from zllm.frontend.openai.choices import ChatAssembler
from zllm.frontend.openai.format import chat_messages
from zllm.frontend.openai.logprobs import LogprobText
from zllm.frontend.openai.protocol import ChatMessage
from zllm.frontend.responses.api import ResponsesRequest, echoed_settings
from zllm.frontend.responses.output import ResponseAssembler
from zllm.frontend.tools import ChoiceParser, ToolPlan, constrain, keep_call_tags
from zllm.protocol import FinishReason, RequestOutputDelta
from zllm.sampling_params import SamplingParams, StructuredOutputsParams
from zllm.text.reasoning_parser import REASONING_PARSERS, parse_reasoning, reasoning_markers
from zllm.text.template_kwargs import reasoning_parser_for
from zllm.text.tokenizer import load_tokenizer
from zllm.text.tool_parsers import TOOL_PARSERS, parse_tool_calls
from zllm.text.tool_parsers.harmony import (
    SPECIAL_TOKENS,
    HarmonyDelta,
    HarmonyParser,
    parse_harmony,
    parse_header,
)

ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"  # one message ends, the next opens
FINAL = "<|channel|>final<|message|>"
WEATHER_CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
PARIS = '{"city": "Paris", "unit": "celsius"}'


@dataclass
class Case:
    label: str
    text: str
    reasoning: str | None
    content: str
    calls: list[tuple[str, str]]  # (name, arguments as written)
    clean: bool = True  # well-formed: no marker may reach reasoning or content


CASES = [
    Case(
        "reasoning then the final answer",
        f"{ANALYSIS}The user greets. Reply.{NEXT}{FINAL}Hello! How can I help?<|return|>",
        "The user greets. Reply.",
        "Hello! How can I help?",
        [],
    ),
    Case(  # <|return|> is a stop token: the engine's text ends before it
        "final answer, stop token left out",
        f"{ANALYSIS}Sum: 2+2=4.{NEXT}{FINAL}4",
        "Sum: 2+2=4.",
        "4",
        [],
    ),
    Case(
        "a tool call after reasoning",
        f"{ANALYSIS}Need the weather.{NEXT}{WEATHER_CALL}{PARIS}<|call|>",
        "Need the weather.",
        "",
        [("get_weather", PARIS)],
    ),
    Case(
        "a call with no analysis, stop token left out",
        '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "UTC"}',
        None,
        "",
        [("get_time", '{"tz": "UTC"}')],
    ),
    Case(  # the order gpt-oss's chat template writes a call in
        "recipient before the channel",
        f" to=functions.get_weather<|channel|>commentary json<|message|>{PARIS}<|call|>",
        None,
        "",
        [("get_weather", PARIS)],
    ),
    Case(
        "two calls, a preamble first",
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        f"<|start|>assistant{WEATHER_CALL}{PARIS}<|call|>"
        '<|start|>assistant to=functions.get_time<|channel|>commentary<|message|>{"tz": "CET"}',
        None,
        "Checking both.",
        [("get_weather", PARIS), ("get_time", '{"tz": "CET"}')],
    ),
    Case(
        "a call with no arguments",
        f"{ANALYSIS}No args.{NEXT}<|channel|>commentary to=functions.now<|message|><|call|>",
        "No args.",
        "",
        [("now", "{}")],
    ),
    Case(
        "two analysis messages, a built-in tool's call among them",
        f"{ANALYSIS}First.{NEXT}"
        '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"q": "x"}<|call|>'
        f"<|start|>assistant{ANALYSIS}Second.{NEXT}{FINAL}Done.",
        'First.\n{"q": "x"}\nSecond.',
        "Done.",
        [],
    ),
    Case(
        "markup-like text in the answer",
        f"{FINAL}if a < b and c <| d: print('<|tag|>') # 你好 🙂",
        None,
        "if a < b and c <| d: print('<|tag|>') # 你好 🙂",
        [],
    ),
    Case(
        "no end before the next header",
        f"{ANALYSIS}Thinking<|start|>assistant{FINAL}Answer",
        "Thinking",
        "Answer",
        [],
    ),
    Case(
        "no start before the next channel",
        f"{ANALYSIS}Thinking<|end|>{FINAL}Answer",
        "Thinking",
        "Answer",
        [],
    ),
    Case(
        "cut short inside the next header",
        f"{ANALYSIS}Still thinking{NEXT}<|channel|>fin",
        "Still thinking",
        "",
        [],
    ),
    Case(
        "a header with no message",
        f"<|channel|>final<|end|><|start|>assistant{FINAL}Hi",
        None,
        "Hi",
        [],
    ),
    Case("plain text, no harmony", "Just text, 1 < 2.", None, "Just text, 1 < 2.", []),
    Case("empty", "", None, "", []),
    Case(
        "a header that does not parse stays content",
        "<|channel|>final Hello there<|message|>Hi",
        None,
        "<|channel|>final Hello there<|message|>Hi",
        [],
        clean=False,
    ),
    Case(
        "a malformed header cut by an end stays content",
        "<|start|>what is this<|end|>ok",
        None,
        "<|start|>what is this<|end|>ok",
        [],
        clean=False,
    ),
    Case(
        "text before the first header",
        f"Sure.{ANALYSIS}hm{NEXT}{FINAL}yes",
        "hm",
        "Sure.yes",
        [],
    ),
    Case(
        "a stray end outside a message stays content",
        f"{FINAL}Hi<|return|> there<|end|>",
        None,
        "Hi there<|end|>",
        [],
        clean=False,
    ),
]


def partitions(text: str):
    """Ways to cut `text` into chunks, as a stream of deltas might: every cut into two, many
    into three, fixed sizes (1: character by character), seeded random ones."""
    n = len(text)
    for i in range(1, n):
        yield _cut(text, [i])
    for i in range(1, n, 3):
        for j in range(i + 1, n, 7):
            yield _cut(text, [i, j])
    for size in range(1, 9):
        yield _cut(text, list(range(size, n, size)))
    rng = random.Random(0)
    for _ in range(20):
        if n > 1:
            yield _cut(text, sorted(rng.sample(range(1, n), min(n - 1, rng.randrange(1, 12)))))


def _cut(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def streamed(chunks: list[str], clean: bool = True) -> tuple[str | None, str, list]:
    """(reasoning, content, calls) assembled from a stream of `chunks`; each call's first
    delta names it and no marker leaks into a piece (for well-formed text)."""
    parser = HarmonyParser()
    out = HarmonyDelta()
    for chunk in [*chunks, None]:
        piece = parser.feed(chunk) if chunk is not None else parser.finish()
        if clean:
            leaked = [t for t in SPECIAL_TOKENS if t in piece.reasoning + piece.content]
            assert not leaked, (chunks, piece)
        out.add(piece)
    calls: dict[int, list[str]] = {}
    for d in out.tool_calls:
        if d.index not in calls:
            assert d.id and d.id.startswith("call_") and d.name, "a call's first delta names it"
            calls[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None
        calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    reasoning = out.reasoning if parser.saw_reasoning else None
    return reasoning, out.content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_whole(case: Case) -> None:
    parsed = parse_harmony(case.text)
    assert parsed.reasoning == case.reasoning
    assert parsed.content == case.content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == case.calls
    assert len({c.id for c in parsed.tool_calls}) == len(case.calls)
    # The registries' whole-text helpers give the same split.
    assert parse_reasoning("openai_gptoss", case.text) == (case.reasoning, case.content)
    content, calls = parse_tool_calls("openai", case.text)
    assert (content, [(c.name, c.arguments) for c in calls]) == (case.content, case.calls)


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_streamed_in_every_cut(case: Case) -> None:
    expected = (case.reasoning, case.content, case.calls)
    for chunks in partitions(case.text):
        assert streamed(chunks, case.clean) == expected, chunks


@pytest.fixture(scope="module")
def harmony_tokenizer():
    """A tiny byte-level BPE with harmony's seven special tokens added as special."""
    return build_tiny_tokenizer(extra_special=SPECIAL_TOKENS)


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_streamed_token_by_token(case: Case, harmony_tokenizer) -> None:
    """As the detokenizer hands it out: each token's text, special tokens kept. Skipping
    them (the default) would leave no header to read, which is why harmony keeps them."""
    ids = harmony_tokenizer.encode(case.text, add_special_tokens=False).ids
    stream = DecodeStream(skip_special_tokens=False)
    pieces = [stream.step(harmony_tokenizer, i) or "" for i in ids]
    assert "".join(pieces) == case.text
    assert streamed(pieces, case.clean) == (case.reasoning, case.content, case.calls)
    if any(t in case.text for t in SPECIAL_TOKENS):
        assert harmony_tokenizer.decode(ids, skip_special_tokens=True) != case.text


def test_headers() -> None:
    header = parse_header(
        "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    )
    assert (header.role, header.channel, header.recipient, header.content_type) == (
        "assistant",
        "commentary",
        "functions.get_weather",
        "json",
    )
    assert (header.function_name, header.kind) == ("get_weather", "call")
    assert parse_header(" to=functions.f<|channel|>commentary json").function_name == "f"
    assert parse_header("<|channel|>analysis").kind == "reasoning"
    assert parse_header("<|channel|>analysis to=python").kind == "reasoning"
    assert parse_header("<|channel|>commentary").kind == "content"  # a preamble
    assert parse_header("<|channel|>final").kind == "content"
    assert parse_header("").kind == "content"
    for junk in ("<|channel|>", "a b c", "<|channel|>final two words", "x to=a to=b", "é!"):
        assert parse_header(junk) is None, junk


def test_in_reasoning_follows_the_channel(harmony_tokenizer) -> None:
    """What the Responses API counts reasoning tokens by: from the analysis header to its
    end, not the final answer."""
    text = f"{ANALYSIS}Think.{NEXT}{FINAL}Answer."
    parser = HarmonyParser()
    stream = DecodeStream(skip_special_tokens=False)
    seen = []
    for i in harmony_tokenizer.encode(text, add_special_tokens=False).ids:
        piece = stream.step(harmony_tokenizer, i) or ""
        before = parser.in_reasoning
        parser.feed(piece)
        seen.append((piece, before or parser.in_reasoning))
    reasoning = "".join(p for p, r in seen if r)
    assert reasoning.endswith("<|message|>Think.<|end|>")  # and the header's last tokens
    assert "Answer" not in reasoning and "final" not in reasoning


def test_registered_under_vllms_names() -> None:
    assert REASONING_PARSERS["openai_gptoss"] is HarmonyParser
    assert TOOL_PARSERS["openai"] is HarmonyParser
    assert reasoning_markers("openai_gptoss") == (ANALYSIS, f"{NEXT}{FINAL}")
    # Its template has no switch: thinking off leaves harmony on (else headers are content).
    assert reasoning_parser_for("openai_gptoss", {"enable_thinking": False}) == "openai_gptoss"
    assert reasoning_parser_for("qwen3", {"enable_thinking": False}) is None


# ---------------------------------------------------------------------------------------------
# The serving side: what the chat, Responses and Messages paths make of it

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]
TOOL_TURN = f"{ANALYSIS}Need the weather.{NEXT}{WEATHER_CALL}{PARIS}"


def deltas(text: str, size: int = 5) -> list[RequestOutputDelta]:
    chunks = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        RequestOutputDelta(
            "r", 0, c, [i], finish_reason=FinishReason.STOP if i == len(chunks) - 1 else None
        )
        for i, c in enumerate(chunks)
    ]


def test_either_name_turns_the_whole_parser_on() -> None:
    none = ToolPlan("none", None, None)
    assert ChoiceParser.of(none, None, None) is None
    assert ChoiceParser.of(none, "hermes", None) is None
    for tool_parser, reasoning_parser in (("openai", None), (None, "openai_gptoss")):
        parser = ChoiceParser.of(none, tool_parser, reasoning_parser)
        assert parser is not None and isinstance(parser.reasoning, HarmonyParser)
        piece = parser.feed(TOOL_TURN)
        piece.tool_calls += parser.finish().tool_calls
        assert piece.reasoning == "Need the weather." and piece.content == ""
        assert [c.function.name for c in piece.tool_calls if c.id] == ["get_weather"]


def test_special_tokens_kept_and_constraints_wait_for_the_answer(harmony_model) -> None:
    """A constraint under harmony (either parser's name) waits for the answer's header,
    `<|channel|>final<|message|>`: the analysis channel, a commentary header, a header cut
    short are free; the answer is held. A request's own `after_tokens: []` holds it from the
    output's first token."""
    params = SamplingParams(max_tokens=8)
    none = ToolPlan("none", None, None)
    for parsers in (("openai", None), (None, "openai_gptoss")):
        assert keep_call_tags(params, none, *parsers).skip_special_tokens is False
    assert keep_call_tags(params, none, "hermes", "qwen3").skip_special_tokens is True
    tokenizer = load_tokenizer(str(harmony_model))
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    schema = StructuredOutputsParams(json={"type": "object"})
    plan = ToolPlan("none", None, schema)
    for reasoning, tools in (("openai_gptoss", None), (None, "openai")):
        waits = constrain(params, plan, tokenizer, reasoning, tools).structured_outputs
        assert waits is not None and waits.after_tokens == ids("<|channel|>final<|message|>")
    own = ToolPlan("none", None, msgspec.structs.replace(schema, after_tokens=[]))
    held = constrain(params, own, tokenizer, "openai_gptoss").structured_outputs
    assert held is not None and held.after_tokens == []

    from tool_calls import allowed_count

    from zllm.executor.requests.structured_output import GrammarCompiler

    vocab = tokenizer.vocab_size
    matcher = GrammarCompiler(str(harmony_model), vocab).matcher(waits, [0])

    def allowed() -> int:
        return allowed_count(matcher, vocab)

    free = allowed()
    before = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary"
    for text in (before, "<|message|>x<|end|><|start|>assistant<|channel|>final"):
        for token in ids(text):
            matcher.consume(token)
        assert matcher.waiting and allowed() == free
    matcher.consume(ids("<|message|>")[0])
    assert not matcher.waiting and allowed() < free / 10  # the answer: JSON only
    from_start = GrammarCompiler(str(harmony_model), vocab).matcher(held, [0])
    assert not from_start.waiting


def test_chat_choice(tiny_llama_dir) -> None:
    """Reasoning, a streamed call and finish_reason tool_calls; with no call, stop."""
    names = LogprobText(load_tokenizer(tiny_llama_dir))
    auto = ToolPlan("auto", TOOLS, None)

    def assembler() -> ChatAssembler:
        parser = ChoiceParser.of(auto, "openai", "openai_gptoss")
        return ChatAssembler(1, False, False, names, parsers=[parser])

    asm = assembler()
    for d in deltas(TOOL_TURN):
        asm.collect(0, d)
    (choice,) = asm.finish()
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Need the weather."
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", PARIS)
    answer = assembler()
    for d in deltas(f"{ANALYSIS}Hm.{NEXT}{FINAL}Sunny."):
        answer.collect(0, d)
    (choice,) = answer.finish()
    assert choice.finish_reason == "stop"
    assert (choice.message.reasoning_content, choice.message.content) == ("Hm.", "Sunny.")


def test_responses_items() -> None:
    """A reasoning item, a message, a function_call, in the order written; the analysis'
    tokens count as reasoning tokens."""
    plan = ToolPlan("auto", TOOLS, None)
    echo = echoed_settings(ResponsesRequest(input="hi"), plan)
    asm = ResponseAssembler("resp_x", "tiny", echo, ChoiceParser.of(plan, "openai", None))
    text = f"{ANALYSIS}Need it.{NEXT}<|channel|>commentary<|message|>One moment.{NEXT}"
    text += f"{WEATHER_CALL}{PARIS}"
    for d in deltas(text, size=1):
        asm.collect(0, d)
    output = asm.response()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message", "function_call"]
    assert output[0]["content"][0]["text"] == "Need it."
    assert output[1]["content"][0]["text"] == "One moment."
    assert (output[2]["name"], output[2]["arguments"]) == ("get_weather", PARIS)
    assert 0 < asm.reasoning_tokens < len(text) // 2


def test_messages_blocks() -> None:
    """A thinking block, then a tool_use block; stop_reason tool_use."""
    plan = ToolPlan("auto", TOOLS, None)
    asm = MessageAssembler.of("msg_x", "tiny", plan, "openai_gptoss", "openai")
    for d in deltas(TOOL_TURN, size=3):
        asm.collect(0, d)
    response = asm.response()
    thinking, tool_use = (b for b in response.content)
    assert (thinking["type"], thinking["thinking"]) == ("thinking", "Need the weather.")
    assert (tool_use["type"], tool_use["name"]) == ("tool_use", "get_weather")
    assert tool_use["input"] == json.loads(PARIS)
    assert response.stop_reason == "tool_use"


# ---------------------------------------------------------------------------------------------
# The prompt side: gpt-oss's template renders harmony itself from the messages it is given

# Our own gpt-oss-like template: an assistant turn's `thinking` as its analysis, each call
# as a commentary message to functions.NAME, a tool's result from functions.NAME.
HARMONY_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}"
    "<|end|>{% endif %}"
    "{% for c in m.tool_calls or [] %}<|start|>assistant to=functions.{{ c.function.name }}"
    "<|channel|>commentary json<|message|>{{ c.function.arguments | tojson }}<|call|>"
    "{% endfor %}"
    "{% if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>"
    "commentary<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("harmony"),
        chat_template=HARMONY_TEMPLATE,
        extra_special=SPECIAL_TOKENS,
        max_position_embeddings=1024,
    )


def test_template_gets_reasoning_and_calls(harmony_model) -> None:
    """An assistant turn sent back with reasoning_content (or vLLM's `reasoning`) and a call
    renders as the analysis and the call the model wrote."""
    call = {"id": "call_1", "function": {"name": "get_weather", "arguments": PARIS}}
    for field in ("reasoning_content", "reasoning"):
        sent = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call], field: "Need it."},
            {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "call_1"},
        ]
        messages = msgspec.convert(sent, list[ChatMessage])
        rendered = load_tokenizer(str(harmony_model)).apply_chat_template(chat_messages(messages))
        assert rendered == (
            "<|start|>user<|message|>Weather in Paris?<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>Need it.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris", "unit": "celsius"}<|call|>'
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
            '{"temp": 20}<|end|><|start|>assistant'
        )


# ---------------------------------------------------------------------------------------------
# Served: a grammar makes the tiny model write harmony, token ids and all


def _grammar(tokenizer, text: str) -> str:
    """A grammar that holds exactly `text`, its special tokens as themselves (`<[id]>`)."""
    parts = []
    for piece in _split_special(text):
        if piece in SPECIAL_TOKENS:
            parts.append(f"<[{tokenizer.encode(piece, add_special_tokens=False)[0]}]>")
        elif piece:
            parts.append(json.dumps(piece))
    return "start: " + " ".join(parts)


def _split_special(text: str) -> list[str]:
    pieces = [text]
    for token in SPECIAL_TOKENS:
        pieces = [q for p in pieces for q in _keep_split(p, token)]
    return pieces


def _keep_split(text: str, token: str) -> list[str]:
    if text in SPECIAL_TOKENS:
        return [text]
    out = []
    for i, part in enumerate(text.split(token)):
        if i:
            out.append(token)
        out.append(part)
    return out


def _chat_stream(server, body: dict) -> tuple[str, str, dict[int, list[str]], str | None]:
    reasoning, content, calls, finish = "", "", {}, None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for event in sse_events(sse_lines(r.iter_text())):
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            delta = choice["delta"]
            assert "<|" not in (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return reasoning, content, calls, finish


@pytest.mark.e2e
def test_served(harmony_model, engine_pool, tmp_path) -> None:
    """`zllm serve --reasoning-parser openai_gptoss --tool-call-parser openai`: a grammar
    makes the tiny model write a harmony answer and a harmony call (its special tokens as
    themselves); chat answers them as reasoning_content, content and tool_calls, whole and
    streamed. Then sampling (held to harmony by a looser grammar, or free): whatever comes
    out, chat's split is the parser's split of the raw text, which /v1/completions returns
    for the same seed. Responses and Messages answer too (their mapping: the assembler
    tests above)."""
    with engine_pool.serve(
        str(harmony_model),
        tmp_path / "server.log",
        "--reasoning-parser",
        "openai_gptoss",
        "--tool-call-parser",
        "openai",
        "--served-model-name",
        "tiny",
    ) as server:
        tokenizer = load_tokenizer(str(harmony_model))
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        answer = f"{ANALYSIS}Think first.{NEXT}{FINAL}Sunny.<|return|>"
        body = dict(
            model="tiny",
            messages=ask,
            max_tokens=200,
            structured_outputs={"grammar": _grammar(tokenizer, answer), "after_tokens": []},
        )
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["reasoning_content"] == "Think first."
        assert (choice["message"]["content"], choice["finish_reason"]) == ("Sunny.", "stop")
        assert _chat_stream(server, {**body, "stream": True}) == (
            "Think first.",
            "Sunny.",
            {},
            "stop",
        )
        call_text = f"{TOOL_TURN}<|call|>"
        body = dict(
            model="tiny",
            messages=ask,
            tools=TOOLS,
            max_tokens=200,
            structured_outputs={"grammar": _grammar(tokenizer, call_text), "after_tokens": []},
        )
        r = server.post("/v1/chat/completions", body)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning_content"] == "Need the weather."
        (call,) = choice["message"]["tool_calls"]
        assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", PARIS)
        streamed_reasoning, streamed_content, calls, finish = _chat_stream(
            server, {**body, "stream": True}
        )
        assert (streamed_reasoning, streamed_content, finish) == (
            "Need the weather.",
            "",
            "tool_calls",
        )
        assert calls == {0: ["get_weather", PARIS]}
        _check_free_sampling(server, tokenizer)
        _check_responses_and_messages(server)


def _random_harmony_grammar(tokenizer) -> str:
    """Harmony messages of every kind, in any number and order, with free bodies: which
    ones, and what they say, is the sampler's pick."""
    ids = {t: tokenizer.encode(t, add_special_tokens=False)[0] for t in SPECIAL_TOKENS}
    ch, msg, end, start = (ids[t] for t in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
    return (
        f'start: message (<[{end}]> <[{start}]> "assistant" message)*\n'
        f"message: <[{ch}]> header <[{msg}]> BODY\n"
        'header: "analysis" | "final" | "commentary" | "analysis to=browser.search"'
        f' | "commentary to=functions.get_weather " <[{ids["<|constrain|>"]}]> "json"\n'
        "BODY: /[a-z .]{0,6}/\n"
    )


def _check_free_sampling(server, tokenizer) -> None:
    """Sampled, not chosen: chat's split is parse_harmony's of the raw text. Held to harmony
    by a grammar (every kind of message, cut wherever max_tokens falls), and free (harmony's
    tokens made likely: junk, which stays content)."""
    ask = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(ask, chat_template=HARMONY_TEMPLATE)
    grammar = {"grammar": _random_harmony_grammar(tokenizer), "after_tokens": []}
    bias = {str(tokenizer.encode(t, add_special_tokens=False)[0]): 3.0 for t in SPECIAL_TOKENS}
    message_id = str(tokenizer.encode("<|message|>", add_special_tokens=False)[0])
    seen: set[str] = set()
    for seed in range(14):
        held = seed < 10
        sampling = dict(model="tiny", max_tokens=48, temperature=1.0, seed=seed)
        if held:  # <|message|> made unlikely where the grammar lets a call's header go on
            sampling.update(structured_outputs=grammar, logit_bias={message_id: -5.0})
        else:
            sampling.update(logit_bias=bias)
        raw = server.post(
            "/v1/completions", {**sampling, "prompt": prompt, "skip_special_tokens": False}
        ).json()["choices"][0]["text"]
        r = server.post("/v1/chat/completions", {**sampling, "messages": ask})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        parsed = parse_harmony(raw)
        assert message.get("reasoning_content") == parsed.reasoning, raw
        # With calls and nothing else to say, content is null (as OpenAI sends it).
        no_content = parsed.tool_calls and not parsed.content.strip()
        assert message["content"] == (None if no_content else parsed.content), raw
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ]
        assert calls == [(c.name, c.arguments) for c in parsed.tool_calls], raw
        if held:
            assert not any(t in (message["content"] or "") for t in SPECIAL_TOKENS), raw
            seen |= {"reasoning"} if parsed.reasoning else set()
            seen |= {"content"} if parsed.content else set()
            seen |= {"call"} if parsed.tool_calls else set()
    assert seen == {"reasoning", "content", "call"}  # the seeds wrote every kind


def _check_responses_and_messages(server) -> None:
    """Free sampling through the other two APIs: both answer, whatever the model wrote."""
    r = server.post("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 24})
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("completed", "incomplete")
    r = server.post(
        "/v1/messages",
        {"model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
