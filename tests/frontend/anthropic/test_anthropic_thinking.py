"""Anthropic's `thinking` through a real `zllm serve` and the official anthropic client.

The tiny model's template opens the think block in the prompt (DeepSeek-R1's way) unless
`enable_thinking` is false, where it closes an empty one; the server runs the deepseek_r1
reasoning parser. Greedy, this tiny model (seed 5) does not close its thinking within 1024
tokens, nor end, so a budget
that cuts it shows exactly: the thinking is the first `budget_tokens` tokens the model
writes (the same prompt through /v1/chat/completions with max_tokens = budget gives the
same reasoning in exactly that many tokens), then the forced `</think>`, then the answer.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from tiny_models import write_tiny_model
from tool_calls import SWITCHABLE_THINK_TEMPLATE

from zllm.frontend.anthropic.thinking import ThinkingSigner
from zllm.sampling_params import ThinkingBudget
from zllm.text.thinking_budget import ThinkingTracker

TEMPLATE = SWITCHABLE_THINK_TEMPLATE
MESSAGES = [{"role": "user", "content": "Is it?"}]
BUDGET = 1024  # Anthropic's smallest
ANSWER_TOKENS = 8


# ---- the tracker, without a server --------------------------------------------------------


def test_tracker_counts_reasoning_and_forces_the_whole_marker() -> None:
    budget = ThinkingBudget(max_tokens=3, end_token_ids=[8, 9], start_token_ids=[7])
    tracker = ThinkingTracker(budget)
    for token in [1, 2, 7, 3, 8, 4]:  # before <think>: free; `8 4` is not the end marker
        assert tracker.forced_token() is None
        tracker.consume(token)
    assert tracker.num_reasoning == 3 and tracker.forced_token() == 8
    tracker.consume(8)
    assert tracker.forced_token() == 9  # the marker's rest
    tracker.consume(9)
    assert tracker.closed and tracker.forced_token() is None
    # Rebuilt from an output (a preempted or forked sequence): the same place.
    again = ThinkingTracker(budget, [1, 2, 7, 3, 8, 4, 8])
    assert again.forced_token() == 9


def test_tracker_closed_by_the_model_forces_nothing() -> None:
    budget = ThinkingBudget(max_tokens=2, end_token_ids=[9])  # starts inside
    tracker = ThinkingTracker(budget, [1, 9, 2, 3, 4])
    assert tracker.closed and tracker.forced_token() is None
    assert ThinkingTracker(ThinkingBudget(max_tokens=0, end_token_ids=[9])).forced_token() == 9


def test_tracker_forced_tokens_follow_the_drafts_and_leave_it_as_it_was() -> None:
    budget = ThinkingBudget(max_tokens=2, end_token_ids=[8, 9])
    tracker = ThinkingTracker(budget, [1])
    assert tracker.forced_tokens([2, 8, 9]) == [None, 8, 9, None]
    assert tracker.num_reasoning == 1 and tracker.forced_token() is None


def test_signer_key_is_made_owner_only_and_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ZLLM_CACHE", str(tmp_path / "cache"))
    first = ThinkingSigner.of(None)
    key_file = tmp_path / "cache" / "thinking-signature.key"
    assert not key_file.exists()  # made at first use
    first.sign("x")
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert ThinkingSigner.of(None).sign("x") == first.sign("x")  # kept across restarts
    assert first.verify("x", first.sign("x")) and not first.verify("y", first.sign("x"))
    assert not first.verify("x", None)
    assert not first.verify("x", "\u00e9" * 44)  # not ASCII: refused, not a TypeError (a 500)


def test_signer_warns_of_a_key_others_can_read(tmp_path, caplog) -> None:
    """A key file open to its group or others still signs, with a warning naming it (whoever
    else reads it can forge signatures); an owner-only one signs without a word."""
    key_file = tmp_path / "signature.key"
    key_file.write_bytes(os.urandom(32))
    for mode, warned in ((0o600, False), (0o640, True)):
        key_file.chmod(mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert ThinkingSigner.of(str(key_file)).sign("x")
        assert any(str(key_file) in r.getMessage() for r in caplog.records) == warned, mode


# ---- through the server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, engine_pool):
    root = tmp_path_factory.mktemp("thinking")
    model = write_tiny_model(
        root / "model",
        seed=5,  # weights whose greedy answer stays in its thinking for 1024+ tokens
        chat_template=TEMPLATE,
        extra_tokens=["<think>", "</think>"],
        max_position_embeddings=2048,
    )
    key_file = root / "signature.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    with engine_pool.serve(
        str(model),
        root / "server.log",
        "--reasoning-parser",
        "deepseek_r1",
        "--served-model-name",
        "tiny",
        "--thinking-signature-key-file",
        str(key_file),
    ) as server:
        yield server, key_file.read_bytes()


def claude_of(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)


def prompt_tokens(message) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def signature_of(key: bytes, thinking: str) -> str:
    return base64.b64encode(hmac.new(key, thinking.encode(), hashlib.sha256).digest()).decode()


@pytest.mark.e2e
def test_disabled_has_no_thinking_block(served) -> None:
    server, _ = served
    claude = claude_of(server)
    common = dict(model="tiny", max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0.0})
    thinking_default = claude.messages.create(**common)
    assert [b.type for b in thinking_default.content] == ["thinking"]  # never closes
    off = claude.messages.create(**common, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text
    # The template closed an empty think block in the prompt: 5 more tokens than `<think>\n`.
    assert prompt_tokens(off) > prompt_tokens(thinking_default)


@pytest.mark.e2e
def test_budget_cuts_the_thinking_and_the_answer_follows(served) -> None:
    from openai import OpenAI

    server, key = served
    claude = claude_of(server)
    openai = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    # The model's first BUDGET tokens, greedy, without a budget: all reasoning.
    reference = openai.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=BUDGET, temperature=0.0
    )
    assert reference.usage.completion_tokens == BUDGET
    assert reference.choices[0].finish_reason == "length"
    reasoning = reference.choices[0].message.model_extra["reasoning_content"]
    assert reasoning and not reference.choices[0].message.content

    request = dict(
        model="tiny",
        max_tokens=BUDGET + 1 + ANSWER_TOKENS,
        messages=MESSAGES,
        extra_body={"temperature": 0.0},  # (this client version has no temperature argument)
        thinking={"type": "enabled", "budget_tokens": BUDGET},
    )
    message = claude.messages.create(**request)
    thinking, *answer = message.content
    assert thinking.type == "thinking" and thinking.thinking == reasoning
    assert thinking.signature == signature_of(key, reasoning)
    # BUDGET reasoning tokens, the forced </think>, then the answer up to max_tokens.
    assert message.usage.output_tokens == BUDGET + 1 + ANSWER_TOKENS
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in answer] == ["text"] and answer[0].text

    # Streamed beside another request (continuous batching): the same blocks, and the
    # signature as the thinking block's last delta.
    def stream():
        kinds = []  # ("content_block_delta", delta type) or ("content_block_stop", index)
        with claude.messages.stream(**request) as events:
            for e in events:
                if e.type == "content_block_delta":
                    kinds.append((e.type, e.delta.type))
                elif e.type == "content_block_stop":
                    kinds.append((e.type, e.index))
            return kinds, events.get_final_message()

    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream)
        other = pool.submit(
            openai.chat.completions.create,
            model="tiny",
            messages=[{"role": "user", "content": "Something else entirely"}],
            max_tokens=200,
        )
        kinds, final = streamed.result()
        assert other.result().usage.completion_tokens >= 1
    first_stop = kinds.index(("content_block_stop", 0))
    assert kinds[first_stop - 1] == ("content_block_delta", "signature_delta")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]


@pytest.mark.e2e
def test_signatures_sent_back_are_checked(served) -> None:
    import anthropic

    server, key = served
    claude = claude_of(server)
    first = claude.messages.create(
        model="tiny",
        max_tokens=1100,
        messages=MESSAGES,
        extra_body={"temperature": 0.0},  # (this client version has no temperature argument)
        thinking={"type": "enabled", "budget_tokens": BUDGET},
    )
    thinking = first.content[0]
    assert thinking.type == "thinking"
    turn = [b.model_dump() for b in first.content]
    follow_up = [{"role": "user", "content": "And then?"}]
    valid = claude.messages.create(
        model="tiny",
        max_tokens=4,
        messages=[*MESSAGES, {"role": "assistant", "content": turn}, *follow_up],
    )
    # Accepted, and dropped from the prompt as Anthropic does: the same prompt as without it.
    without = claude.messages.create(
        model="tiny",
        max_tokens=4,
        messages=[*MESSAGES, {"role": "assistant", "content": turn[1:]}, *follow_up],
    )
    assert prompt_tokens(valid) == prompt_tokens(without)

    for signature in (signature_of(key, thinking.thinking + " "), "", "\u00e9", None):
        tampered = [{**turn[0], "signature": signature}, *turn[1:]]
        if signature is None:
            del tampered[0]["signature"]
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(
                model="tiny",
                max_tokens=4,
                messages=[*MESSAGES, {"role": "assistant", "content": tampered}, *follow_up],
            )
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert "messages.1.content.0" in err.value.body["error"]["message"]
    changed = [{**turn[0], "thinking": thinking.thinking + "!"}, *turn[1:]]
    with pytest.raises(anthropic.BadRequestError, match="signature"):
        claude.messages.create(
            model="tiny",
            max_tokens=4,
            messages=[*MESSAGES, {"role": "assistant", "content": changed}, *follow_up],
        )


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("max_tokens", "budget", "message"),
    [
        (2000, 1023, "greater than or equal to 1024"),
        (1024, 1024, "`max_tokens` must be greater than `thinking.budget_tokens`"),
    ],
)
def test_budget_is_checked_as_anthropic_does(served, max_tokens, budget, message) -> None:
    import anthropic

    server, _ = served
    with pytest.raises(anthropic.BadRequestError, match=message):
        claude_of(server).messages.create(
            model="tiny",
            max_tokens=max_tokens,
            messages=MESSAGES,
            thinking={"type": "enabled", "budget_tokens": budget},
        )
