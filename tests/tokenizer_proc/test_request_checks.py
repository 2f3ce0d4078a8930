"""One check for a request, offline and served: `LLM.generate` and `LLM.chat` run the tokenizer
worker's own `RequestTokenizer` (tokenizer_proc/request_tokenizer.py), so a bad prompt is
refused with the same message, naming the same field, whether it goes to `zllm serve` (a 400)
or to the offline `LLM` (a ParamError). Real tokenizer, real server, one request each way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from servers import error_of

from zllm import LLM, SamplingParams
from zllm.errors import ParamError

pytestmark = pytest.mark.e2e

LONG_TEXT = "paged attention " * 400  # far more tokens than the tiny model's 512


@dataclass(frozen=True)
class BadRequest:
    """A request as the API spells it: a completion's `prompt` (text or token ids) or a chat's
    `messages`, with sampling fields by their body names. (Without max_tokens a chat asks for
    as many as fit, offline and served; a completion's default is 16, so each sets it.)"""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def body(self) -> tuple[str, dict[str, Any]]:
        if self.messages is not None:
            return "/v1/chat/completions", {"messages": self.messages, **self.fields}
        return "/v1/completions", {"prompt": self.prompt, **self.fields}

    def refuse_offline(self, llm: LLM) -> ParamError:
        fields = dict(self.fields)
        if "logit_bias" in fields:  # JSON's keys are strings
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        params = SamplingParams(**{"max_tokens": None, **fields})
        with pytest.raises(ParamError) as refused:
            if self.messages is not None:
                llm.chat(self.messages, params, use_tqdm=False)
            elif isinstance(self.prompt, str):
                llm.generate(self.prompt, params, use_tqdm=False)
            else:
                llm.generate({"prompt_token_ids": self.prompt}, params, use_tqdm=False)
        return refused.value


# Each made from the model's context length.
CASES: dict[str, Callable[[int], BadRequest]] = {
    "empty text": lambda n: BadRequest(prompt="", fields={"max_tokens": 4}),
    "id out of vocabulary": lambda n: BadRequest(prompt=[5, 10**6], fields={"max_tokens": 4}),
    "prompt fills the context": lambda n: BadRequest(prompt=[5] * n, fields={"max_tokens": 1}),
    "text longer than the context": lambda n: BadRequest(
        prompt=LONG_TEXT, fields={"max_tokens": 4}
    ),
    "max_tokens beyond the context": lambda n: BadRequest(
        prompt=[5] * 10, fields={"max_tokens": n}
    ),
    "chat longer than the context": lambda n: BadRequest(
        messages=[{"role": "user", "content": LONG_TEXT}], fields={"max_tokens": 4}
    ),
    "chat fills the context": lambda n: BadRequest(
        messages=[{"role": "user", "content": LONG_TEXT}]
    ),
    "truncate beyond the context": lambda n: BadRequest(
        prompt=[5] * 10, fields={"max_tokens": 4, "truncate_prompt_tokens": n + 1}
    ),
    "logit_bias out of vocabulary": lambda n: BadRequest(
        prompt="hello", fields={"max_tokens": 4, "logit_bias": {"999999": 1.0}}
    ),
    "stop_token_ids out of vocabulary": lambda n: BadRequest(
        prompt="hello", fields={"max_tokens": 4, "stop_token_ids": [3, 10**6]}
    ),
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, engine_pool, tmp_path_factory):
    with engine_pool.serve(tiny_llama_dir, tmp_path_factory.mktemp("checks") / "server.log") as s:
        yield s


@pytest.mark.parametrize("case", CASES)
def test_offline_and_served_refuse_a_bad_request_alike(llm, server, case):
    max_model_len = llm.config.scheduler.max_model_len
    assert server.config()["engine"]["scheduler"]["max_model_len"] == max_model_len
    request = CASES[case](max_model_len)
    path, body = request.body()
    served = error_of(server.post(path, body), 400)
    offline = request.refuse_offline(llm)
    assert (str(offline), offline.param) == (served["message"], served["param"])
    assert not llm.engine.has_unfinished_requests()  # nothing queued before the refusal
