"""Every request parameter is implemented, tested, or refused by name: through a real
`zllm serve` on the tiny model, over HTTP and with the official openai client.

  refused     fields of OpenAI's chat/completions schemas zllm does not implement: a 400
              "unsupported parameter: X" (docs/serving.md lists them); null counts as unset
  held        store=false, modalities=["text"], metadata, service_tier, prompt_cache_key,
              safety_identifier, best_of == n, unknown fields (ignored with a warning)
  honoured    logit_bias, prompt_logprobs in chat, continuous usage stats, stop strings kept
              in the output, special tokens kept, batches of token-id prompts
"""

from __future__ import annotations

import json

import pytest

from zllm.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from zllm.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, engine_pool, tmp_path_factory):
    log = tmp_path_factory.mktemp("surface") / "server.log"
    with engine_pool.serve(tiny_llama_dir, log, "--served-model-name", "tiny") as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def chat(server, **fields):
    return server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **fields})


def complete(server, **fields):
    return server.post("/v1/completions", {"prompt": "The quick", "max_tokens": 4, **fields})


UNSUPPORTED_VALUES = {
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}],
    "prediction": {"type": "content", "content": "x"},
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "prompt_cache_options": {"ttl": "30m"},
    "prompt_cache_retention": "24h",
    "suffix": "tail",
}


@pytest.mark.parametrize("name", ChatCompletionRequest.UNSUPPORTED)
def test_unsupported_chat_fields_are_400s(server, name) -> None:
    response = chat(server, **{name: UNSUPPORTED_VALUES[name]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == f"unsupported parameter: {name}" and error["param"] == name
    assert chat(server, **{name: None}).status_code == 200  # null is unset


@pytest.mark.parametrize("name", CompletionRequest.UNSUPPORTED)
def test_unsupported_completion_fields_are_400s(server, name) -> None:
    response = complete(server, **{name: UNSUPPORTED_VALUES[name]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == f"unsupported parameter: {name}"


def test_fields_that_hold_as_they_are(server) -> None:
    ok = dict(
        store=False,
        modalities=["text"],
        metadata={"team": "a"},
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="u1",
        user="u1",
        made_up_field=1,  # outside OpenAI's schema: ignored, with a warning in the log
    )
    assert chat(server, **ok).status_code == 200
    assert "fields this server ignores: made_up_field" in server.log_text()
    store = chat(server, store=True)
    assert store.status_code == 400 and store.json()["error"]["param"] == "store"
    audio = chat(server, modalities=["text", "audio"])
    assert audio.status_code == 400 and audio.json()["error"]["param"] == "modalities"
    assert complete(server, n=2, best_of=2).status_code == 200
    best_of = complete(server, n=1, best_of=3)
    assert best_of.status_code == 400 and best_of.json()["error"]["param"] == "best_of"


def greedy_tokens(server, **fields) -> list[int]:
    body = {"prompt": "The quick", "max_tokens": 6, "temperature": 0.0, "logprobs": 0, **fields}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_logit_bias(server, tokenizer, tiny_llama_dir) -> None:
    from zllm import LLM, SamplingParams

    forced_id = tokenizer.encode(" fox", add_special_tokens=False)[0]
    forced = greedy_tokens(server, logit_bias={str(forced_id): 100}, ignore_eos=True)
    assert forced == [tokenizer.decode([forced_id])] * 6
    # The greedy first token (the same engine offline gives its id), then banned.
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    first_id = LLM(tiny_llama_dir).generate("The quick", greedy)[0].outputs[0].token_ids[0]
    plain = greedy_tokens(server)
    banned = greedy_tokens(server, logit_bias={str(first_id): -100})
    assert banned[0] != plain[0]
    bad = complete(server, logit_bias={"999999": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_prompt_logprobs_in_chat(server, tokenizer) -> None:
    body = chat(server, prompt_logprobs=1).json()
    prompt_logprobs = body["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    assert len(prompt_logprobs) == body["usage"]["prompt_tokens"]
    assert all(len(position) >= 1 for position in prompt_logprobs[1:])


def sse_chunks(response) -> list[dict]:
    lines = [line for line in response.text.split("\n") if line.startswith("data: ")]
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


def test_continuous_usage_stats(server) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    response = chat(server, stream=True, stream_options=options, max_tokens=5, ignore_eos=True)
    chunks = sse_chunks(response)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c.get("choices")]
    assert all(c.get("usage") for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_include_stop_str_in_output(server) -> None:
    text = complete(server, temperature=0.0, max_tokens=12).json()["choices"][0]["text"]
    stop = text[2:5]
    assert stop
    kept = complete(
        server, temperature=0.0, max_tokens=12, stop=[stop], include_stop_str_in_output=True
    )
    dropped = complete(server, temperature=0.0, max_tokens=12, stop=[stop])
    assert kept.json()["choices"][0]["text"] == text[: text.index(stop) + len(stop)]
    assert dropped.json()["choices"][0]["text"] == text[: text.index(stop)]


def test_skip_special_tokens(server, tokenizer) -> None:
    special = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(special) == 1
    fields = dict(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={str(special[0]): 100})
    kept = complete(server, skip_special_tokens=False, **fields).json()["choices"][0]["text"]
    skipped = complete(server, **fields).json()["choices"][0]["text"]
    assert kept == "<|im_start|>" * 3 and skipped == ""


def test_a_batch_of_token_id_prompts(server, tokenizer) -> None:
    prompts = [tokenizer.encode("The quick", add_special_tokens=False), [5, 17, 99]]
    body = complete(server, prompt=prompts, temperature=0.0, max_tokens=3, n=2).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])
    single = complete(server, prompt=prompts[1], temperature=0.0, max_tokens=3).json()
    assert body["choices"][2]["text"] == single["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------
# The Responses API (stateless)


def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_responses_text_and_messages(server) -> None:
    client = openai_client(server)
    answer = client.responses.create(
        model="tiny",
        input="The quick brown fox",
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0.0,
    )
    assert answer.object == "response" and answer.id.startswith("resp_")
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output_text and answer.usage.output_tokens == 6
    # The same conversation as chat messages gives the same text.
    chat = client.chat.completions.create(
        model="tiny",
        max_tokens=6,
        temperature=0.0,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "The quick brown fox"},
        ],
    )
    assert answer.output_text == chat.choices[0].message.content
    turns = client.responses.create(
        model="tiny",
        max_output_tokens=6,
        temperature=0.0,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "The quick"}]},
            {"role": "assistant", "content": "brown"},
            {"role": "user", "content": "fox"},
        ],
    )
    assert turns.output_text


