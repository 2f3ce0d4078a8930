"""vLLM's request extras through a real `zllm serve` and the openai client (extra_body):
truncate_prompt_tokens, bad_words, allowed_token_ids, return_tokens_as_token_ids,
continue_final_message and documents, each checked against its definition in vLLM's docs.

The token ids an answer is made of are read back with return_tokens_as_token_ids (itself
checked against the text), so the masks are checked token by token.
"""

from __future__ import annotations

import pytest
from servers import error_of
from tiny_models import write_tiny_model

from zllm.errors import ParamError
from zllm.inputs import truncate_prompt
from zllm.text.bad_words import banned_next, encode_bad_words
from zllm.text.continue_final import leave_final_message_open
from zllm.text.tokenizer import load_tokenizer

# A RAG template: documents, when given, become a system turn before the conversation (and a
# reasoning effort another, as gpt-oss-style templates set a reasoning level).
RAG_TEMPLATE = (
    "{% if documents %}<|im_start|>system\nDocuments:\n"
    "{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% if reasoning_effort %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = "the quick brown fox jumps over the lazy dog and then the cat sat on the mat"
MAX_MODEL_LEN = 256


# ---- the rules, without a server ----------------------------------------------------------


def test_bad_words_ban_the_last_token_after_the_rest() -> None:
    words = [[7], [3, 4, 5]]
    assert banned_next(words, []) == [7]  # one token: always
    assert banned_next(words, [1, 3]) == [7]  # prefix [3, 4] not yet written
    assert banned_next(words, [9, 3, 4]) == [7, 5]
    assert banned_next(words, [3, 4, 9]) == [7]


def test_allowed_tokens_that_are_all_bad_words_are_refused() -> None:
    """No token left to sample is a request error, not a row of -inf logits."""
    from zllm import SamplingParams
    from zllm.inputs import check_token_params

    params = SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[5], [6], [6, 7]])
    with pytest.raises(ParamError) as err:
        check_token_params(params, 100)
    assert err.value.param == "allowed_token_ids"
    still_one = SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[5], [3, 6]])
    check_token_params(still_one, 100)


def test_truncation_keeps_the_last_tokens() -> None:
    ids = list(range(10))
    assert truncate_prompt(ids, 3, 20) == [7, 8, 9]
    assert truncate_prompt(ids, -1, 20) == ids  # -1: the context length
    assert truncate_prompt(ids, -1, 4) == [6, 7, 8, 9]
    assert truncate_prompt(ids, None, 20) == ids
    with pytest.raises(ParamError) as err:
        truncate_prompt(ids, 21, 20)
    assert err.value.param == "truncate_prompt_tokens"


def test_the_final_message_is_left_open() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A is "}]
    rendered = "<u>Q</u><a>A is</a>\n"  # the template trimmed the content
    assert leave_final_message_open(rendered, messages) == "<u>Q</u><a>A is"
    with pytest.raises(ValueError, match="does not appear"):
        leave_final_message_open("<u>Q</u>", messages)


# ---- through the server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, engine_pool):
    root = tmp_path_factory.mktemp("extras")
    model = write_tiny_model(root / "model", chat_template=RAG_TEMPLATE)
    with engine_pool.serve(
        str(model),
        root / "server.log",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--trust-request-chat-template",
    ) as server:
        yield server, load_tokenizer(str(model))


def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def greedy(client, prompt, max_tokens: int = 8, **extra):
    """A greedy completion with its tokens named by id."""
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True, **extra}
    return client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=0,
        extra_body=body,
    )


def token_ids(names: list[str]) -> list[int]:
    assert all(name.startswith("token_id:") for name in names), names
    return [int(name.removeprefix("token_id:")) for name in names]


@pytest.mark.e2e
def test_return_tokens_as_token_ids(served) -> None:
    server, tokenizer = served
    client = openai_client(server)
    named = greedy(client, PROMPT, logprobs=2)
    plain = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = named.choices[0]
    ids = token_ids(choice.logprobs.tokens)
    assert len(ids) == 8
    assert tokenizer.decode(ids) == choice.text == plain.choices[0].text
    for t, label in zip(ids, plain.choices[0].logprobs.tokens, strict=True):
        text = tokenizer.decode([t], skip_special_tokens=False)  # part of a character: bytes
        assert label == text or ("\ufffd" in text and label.startswith("bytes:"))
    for top in choice.logprobs.top_logprobs:
        token_ids(list(top))
    # chat, streamed: every content token and top candidate is named by id
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    text, streamed = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            for lp in (c.logprobs.content if c.logprobs else None) or []:
                streamed += token_ids([lp.token])
                token_ids([top.token for top in lp.top_logprobs])
                token_text = tokenizer.decode([streamed[-1]])
                if "\ufffd" not in token_text:  # bytes stay the token's text's
                    assert lp.bytes == list(token_text.encode())
    assert len(streamed) == 6
    assert tokenizer.decode(streamed) == text


