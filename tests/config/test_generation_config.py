"""Every end-of-sequence id a model declares stops generation, and generation_config.json's
sampling values are the defaults of requests that leave them unset (`--generation-config`).

The model is the tiny random Llama. Its extra eos ids are tokens it really emits greedily:
one declared in config.json, one in generation_config.json, each picked from a first run
that ignores EOS, so the engine meets them where the test expects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from zllm import LLM, SamplingParams
from zllm.cli import main as cli_main
from zllm.config.engine_args import EngineArgs
from zllm.config.generation import FILE_NAME, SamplingDefaults, read_generation_config
from zllm.frontend.openai.format import chat_params
from zllm.frontend.openai.protocol import ChatCompletionRequest, decode_body
from zllm.protocol import EngineCoreRequest, TokenizeRequest
from zllm.tokenizer_proc.request_tokenizer import RequestTokenizer

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paged attention stores"]
FREE_RUN = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
MAX_NEW_TOKENS = 6
KV_BYTES = 32 << 20


@dataclass
class Model:
    """The tiny model directory, and what its first run (no extra eos ids yet) produced."""

    path: str
    eos: int  # the tokenizer's EOS, config.json's first id
    from_config: int  # the second id in config.json
    from_generation_config: int  # generation_config.json's
    free_runs: list[list[int]]  # greedy, ignore_eos, 24 tokens per prompt

    @property
    def eos_ids(self) -> set[int]:
        return {self.eos, self.from_config, self.from_generation_config}


def pick_token(run: list[int], other: list[int], eos: int) -> int:
    """A token `run` emits at position >= 2 before any EOS, for the first time there, and
    that `other` never emits: as an eos id it ends `run` exactly there and leaves `other`."""
    for i, token in enumerate(run):
        if token == eos:
            break
        if i >= 2 and token not in run[:i] and token not in other:
            return token
    raise AssertionError(f"no usable token in {run}")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    from tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("gen-config") / "model")
    (path / FILE_NAME).unlink()  # transformers wrote one (eos only); ours comes below
    first = LLM(str(path), kv_cache_memory_bytes=KV_BYTES)
    eos = first.get_tokenizer().eos_token_id
    runs = [o.outputs[0].token_ids for o in first.generate(PROMPTS, FREE_RUN, use_tqdm=False)]
    del first
    a = pick_token(runs[0], runs[1], eos)
    b = pick_token(runs[1], runs[0], eos)
    config = json.loads((path / "config.json").read_text())
    write_json(path / "config.json", {**config, "eos_token_id": [eos, a]})
    generation = {"eos_token_id": b, "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}
    write_json(path / FILE_NAME, {**generation, "do_sample": False, "transformers_version": "x"})
    return Model(str(path), eos, a, b, runs)


@pytest.fixture(scope="module")
def llm(model: Model) -> LLM:
    return LLM(model.path, kv_cache_memory_bytes=KV_BYTES)


def first_stop(run: list[int], eos_ids: set[int]) -> list[int]:
    """`run` up to and with its first eos id (all of it when it has none)."""
    for i, token in enumerate(run):
        if token in eos_ids:
            return run[: i + 1]
    return run


# ---- what is read --------------------------------------------------------------------------


def test_auto_reads_the_model_directory(model: Model) -> None:
    config = EngineArgs(model=model.path).create_engine_config()
    assert config.arch.eos_token_ids == [model.eos, model.from_config, model.from_generation_config]
    assert config.generation_config.path == str(Path(model.path) / FILE_NAME)
    assert config.generation_config.defaults == SamplingDefaults(
        temperature=0.0, max_tokens=MAX_NEW_TOKENS
    )


def test_vllm_keeps_zllm_defaults_but_still_stops_on_the_files_eos(model: Model) -> None:
    config = EngineArgs(model=model.path, generation_config="vllm").create_engine_config()
    assert config.generation_config.defaults == SamplingDefaults()
    assert config.arch.eos_token_ids == [model.eos, model.from_config, model.from_generation_config]


def test_a_directory_is_read_instead_of_the_models(model: Model, tmp_path: Path) -> None:
    write_json(tmp_path / FILE_NAME, {"eos_token_id": [7, 9], "top_k": 5, "top_p": 0.5})
    config = EngineArgs(model=model.path, generation_config=str(tmp_path)).create_engine_config()
    assert config.arch.eos_token_ids == [model.eos, model.from_config, 7, 9]
    assert config.generation_config.defaults == SamplingDefaults(top_k=5, top_p=0.5)


def test_a_gguf_file_has_no_generation_config(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    write_json(tmp_path / FILE_NAME, {"temperature": 0.1})  # beside the file: not the model's
    config = read_generation_config(str(gguf), "auto", vocab_size=512)
    assert (config.path, config.eos_token_ids, config.defaults) == (None, [], SamplingDefaults())


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "cannot read"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"eos_token_id": "</s>"}', "eos_token_id must be a token id"),
        ('{"eos_token_id": [2, 100000]}', "in [0, 512)"),
        ('{"temperature": "hot"}', "temperature must be a number, got 'hot'"),
        ('{"top_k": 2.5}', "top_k must be an integer"),
        ('{"top_p": 0}', "top_p: top_p must be in (0, 1]"),
        ('{"max_new_tokens": 0}', "max_new_tokens: max_tokens must be at least 1"),
    ],
)
def test_a_bad_file_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / FILE_NAME).write_text(text)
    with pytest.raises(ValueError) as error:
        read_generation_config("unused", str(tmp_path), vocab_size=512)
    assert str(tmp_path / FILE_NAME) in str(error.value) and message in str(error.value)


def test_serve_refuses_to_start_on_a_bad_model_file(model: Model, tmp_path: Path, capsys) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(model.path).iterdir():
        (broken / f.name).symlink_to(f)
    (broken / FILE_NAME).unlink()
    (broken / FILE_NAME).write_text('{"temperature": -1}')
    assert cli_main(["serve", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"{broken / FILE_NAME}: temperature: temperature must be non-negative" in err
    assert cli_main(["serve", model.path, "--generation-config", str(tmp_path)]) == 2
    assert f"no {FILE_NAME} in {str(tmp_path)!r}" in capsys.readouterr().err


# ---- eos ids in the offline engine ---------------------------------------------------------


def test_every_declared_eos_id_stops_generation(model: Model, llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    for run, out in zip(model.free_runs, outputs, strict=True):
        expected = first_stop(run, model.eos_ids)
        assert out.outputs[0].token_ids == expected
        stopped = len(expected) < 24
        assert out.outputs[0].finish_reason == ("stop" if stopped else "length")
        assert out.outputs[0].stop_reason is None  # an eos, not a stop token or string
    # The first prompt stops on config.json's second id, the second on generation_config's.
    ends = [o.outputs[0].token_ids[-1] for o in outputs[:2]]
    assert ends == [model.from_config, model.from_generation_config]


def test_min_tokens_bans_every_eos_id(model: Model, llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, min_tokens=12, max_tokens=12)
    for out in llm.generate(PROMPTS[:2], params, use_tqdm=False):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 12 and not set(tokens) & model.eos_ids


def test_ignore_eos_ignores_every_eos_id(model: Model, llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, FREE_RUN, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == model.free_runs


# ---- sampling defaults ---------------------------------------------------------------------


def test_llm_without_params_takes_the_models_defaults(model: Model, llm: LLM) -> None:
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW_TOKENS
    )
    prompt = PROMPTS[2]
    assert not set(model.free_runs[2][:MAX_NEW_TOKENS]) & model.eos_ids  # runs to the bound
    default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    assert default.token_ids == model.free_runs[2][:MAX_NEW_TOKENS]
    assert default.finish_reason == "length"
    # Caller's params win whole, as in vLLM: here temperature 1 and max_tokens 16.
    sampled = llm.generate(prompt, SamplingParams(), use_tqdm=False)[0].outputs[0]
    assert len(sampled.token_ids) == 16 and sampled.token_ids[:6] != default.token_ids


def test_llm_with_vllm_defaults_ignores_the_file(model: Model) -> None:
    llm = LLM(model.path, kv_cache_memory_bytes=KV_BYTES, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.eos_token_ids == [model.eos, model.from_config, model.from_generation_config]


def test_frontend_fills_what_the_body_leaves_unset() -> None:
    defaults = SamplingDefaults(temperature=0.25, top_k=3, max_tokens=9)

    def params(body: dict) -> SamplingParams:
        request = decode_body(json.dumps(body).encode(), ChatCompletionRequest)[0]
        return chat_params(request, 512, defaults)

    messages = [{"role": "user", "content": "hi"}]
    unset = params({"messages": messages})
    # max_tokens stays unset here: the tokenizer worker applies it, knowing the prompt.
    assert (unset.temperature, unset.top_k, unset.top_p, unset.max_tokens) == (0.25, 3, 1.0, None)
    given = params({"messages": messages, "temperature": 0.9, "top_k": -1, "max_tokens": 4})
    assert (given.temperature, given.top_k, given.max_tokens) == (0.9, 0, 4)


def test_tokenizer_worker_bounds_requests_without_max_tokens(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    handle = RequestTokenizer(tokenizer, 64, tokenizer.vocab_size, [9, 2], max_new_tokens=20)

    def max_tokens(num_prompt_tokens: int, **params) -> int | None:
        prompt = [5] * num_prompt_tokens
        out = handle(TokenizeRequest("r", SamplingParams(**params), prompt_token_ids=prompt))
        assert isinstance(out, EngineCoreRequest)
        assert out.eos_token_ids == [tokenizer.eos_token_id, 9]
        return out.sampling_params.max_tokens

    assert max_tokens(10, max_tokens=None) == 20
    assert max_tokens(50, max_tokens=None) == 14  # cut to the room the prompt leaves
    assert max_tokens(10, max_tokens=None, min_tokens=30) == 30
    assert max_tokens(10, max_tokens=3) == 3  # the request's own


# ---- through the server --------------------------------------------------------------------


def chat(server, **body) -> dict:
    messages = [{"role": "user", "content": "The quick brown fox"}]
    response = server.post("/v1/chat/completions", {"messages": messages, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def server(model: Model, tmp_path_factory, engine_pool):
    with engine_pool.serve(model.path, tmp_path_factory.mktemp("auto") / "server.log") as srv:
        yield srv


@pytest.mark.e2e
def test_server_fills_unset_fields_from_the_file(model: Model, llm: LLM, server) -> None:
    unset = chat(server)
    explicit = chat(server, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    assert unset["choices"][0]["message"] == explicit["choices"][0]["message"]
    assert unset["usage"]["completion_tokens"] <= MAX_NEW_TOKENS
    assert "sampling defaults from " + str(Path(model.path) / FILE_NAME) in server.log_text()
    # The eos ids stop served requests too, reported as vLLM does.
    body = {"prompt": PROMPTS[:2], "temperature": 0.0, "max_tokens": 24}
    response = server.post("/v1/completions", body).json()
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    offline = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    for choice, out in zip(response["choices"], offline, strict=True):
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
        assert choice["text"] == out.outputs[0].text


@pytest.mark.e2e
def test_server_with_vllm_defaults_ignores_the_file(
    model: Model, engine_pool, tmp_path: Path
) -> None:
    with engine_pool.serve(
        model.path, tmp_path / "server.log", "--generation-config", "vllm"
    ) as srv:
        greedy = chat(srv, temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        sampled = chat(srv, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)  # temperature 1
        assert sampled["usage"]["completion_tokens"] == MAX_NEW_TOKENS
        assert sampled["choices"][0]["message"] != greedy["choices"][0]["message"]
        assert "sampling defaults from" not in srv.log_text()