LONG_TEXT = " ".join(f"word{i}" for i in range(60))  # well over one KV block


@pytest.mark.parametrize(
    "path, body, cached",
    [
        ("/v1/completions", {"prompt": LONG_TEXT},
         lambda u: u["prompt_tokens_details"]["cached_tokens"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]},
         lambda u: u["prompt_tokens_details"]["cached_tokens"]),
        ("/v1/responses", {"input": LONG_TEXT},
         lambda u: u["input_tokens_details"]["cached_tokens"]),
        ("/v1/messages", {"messages": [{"role": "user", "content": LONG_TEXT}]},
         lambda u: u["cache_read_input_tokens"]),
    ],
)  # fmt: skip
def test_cache_salt_on_every_generation_api(server, path, body, cached) -> None:
    """vLLM's `cache_salt`: a request reuses cached KV blocks only of requests that gave the
    same salt; an empty salt is a 400 naming the field."""
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    body = {"model": "tiny", limit: 2, **body}

    def usage(salt: str) -> dict:
        r = server.post(path, {**body, "cache_salt": salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    first = path.replace("/", "") + "-a"  # a salt no other test of the module uses
    assert cached(usage(first)) == 0
    assert cached(usage(first)) > 0
    assert cached(usage(first + "b")) == 0
    r = server.post(path, {**body, "cache_salt": ""})
    assert r.status_code == 400, r.text
    assert "cache_salt must be a non-empty string" in r.text


def test_responses_stream(server) -> None:
    client = openai_client(server)
    kwargs = dict(model="tiny", input="The quick brown fox", max_output_tokens=6, temperature=0.0)
    whole = client.responses.create(**kwargs)
    kinds, text = [], ""
    for event in client.responses.create(**kwargs, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "response.output_item.done" in kinds and text == whole.output_text


def test_responses_are_stateless(server) -> None:
    import openai

    client = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model="tiny", input="hi", store=True)