@pytest.mark.e2e
def test_truncate_prompt_tokens_keeps_the_last_k(served) -> None:
    server, tokenizer = served
    client = openai_client(server)
    ids = tokenizer.encode(PROMPT)
    k = 5
    assert len(ids) > k
    cut = greedy(client, PROMPT, truncate_prompt_tokens=k)
    alone = greedy(client, ids[-k:])
    assert cut.usage.prompt_tokens == k
    assert token_ids(cut.choices[0].logprobs.tokens) == token_ids(alone.choices[0].logprobs.tokens)
    whole = greedy(client, PROMPT, truncate_prompt_tokens=-1)  # the context length: all fits
    assert whole.usage.prompt_tokens == len(ids)
    # chat: the rendered prompt is cut
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": k},
    )
    assert chat.usage.prompt_tokens == k
    # embeddings: the vector of the last k tokens
    embedded = client.embeddings.create(
        model="tiny", input=PROMPT, extra_body={"truncate_prompt_tokens": k}
    )
    expected = client.embeddings.create(model="tiny", input=[ids[-k:]])
    assert embedded.usage.prompt_tokens == k
    assert embedded.data[0].embedding == pytest.approx(expected.data[0].embedding, abs=1e-5)
    # beyond the context length, or 0: a 400 naming the field
    for bad in (MAX_MODEL_LEN + 1, 0):
        r = server.post(
            "/v1/completions",
            {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "truncate_prompt_tokens": bad},
        )
        assert error_of(r, 400)["param"] == "truncate_prompt_tokens"


def _first_word_token(tokenizer, ids: list[int]) -> tuple[int, str]:
    """The first generated token that is a word on its own: its text, stripped, encodes
    back to it (bare or after a space)."""
    for t in ids:
        word = tokenizer.decode([t]).strip()
        if word and [t] in encode_bad_words([word], tokenizer):
            return t, word
    raise AssertionError(f"no whole-word token among {ids}")


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


@pytest.mark.e2e
def test_bad_words_never_appear(served) -> None:
    server, tokenizer = served
    client = openai_client(server)
    before = token_ids(greedy(client, PROMPT, max_tokens=16).choices[0].logprobs.tokens)
    token, word = _first_word_token(tokenizer, before)
    after = greedy(client, PROMPT, max_tokens=16, bad_words=[word])
    ids = token_ids(after.choices[0].logprobs.tokens)
    assert token not in ids
    assert ids != before
    for encoding in encode_bad_words([word], tokenizer):
        assert not _contains(ids, encoding)
    # a two-token word: its second token never follows its first
    pair = before[:2]
    two = tokenizer.decode(pair)
    encodings = encode_bad_words([two], tokenizer)
    banned = greedy(client, PROMPT, max_tokens=16, bad_words=[two])
    out = token_ids(banned.choices[0].logprobs.tokens)
    for encoding in encodings:
        assert not _contains(out, encoding)
    if pair in encodings:  # what greedy wrote first is now impossible
        assert out[:2] != pair


@pytest.mark.e2e
def test_allowed_token_ids_only(served) -> None:
    server, tokenizer = served
    client = openai_client(server)
    allowed = tokenizer.encode(" the cat sat on mat", add_special_tokens=False)
    answer = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=1.0,
        seed=3,
        logprobs=0,
        extra_body={
            "ignore_eos": True,
            "allowed_token_ids": allowed,
            "return_tokens_as_token_ids": True,
        },
    )
    ids = token_ids(answer.choices[0].logprobs.tokens)
    assert len(ids) == 24
    assert set(ids) <= set(allowed)
    vocab = tokenizer.vocab_size
    r = server.post(
        "/v1/completions",
        {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "allowed_token_ids": [1, vocab]},
    )
    error = error_of(r, 400)
    assert error["param"] == "allowed_token_ids" and str(vocab) in error["message"]
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "x", "allowed_token_ids": []})
    assert error_of(r, 400)["param"] == "allowed_token_ids"


@pytest.mark.e2e
def test_continue_final_message(served) -> None:
    server, tokenizer = served
    client = openai_client(server)
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    # The template's own turn format, the assistant's turn left open.
    expected = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nThe colour is"
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokens = server.post("/tokenize", body).json()["tokens"]
    assert tokens == tokenizer.encode(expected, add_special_tokens=False)
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0.0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True,
                    "ignore_eos": True},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == len(tokens)
    # the model goes on from the open message: as the same prompt sent as tokens does
    same = greedy(client, tokens)
    assert chat.choices[0].message.content == same.choices[0].text
    # a generation prompt would open a new turn: both is a 400
    r = server.post(
        "/v1/chat/completions", {"model": "tiny", **body, "add_generation_prompt": True}
    )
    assert error_of(r, 400)["param"] == "continue_final_message"


