"""The tokenizer and detokenizer workers' logic, without sockets."""

from __future__ import annotations

import pytest

from zllm.detokenizer_proc.detokenizer import Detokenizer
from zllm.protocol import (
    DetokenizerBatch,
    DetokRequest,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    RequestRejected,
    TokenizeRequest,
)
from zllm.sampling_params import SamplingParams
from zllm.text.tokenizer import load_tokenizer
from zllm.tokenizer_proc.request_tokenizer import RequestTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def test_tokenizer_worker_builds_core_requests(tokenizer):
    handle = RequestTokenizer(tokenizer, max_model_len=64, vocab_size=tokenizer.vocab_size)
    params = SamplingParams(max_tokens=4)
    out = handle(TokenizeRequest("a", params, prompt="The quick brown fox"))
    assert isinstance(out, EngineCoreRequest)
    assert out.prompt_token_ids == tokenizer.encode("The quick brown fox")
    assert out.eos_token_ids == [tokenizer.eos_token_id]
    chat = handle(TokenizeRequest("b", params, messages=[{"role": "user", "content": "Hi"}]))
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    ids = handle(TokenizeRequest("c", params, prompt_token_ids=[5, 6]))
    assert ids.prompt_token_ids == [5, 6]


@pytest.mark.parametrize(
    "request_kwargs, max_tokens, message, param",
    [
        (dict(prompt=""), 4, "empty", "prompt"),
        (dict(prompt_token_ids=[5, 10**7]), 4, "out of vocabulary", "prompt"),
        (dict(prompt_token_ids=[5] * 64), 4, "maximum context length is 64 tokens", "prompt"),
        (dict(prompt_token_ids=[5] * 10), 60, "you requested 70 tokens", "prompt"),
        (
            dict(messages=[{"role": "user", "content": "x " * 100}]),
            4,
            "in the messages",
            "messages",
        ),
        (
            dict(messages=[{"content": "no role"}], chat_template="{{ messages[0].role.x() }}"),
            4,
            "prompt",
            "messages",
        ),
    ],
)
def test_tokenizer_worker_errors(tokenizer, request_kwargs, max_tokens, message, param):
    handle = RequestTokenizer(tokenizer, max_model_len=64, vocab_size=tokenizer.vocab_size)
    out = handle(TokenizeRequest("r", SamplingParams(max_tokens=max_tokens), **request_kwargs))
    assert isinstance(out, RequestRejected)
    assert message in out.message and out.status == 400 and out.param == param
    if "maximum context length" in message:
        assert out.message.startswith("This model's maximum context length is")


def _out(req_id, index, tokens, reason=None):
    return EngineCoreOutput(
        req_id=req_id, sample_index=index, new_token_ids=tokens, finish_reason=reason
    )


def test_detokenizer_streams_text_and_holds_back_possible_stop(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    detok = Detokenizer(tokenizer)
    info = DetokRequest("r", prompt_tail=[], stop=["lazy dog"])
    deltas, stops = detok.process(DetokenizerBatch([info], [_out("r", 0, ids[:1])]))
    streamed = "".join(d.text for d in deltas)
    for i in range(1, len(ids)):
        deltas, stops = detok.process(DetokenizerBatch([], [_out("r", 0, ids[i : i + 1])]))
        streamed += "".join(d.text for d in deltas)
        if stops:
            break
    assert streamed == "The quick brown fox jumps over the "
    assert [(s.req_id, s.sample_index) for s in stops] == [("r", 0)]
    assert deltas[-1].finish_reason == FinishReason.STOP and deltas[-1].stop_reason == "lazy dog"
    assert "r" not in detok.requests  # state dropped once every sample finished
    # Tokens computed after the stop (the core finds out a step later) are dropped.
    assert detok.process(DetokenizerBatch([], [_out("r", 0, ids[-1:])])) == ([], [])


def test_detokenizer_multibyte_and_samples(tokenizer):
    text = "Emoji 🙂 and CJK 你好世界"
    ids = tokenizer.encode(text)
    detok = Detokenizer(tokenizer)
    info = DetokRequest("m", prompt_tail=[], n=2)
    pieces = {0: "", 1: ""}
    detok.process(DetokenizerBatch([info], []))
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        outs = [_out("m", k, [t], FinishReason.LENGTH if last else None) for k in (0, 1)]
        for d in detok.process(DetokenizerBatch([], outs))[0]:
            assert "\ufffd" not in d.text  # never half a character
            pieces[d.index] += d.text
    assert pieces == {0: text, 1: text}
    assert "m" not in detok.requests


def test_an_n_request_failed_before_its_samples_forked_leaves_no_state(tokenizer):
    """The core fails an n > 1 request that never forked with an error on sample 0 only
    (the others do not exist yet): that error ends the request here too (issue 56: its
    state stayed until the worker restarted)."""
    detok = Detokenizer(tokenizer)
    detok.process(DetokenizerBatch([DetokRequest("f", prompt_tail=[], n=4)], []))
    failed = _out("f", 0, [], FinishReason.ERROR)
    deltas, _ = detok.process(DetokenizerBatch([], [failed]))
    assert [d.finish_reason for d in deltas] == [FinishReason.ERROR]
    assert "f" not in detok.requests
    # After the fork every sample fails: the first error ends it, the rest are dropped.
    detok.process(DetokenizerBatch([DetokRequest("g", prompt_tail=[], n=2)], []))
    outs = [_out("g", k, [], FinishReason.ERROR) for k in (0, 1)]
    deltas, _ = detok.process(DetokenizerBatch([], outs))
    assert [d.index for d in deltas] == [0] and "g" not in detok.requests


def test_detokenizer_abort_and_reset(tokenizer):
    detok = Detokenizer(tokenizer)
    detok.process(DetokenizerBatch([DetokRequest("a", []), DetokRequest("b", [])], []))
    detok.process(DetokenizerBatch(aborted=["a"]))
    assert set(detok.requests) == {"b"}
    detok.process(DetokenizerBatch([], [], reset=True))
    assert detok.requests == {}


def test_prompt_ending_inside_a_character_leaks_nothing_into_the_output(tokenizer):
    """A prompt whose last token is the first byte of a UTF-8 character: the output is its own
    tokens' text (never the prompt's), a character it leaves unfinished comes out as U+FFFD,
    and the streamed deltas add up to what decoding the output alone gives."""
    from zllm.text.incremental_detokenizer import IncrementalDetokenizer

    backend = tokenizer.backend
    lead = backend.token_to_id("Ã")  # byte 0xc3 alone: the first of a two-byte character
    cont = backend.token_to_id("©")  # byte 0xa9: a continuation byte
    word = backend.encode("the").ids
    assert lead is not None and cont is not None
    prompt = backend.encode("hello").ids + [lead]
    for output in ([cont, cont], [*word, cont], [cont, *word], [lead, cont, *word]):
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = []
        for t in output:
            detok.update([t])
            deltas.append(detok.take_delta(finished=False))
        deltas.append(detok.take_delta(finished=True))
        text = "".join(deltas)
        assert "hello" not in text, (output, text)
        assert text == backend.decode(output, skip_special_tokens=True), (output, deltas)
