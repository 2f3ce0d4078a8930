"""frontend/openai/format.py, openai_choices.py and logprobs.py without a server: request
fields to SamplingParams (with the field each error names), and engine output deltas to
OpenAI choices, logprobs and usage."""

from __future__ import annotations

import msgspec
import pytest

from zllm.errors import RequestError
from zllm.frontend.openai.choices import ChatAssembler, CompletionAssembler
from zllm.frontend.openai.format import chat_params, completion_params, prompt_inputs
from zllm.frontend.openai.logprobs import LogprobText
from zllm.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest, decode_body
from zllm.protocol import FinishReason, LogprobsLists, RequestOutputDelta
from zllm.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def names(tiny_llama_dir) -> LogprobText:
    return LogprobText(load_tokenizer(tiny_llama_dir))


def delta(index: int, text: str, tokens: list[int], finish=None, **kw) -> RequestOutputDelta:
    kw.setdefault("num_prompt_tokens", 4)
    return RequestOutputDelta("r", index, text, tokens, finish_reason=finish, **kw)


def lists(rows: list[list[tuple[int, float]]], ranks: list[int]) -> LogprobsLists:
    """Logprob rows, chosen token first: [(token id, logprob), ...]."""
    return LogprobsLists(
        [[t for t, _ in row] for row in rows], [[lp for _, lp in row] for row in rows], ranks
    )


def completion(names, prompts, n=1, echo=False, echo_only=False, logprobs=False):
    return CompletionAssembler(
        n=n,
        prompts=prompts,
        echo=echo,
        echo_only=echo_only,
        want_logprobs=logprobs,
        want_prompt_logprobs=False,
        names=names,
    )


# ---- requests ----------------------------------------------------------------------------------


def decode(cls, body: dict):
    return msgspec.json.decode(msgspec.json.encode(body), type=cls)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "stop": ["ok", ""]}, "stop[1]"),
        ({"prompt": [[1, 2], [3, -1]]}, "prompt[1][1]"),
        ({"prompt": "x", "n": "two"}, "n"),
    ],
)
def test_decoding_errors_name_the_field(body, param):
    with pytest.raises(RequestError) as err:
        decode_body(msgspec.json.encode(body), CompletionRequest)
    assert err.value.param == param and err.value.status == 400


@pytest.mark.parametrize(
    "body, param",
    [
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"max_tokens": 513}, "max_tokens"),
    ],
)
def test_completion_field_errors_name_the_field(body, param):
    with pytest.raises(RequestError) as err:
        completion_params(decode(CompletionRequest, {"prompt": "x", **body}), max_model_len=512)
    assert err.value.param == param and err.value.status == 400