@pytest.mark.e2e
def test_documents_reach_the_template(served) -> None:
    server, tokenizer = served
    client = openai_client(server)
    messages = [{"role": "user", "content": "What is it?"}]
    documents = [{"title": "Fox", "text": "A fox is quick."}, {"title": "Dog", "text": "Lazy."}]
    expected = (
        "<|im_start|>system\nDocuments:\n[Fox] A fox is quick.\n[Dog] Lazy.\n<|im_end|>\n"
        "<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    )
    want = tokenizer.encode(expected, add_special_tokens=False)
    tokens = server.post("/tokenize", {"messages": messages, "documents": documents}).json()
    assert tokens["tokens"] == want
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, extra_body={"documents": documents}
    )
    assert chat.usage.prompt_tokens == len(want)
    bare = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert bare.usage.prompt_tokens < len(want)
    # given twice, which one was meant is unknowable: a 400
    r = server.post(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": messages,
            "documents": documents,
            "chat_template_kwargs": {"documents": documents},
        },
    )
    assert error_of(r, 400)["param"] == "documents"


# ---- offline: the same fields on SamplingParams and LLM.chat -------------------------------


def test_offline_llm_takes_the_extras(tiny_llama_dir) -> None:
    from zllm import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=64 << 20)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(PROMPT)
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    cut, alone = llm.generate(
        [PROMPT, {"prompt_token_ids": ids[-4:]}],
        [SamplingParams(**greedy, truncate_prompt_tokens=4), SamplingParams(**greedy)],
        use_tqdm=False,
    )
    assert len(cut.prompt_token_ids) == 4
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    before = alone.outputs[0].token_ids
    allowed = sorted(set(ids))[:5]
    masked = llm.generate(
        {"prompt_token_ids": ids[-4:]},
        SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True,
                       allowed_token_ids=allowed),
        use_tqdm=False,
    )[0]  # fmt: skip
    assert set(masked.outputs[0].token_ids) <= set(allowed)
    word = next(
        (w for t in before if (w := tokenizer.decode([t]).strip())
         and [t] in encode_bad_words([w], tokenizer)),
        None,
    )  # fmt: skip
    assert word is not None, before
    banned = llm.generate(
        {"prompt_token_ids": ids[-4:]}, SamplingParams(**greedy, bad_words=[word]), use_tqdm=False
    )[0]
    for encoding in encode_bad_words([word], tokenizer):
        assert not _contains(list(banned.outputs[0].token_ids), encoding)
    with pytest.raises(ParamError) as err:
        llm.generate(PROMPT, SamplingParams(**greedy, allowed_token_ids=[10**6]), use_tqdm=False)
    assert err.value.param == "allowed_token_ids"


@pytest.mark.e2e
def test_reasoning_effort_reaches_the_template(served) -> None:
    """Chat's `reasoning_effort` and Responses' `reasoning.effort` are template variables, as
    vLLM passes them; given twice (the field and chat_template_kwargs) is a 400."""
    server, tokenizer = served
    client = openai_client(server)
    messages = [{"role": "user", "content": "Think?"}]
    expected = (
        "<|im_start|>system\nReasoning: high<|im_end|>\n"
        "<|im_start|>user\nThink?<|im_end|>\n<|im_start|>assistant\n"
    )
    want = len(tokenizer.encode(expected, add_special_tokens=False))
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, reasoning_effort="high"
    )
    assert chat.usage.prompt_tokens == want
    answer = client.responses.create(
        model="tiny", input=messages, max_output_tokens=2, reasoning={"effort": "high"}
    )
    assert answer.usage.input_tokens == want
    bare = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert bare.usage.prompt_tokens < want
    r = server.post(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": messages,
            "reasoning_effort": "low",
            "chat_template_kwargs": {"reasoning_effort": "low"},
        },
    )
    assert error_of(r, 400)["param"] == "reasoning_effort"


@pytest.mark.e2e
def test_a_requests_chat_template_renders_in_tokenize_as_in_chat(served) -> None:
    """With --trust-request-chat-template, /tokenize renders a body's `chat_template` as chat
    completions does (it was ignored there: the model's own template rendered)."""
    server, tokenizer = served
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    messages = [{"role": "user", "content": "What is it?"}]
    want = tokenizer.encode("<<What is it?>>", add_special_tokens=False)
    body = {"messages": messages, "chat_template": template}
    assert server.post("/tokenize", body).json()["tokens"] == want
    chat = openai_client(server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, extra_body={"chat_template": template}
    )
    assert chat.usage.prompt_tokens == len(want)
