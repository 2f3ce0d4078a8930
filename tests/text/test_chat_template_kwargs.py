"""chat_template_kwargs through a real `zllm serve`, the openai and anthropic clients.

Qwen 3's own template is not vendored here (no copy of Qwen's tokenizer_config.json was
reachable from this machine); SWITCHED_TEMPLATE branches on `enable_thinking` exactly as
Qwen 3's does: thinking on, the generation prompt is `<|im_start|>assistant\\n` and the model
opens `<think>` itself; `enable_thinking is defined and enable_thinking is false`, the prompt
also closes an empty think block. The server runs the qwen3 reasoning parser with
--default-chat-template-kwargs turning thinking off (and one more variable), so each test
checks the server default, a request overriding it, and that the parser follows.
"""

from __future__ import annotations

import json

import pytest
from tiny_models import write_tiny_model

from zllm.errors import ParamError
from zllm.text.template_kwargs import (
    check_template_kwargs,
    merge_template_kwargs,
    reasoning_parser_for,
)
from zllm.text.tokenizer import load_tokenizer

SWITCHED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% if motto is defined %}{{ motto }}{% endif %}{% endif %}"
)
DEFAULTS = {"enable_thinking": False, "motto": "Be brief."}
MESSAGES = [{"role": "user", "content": "Is it?"}]


# ---- the rules, without a server ----------------------------------------------------------


def test_request_kwargs_override_the_defaults_key_by_key() -> None:
    merged = merge_template_kwargs(DEFAULTS, {"enable_thinking": True, "x": 1})
    assert merged == {"enable_thinking": True, "motto": "Be brief.", "x": 1}
    assert merge_template_kwargs(None, None) == {}
    assert DEFAULTS == {"enable_thinking": False, "motto": "Be brief."}  # not changed


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token"])
def test_reserved_names_are_refused_by_name(key: str) -> None:
    with pytest.raises(ParamError) as err:
        merge_template_kwargs({}, {key: 1})
    assert err.value.param == f"chat_template_kwargs.{key}"
    with pytest.raises(ParamError, match="--default-chat-template-kwargs"):
        check_template_kwargs({key: 1}, "--default-chat-template-kwargs")


def test_the_parser_follows_the_thinking_switch() -> None:
    assert reasoning_parser_for("qwen3", {"enable_thinking": False}) is None
    assert reasoning_parser_for("deepseek_r1", {"thinking": False}) is None
    assert reasoning_parser_for("qwen3", {"enable_thinking": True}) == "qwen3"
    assert reasoning_parser_for("qwen3", {"enable_thinking": 0}) == "qwen3"  # False only
    assert reasoning_parser_for("qwen3", {}) == "qwen3"


# ---- through the server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, engine_pool):
    root = tmp_path_factory.mktemp("template_kwargs")
    model = write_tiny_model(
        root / "model", chat_template=SWITCHED_TEMPLATE, extra_tokens=["<think>", "</think>"]
    )
    with engine_pool.serve(
        str(model),
        root / "server.log",
        "--reasoning-parser",
        "qwen3",
        "--served-model-name",
        "tiny",
        "--default-chat-template-kwargs",
        json.dumps(DEFAULTS),
    ) as server:
        yield server, load_tokenizer(str(model))


def prompt_ids(tokenizer, **kwargs) -> list[int]:
    """The prompt our own rendering gives, for the server's to match."""
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.e2e
def test_tokenize_renders_the_defaults_and_the_request_override(served) -> None:
    server, tokenizer = served
    off = server.post("/tokenize", {"messages": MESSAGES}).json()["tokens"]
    on = server.post(
        "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}
    ).json()["tokens"]
    assert off == prompt_ids(tokenizer, **DEFAULTS)
    assert on == prompt_ids(tokenizer, enable_thinking=True, motto="Be brief.")
    assert tokenizer.decode(off, skip_special_tokens=False).endswith(
        "<think>\n\n</think>\n\nBe brief."
    )
    assert "<think>" not in tokenizer.decode(on, skip_special_tokens=False)


@pytest.mark.e2e
def test_chat_thinking_off_by_default_on_per_request(served) -> None:
    server, tokenizer = served
    client = openai_client(server)
    think = tokenizer.encode("<think>", add_special_tokens=False)
    assert len(think) == 1
    # The model opens a think block at once (and keeps writing `<think>`): reasoning only
    # where thinking is on; with it off, all of it is content, the tag included.
    common = dict(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0.0,
        logit_bias={str(think[0]): 100},
    )
    off = client.chat.completions.create(**common)
    assert off.usage.prompt_tokens == len(prompt_ids(tokenizer, **DEFAULTS))
    assert off.choices[0].message.content.startswith("<think>")
    assert off.choices[0].message.model_extra.get("reasoning_content") is None

    on_body = {"chat_template_kwargs": {"enable_thinking": True}}
    on = client.chat.completions.create(**common, extra_body=on_body)
    assert on.usage.prompt_tokens == len(
        prompt_ids(tokenizer, enable_thinking=True, motto="Be brief.")
    )
    assert on.choices[0].message.model_extra.get("reasoning_content")
    assert not on.choices[0].message.content

    # Streamed, the same split.
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**common, extra_body=on_body, stream=True):
        if chunk.choices:
            reasoning += chunk.choices[0].delta.model_extra.get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert reasoning == on.choices[0].message.model_extra["reasoning_content"]
    assert content == ""


@pytest.mark.e2e
def test_reserved_name_is_a_400_naming_it(served) -> None:
    import openai

    server, _ = served
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )
    assert err.value.body["param"] == "chat_template_kwargs.add_generation_prompt"
    bad = server.post(
        "/v1/chat/completions",
        {"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": ["not", "an", "object"]},
    )
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.text
    # The server keeps serving.
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.e2e
def test_responses_and_messages_take_the_kwargs(served) -> None:
    import anthropic

    server, tokenizer = served
    on_ids = prompt_ids(tokenizer, enable_thinking=True, motto="Be brief.")
    off_ids = prompt_ids(tokenizer, **DEFAULTS)
    assert len(on_ids) != len(off_ids)

    client = openai_client(server)
    for kwargs, ids in ((None, off_ids), ({"enable_thinking": True}, on_ids)):
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        response = client.responses.create(
            model="tiny", input="Is it?", max_output_tokens=2, extra_body=extra
        )
        assert response.usage.input_tokens == len(ids)

    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    for kwargs, ids in ((None, off_ids), ({"enable_thinking": True}, on_ids)):
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        message = claude.messages.create(
            model="tiny", max_tokens=2, messages=MESSAGES, extra_body=extra
        )
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(ids)
        counted = claude.messages.count_tokens(model="tiny", messages=MESSAGES, extra_body=extra)
        assert counted.input_tokens == len(ids)
    with pytest.raises(anthropic.BadRequestError, match="tools"):
        claude.messages.create(
            model="tiny",
            max_tokens=2,
            messages=MESSAGES,
            extra_body={"chat_template_kwargs": {"tools": []}},
        )


@pytest.mark.e2e
def test_a_reserved_default_stops_the_server_before_it_starts(tmp_path) -> None:
    import subprocess
    import sys

    model = write_tiny_model(tmp_path / "model", chat_template=SWITCHED_TEMPLATE)
    run = subprocess.run(
        [sys.executable, "-m", "zllm.cli", "serve", str(model), "--port", "1"]
        + ["--default-chat-template-kwargs", '{"messages": []}'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "--default-chat-template-kwargs may not set 'messages'" in run.stderr + run.stdout