@pytest.mark.parametrize(
    "body, param",
    [
        # The request's own name for the field, not SamplingParams'.
        ({"max_completion_tokens": 1000}, "max_completion_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 1000}, "max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"min_tokens": 9, "max_completion_tokens": 3}, "min_tokens"),
    ],
)
def test_chat_field_errors_use_the_requests_names(body, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(RequestError) as err:
        chat_params(decode(ChatCompletionRequest, body), max_model_len=512)
    assert err.value.param == param


def test_echo_with_max_tokens_zero_scores_the_prompt():
    params, echo_only = completion_params(
        decode(CompletionRequest, {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1})
    )
    assert echo_only and params.max_tokens == 1 and params.prompt_logprobs == 1


def test_prompt_inputs():
    assert [p.text for p in prompt_inputs(["a", "b"])] == ["a", "b"]
    assert [p.token_ids for p in prompt_inputs([1, 2])] == [[1, 2]]
    assert [p.token_ids for p in prompt_inputs([[1], [2, 3]])] == [[1], [2, 3]]
    with pytest.raises(RequestError, match="not a mix"):
        prompt_inputs(["a", [1]])


# ---- completions -------------------------------------------------------------------------------


def test_n_samples_of_several_prompts_are_numbered_and_counted(names):
    prompts = prompt_inputs(["one", "two"])
    asm = completion(names, prompts, n=2)
    # Interleaved as the engine sends them; prompt 1's samples are choices 2 and 3.
    asm.collect(1, delta(1, "b", [5], num_prompt_tokens=3, num_cached_tokens=2))
    asm.collect(0, delta(0, "x", [6], num_prompt_tokens=4))
    asm.collect(0, delta(1, "y", [7, 8], FinishReason.LENGTH))
    asm.collect(1, delta(0, "a", [9], FinishReason.STOP, stop_reason="!", num_prompt_tokens=3))
    asm.collect(0, delta(0, "z", [10], FinishReason.LENGTH))
    asm.collect(1, delta(1, "c", [11], FinishReason.LENGTH, num_prompt_tokens=3))
    choices = asm.finish()
    assert [(c.index, c.text, c.finish_reason) for c in choices] == [
        (0, "xz", "length"),
        (1, "y", "length"),
        (2, "a", "stop"),
        (3, "bc", "length"),
    ]
    assert choices[2].stop_reason == "!"
    usage = asm.usage.info()
    # Each prompt counted once (not per sample); every sample's tokens counted.
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (7, 7, 14)
    assert usage.prompt_tokens_details.cached_tokens == 2


def test_streamed_fragments_carry_the_finish_reason_once(names):
    asm = completion(names, prompt_inputs("p"))
    first = asm.add(0, delta(0, "Hel", [1]))
    assert (first.index, first.text, first.finish_reason) == (0, "Hel", None)
    assert asm.add(0, delta(0, "", [2])) is None  # nothing to send (text held back)
    last = asm.add(0, delta(0, "lo", [3], FinishReason.STOP))
    assert (last.text, last.finish_reason) == ("lo", "stop")


def test_legacy_logprobs_offsets_and_byte_labels(names):
    tok = names.tokenizer
    quick, brown = tok.encode("The quick")[-1], tok.encode(" brown")[0]
    half = tok.backend.token_to_id("ð")  # byte 0xf0 alone: part of a UTF-8 character
    asm = completion(names, prompt_inputs("The"), logprobs=True)
    lp = lists([[(quick, -0.5), (brown, -1.5)], [(half, -2.0), (quick, -2.5)]], [1, 1])
    asm.collect(0, delta(0, " quick", [quick, half], FinishReason.LENGTH, logprobs=lp))
    (choice,) = asm.finish()
    out = choice.logprobs
    assert out.tokens == [names.text(quick), "bytes:\\xf0"]
    assert out.token_logprobs == [-0.5, -2.0]
    assert out.text_offset == [0, len(names.text(quick))]
    assert out.top_logprobs[0] == {names.text(quick): -0.5, names.text(brown): -1.5}
    assert out.top_logprobs[1]["bytes:\\xf0"] == -2.0


def test_echo_prepends_the_prompt_and_its_logprobs(names):
    tok = names.tokenizer
    ids = tok.encode("The quick")
    asm = completion(names, prompt_inputs(ids), echo=True, logprobs=True)
    prompt_lp = lists([[(t, -0.25)] for t in ids[1:]], [3] * (len(ids) - 1))
    out_lp = lists([[(7, -0.75)]], [1])
    asm.collect(
        0, delta(0, "!", [7], FinishReason.LENGTH, logprobs=out_lp, prompt_logprobs=prompt_lp)
    )
    (choice,) = asm.finish()
    prompt_text = tok.decode(ids, skip_special_tokens=False)
    assert choice.text == prompt_text + "!"
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs == [None] + [-0.25] * (len(ids) - 1) + [-0.75]
    assert lp.top_logprobs[0] is None
    assert lp.text_offset[-1] == len(prompt_text)  # the output's offset, after the echo


def test_echo_only_returns_the_prompt_and_no_completion_tokens(names):
    asm = completion(names, prompt_inputs("The quick"), echo=True, echo_only=True)
    asm.collect(0, delta(0, "zzz", [7], FinishReason.STOP))
    (choice,) = asm.finish()
    assert choice.text == "The quick" and choice.finish_reason == "length"
    assert asm.usage.info().completion_tokens == 0


def test_a_failed_request_raises(names):
    asm = completion(names, prompt_inputs("p"))
    with pytest.raises(RequestError) as err:
        asm.add(0, delta(0, "", [], FinishReason.ERROR, stop_reason="boom"))
    assert err.value.status == 500 and "boom" in err.value.message


# ---- chat --------------------------------------------------------------------------------------


def test_chat_choices_logprobs_and_usage(names):
    tok = names.tokenizer
    hi = tok.encode("Hi")[0]
    asm = ChatAssembler(n=2, want_logprobs=True, want_prompt_logprobs=True, names=names)
    prompt_lp = lists([[(hi, -1.0)]], [2])
    asm.collect(0, delta(1, "Yo", [hi], logprobs=lists([[(hi, -0.5)]], [1])))
    asm.collect(
        0,
        delta(0, "Hi", [hi], FinishReason.STOP, logprobs=lists([[(hi, -0.1)]], [1]),
              prompt_logprobs=prompt_lp),
    )  # fmt: skip
    asm.collect(0, delta(1, "!", [5], FinishReason.LENGTH, logprobs=lists([[(5, -0.2)]], [1])))
    choices = asm.finish()
    assert [(c.message.content, c.finish_reason) for c in choices] == [
        ("Hi", "stop"),
        ("Yo!", "length"),
    ]
    content = choices[1].logprobs.content
    assert [(e.token, e.logprob) for e in content] == [
        (names.text(hi), -0.5),
        (names.text(5), -0.2),
    ]
    assert content[0].bytes == list(names.text(hi).encode())
    assert asm.prompt_logprobs[0] is None and asm.prompt_logprobs[1][hi].rank == 2
    assert asm.usage.info().completion_tokens == 3
