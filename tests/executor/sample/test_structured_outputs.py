"""Structured outputs: answers that always parse, at any temperature.

tiny model   a random tiny Llama, whose unconstrained output is noise: whatever parses came
             from the grammar. JSON schema, json_object, regex, choice, Lark and GBNF
             grammars, n > 1, preemption with recompute, prefix-cache hits, bad grammars.
SmolLM2      the real default model through `zllm serve` and the official openai client:
             50 JSON schemas at temperature 1.0, each answer validated with jsonschema;
             regex, choice and grammar; streamed answers; a bad schema is a 400.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from tiny_models import write_tiny_model

from zllm import LLM, SamplingParams
from zllm.errors import ParamError
from zllm.protocol import CacheSize
from zllm.sampling_params import StructuredOutputsParams as Structured
from zllm.text.structured_outputs import check_structured_outputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
# Arithmetic over single digits, in both grammar dialects.
LARK_EXPR = (
    'start: expr\nexpr: term (("+" | "-") term)*\nterm: DIGIT | "(" expr ")"\nDIGIT: /[0-9]/'
)
GBNF_EXPR = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9] | "(" expr ")"'
EXPR = re.compile(r"[0-9()+\-]+")
# A bounded GBNF grammar for the real model (an unbounded one like GBNF_EXPR lets a model at
# temperature 1.0 go on "1+1+1+..." until max_tokens).
GBNF_GREETING = 'root ::= greeting " " name "!"\ngreeting ::= "Hello" | "Hi" | "Dear"\nname ::= [A-Z] [a-z]{1,8}'


def balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


def is_expression(text: str) -> bool:
    """A well-formed expression of LARK_EXPR (checked by evaluating it as Python)."""
    if not EXPR.fullmatch(text) or not balanced(text) or "()" in text:
        return False
    try:
        eval(compile(text, "<expr>", "eval"), {"__builtins__": {}})  # digits and + - ( ) only
    except SyntaxError:
        return False
    return not re.search(r"\d\d|\)\d|\d\(|\)\(", text)  # single digits, operators between


# ---------------------------------------------------------------------------------------------
# Parameters and grammar errors


def test_exactly_one_kind() -> None:
    with pytest.raises(ParamError, match="exactly one of json, json_object, regex"):
        Structured(regex="a", choice=["a"])
    with pytest.raises(ParamError, match="got none"):
        Structured(json_object=False)
    with pytest.raises(ParamError, match="choice must list at least one"):
        Structured(choice=[])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (Structured(regex="(ab"), "invalid regex .*unclosed group"),
        (Structured(json={"type": "nonsense"}), "invalid json .*nonsense"),
        (Structured(json="{not json"), "JSON schema is not valid JSON"),
        (Structured(grammar="start: foo"), 'invalid grammar .*unknown name: "foo"'),
        (Structured(grammar="root ::= ("), "invalid GBNF grammar"),
    ],
)
def test_grammars_that_cannot_compile_name_the_problem(params, message) -> None:
    with pytest.raises(ParamError, match=re.compile(message, re.S)) as err:
        check_structured_outputs(params)
    assert err.value.param == "structured_outputs"


# ---------------------------------------------------------------------------------------------
# The tiny model


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    return LLM(str(path), block_size=4, kv_cache_memory_bytes=8 << 20)


def sample(llm: LLM, structured: Structured, n: int = 1, count: int = 8, **kwargs):
    params = SamplingParams(
        temperature=1.0, max_tokens=200, n=n, structured_outputs=structured, **kwargs
    )
    prompts = [f"Answer {i}:" for i in range(count)]
    return llm.generate(prompts, params, use_tqdm=False)


def texts(outputs) -> list[str]:
    return [c.text for out in outputs for c in out.outputs]


def test_unconstrained_tiny_output_is_noise(llm) -> None:
    """What the grammar has to work against: free sampling does not produce JSON."""
    outputs = llm.generate(["Answer:"] * 8, SamplingParams(temperature=1.0, max_tokens=30))
    assert not any(_parses(t) for t in texts(outputs))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_json_schema_at_temperature_one(llm) -> None:
    outputs = sample(llm, Structured(json=PERSON), count=16)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_json_object(llm) -> None:
    """Any object: unbounded strings and nesting, so noise may run to max_tokens (a cut
    answer, finish "length", as with any engine); every answer that ends is an object."""
    outputs = [out.outputs[0] for out in sample(llm, Structured(json_object=True), count=16)]
    finished = [c.text for c in outputs if c.finish_reason == "stop"]
    assert len(finished) >= 4, [c.finish_reason for c in outputs]
    for text in finished:
        assert isinstance(json.loads(text), dict)


def test_regex_choice_and_grammars(llm) -> None:
    phone = r"\+?[0-9]{2}-[0-9]{3}-[0-9]{4}"
    for text in texts(sample(llm, Structured(regex=phone))):
        assert re.fullmatch(phone, text), text
    choices = ["red", "green", "blue", "light blue"]
    seen = texts(sample(llm, Structured(choice=choices), count=16))
    assert set(seen) <= set(choices) and len(set(seen)) > 1
    for grammar in (LARK_EXPR, GBNF_EXPR):
        for text in texts(sample(llm, Structured(grammar=grammar))):
            assert is_expression(text), text


def test_n_samples_each_follow_the_grammar(llm) -> None:
    outputs = sample(llm, Structured(json=PERSON), n=4, count=3, seed=11)
    assert [len(out.outputs) for out in outputs] == [4, 4, 4]
    answers = texts(outputs)
    for text in answers:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(answers)) > 1  # the samples differ: each draws from its own matcher


def test_preemption_recomputes_the_same_answers(llm, tmp_path) -> None:
    """Seeded answers under a pool so small that requests are preempted and recomputed
    equal the answers with room to spare: the matcher is rebuilt from the tokens so far."""
    structured = Structured(json=PERSON)
    params = SamplingParams(temperature=1.0, max_tokens=120, seed=5, structured_outputs=structured)
    prompts = [{"prompt_token_ids": [7 + i] * (20 + 5 * i)} for i in range(6)]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    small = LLM(llm.config.model_path, block_size=4, num_gpu_blocks_override=48)
    tight = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert texts(tight) == texts(roomy)
    for text in texts(tight):
        jsonschema.validate(json.loads(text), PERSON)


def test_prefix_cache_hit_changes_nothing(llm) -> None:
    params = SamplingParams(
        temperature=1.0, max_tokens=200, seed=3, structured_outputs=Structured(json=PERSON)
    )
    prompt = {"prompt_token_ids": list(range(10, 50))}
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(second.outputs[0].text), PERSON)


def test_compiled_grammars_reach_the_heartbeat_as_news_only(llm, monkeypatch) -> None:
    """The executor's compiled-grammar cache (zllm:cache_entries{cache=
    "structured_output_grammars"}) rides on the step outputs only when its size changed, and
    the core's heartbeat carries the latest beside the core's own caches."""
    news: list[list[CacheSize]] = []
    update = llm.engine.update

    def record(output):
        if output.cache_sizes is not None:
            news.append(output.cache_sizes)
        return update(output)

    monkeypatch.setattr(llm.engine, "update", record)
    before = _grammars(llm.engine.heartbeat().caches)
    sample(llm, Structured(regex="cache-sizes-[0-9]{3}"), count=4)  # one new grammar
    after = _grammars(llm.engine.heartbeat().caches)
    assert after.capacity == 256 and 1 <= after.entries <= after.capacity
    assert before is None or after.entries == before.entries + 1
    assert len(news) == 1, news  # many steps, one change of size
    assert _grammars(news[0]) == after
    sample(llm, Structured(regex="cache-sizes-[0-9]{3}"), count=2)  # compiled already
    assert len(news) == 1 and _grammars(llm.engine.heartbeat().caches) == after
    names = {(c.process, c.cache) for c in llm.engine.heartbeat().caches}
    assert {("core", "tenant_ledger"), ("core", "prefix_pins")} <= names


def _grammars(caches: list[CacheSize]) -> CacheSize | None:
    found = [c for c in caches if c.cache == "structured_output_grammars"]
    assert len(found) <= 1 and all(c.process == "executor" for c in found)
    return found[0] if found else None


def test_a_bad_grammar_is_refused_before_scheduling(llm) -> None:
    with pytest.raises(ParamError, match="invalid regex"):
        llm.generate("x", SamplingParams(structured_outputs=Structured(regex="[z-a]")))
    assert llm.engine.scheduler.num_waiting == 0  # nothing was queued


# ---------------------------------------------------------------------------------------------
# SmolLM2 through `zllm serve` and the openai client


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema mixing what applications send: nested objects, bounded arrays, enums,
    bounded numbers, required fields, anyOf."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"]
    if depth < 2:
        kinds += ["object", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([5, 10, 20])}
    if kind == "integer":
        low = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randrange(1, 200)}
    if kind == "number":
        # multipleOf bounds the fraction's digits: a free-precision number lets a model at
        # temperature 1.0 write 1.0000... until max_tokens cuts the answer (seen on SmolLM2).
        maximum = rng.choice([1, 10, 1000])
        return {"type": "number", "minimum": 0, "maximum": maximum, "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "amber", "none"], 3)}
    if kind == "array":
        low = rng.randrange(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randrange(1, 3),
        }
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    return object_schema(rng, depth + 1)


def object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["id", "name", "city", "score", "items", "kind", "meta", "ok"], 3)
    properties = {name: random_schema(rng, depth) for name in names}
    return {
        "type": "object",
        "properties": properties,
        "required": rng.sample(names, rng.randrange(1, len(names) + 1)),
        "additionalProperties": False,
    }


SCHEMAS = [object_schema(random.Random(seed)) for seed in range(50)]


@pytest.fixture(scope="module")
def served(smollm2_path, engine_pool, tmp_path_factory):
    log = tmp_path_factory.mktemp("served") / "server.log"
    with engine_pool.serve(
        smollm2_path, log, "--kv-cache-memory-bytes", "256M", "--served-model-name", "smollm2"
    ) as server:
        yield server


def client_of(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def ask_json(client, schema: dict, index: int) -> tuple[str, str]:
    """Seeded (by `index`): every answer must finish "stop", which an unseeded answer at
    temperature 1.0 meets only most of the time (a rare one runs to max_tokens)."""
    answer = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": f"Describe item {index} as JSON."}],
        seed=index,
        temperature=1.0,
        max_tokens=400,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": f"item{index}", "schema": schema, "strict": True},
        },
    )
    return answer.choices[0].message.content, answer.choices[0].finish_reason


@pytest.mark.slow
@pytest.mark.e2e
def test_fifty_schemas_at_temperature_one_all_validate(served) -> None:
    client = client_of(served)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: ask_json(client, SCHEMAS[i], i), range(len(SCHEMAS))))
    for i, (text, finish) in enumerate(answers):
        assert finish == "stop", (i, finish, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i])


@pytest.mark.slow
@pytest.mark.e2e
def test_served_regex_choice_grammar_and_stream(served) -> None:
    client = client_of(served)
    messages = [{"role": "user", "content": "Give me a date."}]

    def ask(structured: dict, **kwargs) -> str:
        answer = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            temperature=1.0,
            max_tokens=120,
            extra_body={"structured_outputs": structured},
            **kwargs,
        )
        return answer.choices[0].message.content

    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    assert re.fullmatch(date, ask({"regex": date}))
    assert ask({"choice": ["yes", "no", "unsure"]}) in ("yes", "no", "unsure")
    greeting = ask({"grammar": GBNF_GREETING})
    assert re.fullmatch(r"(Hello|Hi|Dear) [A-Z][a-z]{1,8}!", greeting), greeting
    completion = client.completions.create(
        model="smollm2",
        prompt="A person as JSON:",
        temperature=1.0,
        max_tokens=200,
        extra_body={"structured_outputs": {"json": PERSON}},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)
    # json_object bounds no string's length: at temperature 1.0 SmolLM2 once wrote one string
    # until max_tokens cut it (CI). Greedy makes the answer the same on every machine.
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        temperature=0.0,
        max_tokens=200,
        response_format={"type": "json_object"},
        stream=True,
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


@pytest.mark.slow
@pytest.mark.e2e
def test_served_bad_schema_is_a_400_and_the_server_goes_on(served) -> None:
    import openai

    client = client_of(served)
    with pytest.raises(openai.BadRequestError, match="invalid json") as err:
        ask_json(client, {"type": "object", "properties": {"a": {"type": "nonsense"}}}, 0)
    assert err.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="response_format or structured_outputs"):
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"regex": "a+"}},
        )
    text, finish = ask_json(client, PERSON, 1)
    jsonschema.validate(json.loads(text), PERSON)


def test_apply_bitmask_drops_exactly_the_disallowed_tokens() -> None:
    import numpy as np
    import torch

    from zllm.executor.requests.structured_output import apply_bitmask

    rng = np.random.default_rng(0)
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    bitmask = rng.integers(-(2**31), 2**31 - 1, size=(3, (vocab + 31) // 32), dtype=np.int32)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    logits = torch.randn(5, vocab)
    before = logits.clone()
    apply_bitmask(logits, [1, 2, 4], bitmask)
    for k, row in enumerate([1, 2, 4]):
        keep = torch.from_numpy(allowed[k].astype(bool))
        assert torch.equal(logits[row][keep], before[row][keep])
        assert (logits[row][~keep] <= torch.finfo(torch.float32).min / 2).all()
        assert torch.softmax(logits[row], 0)[~keep].sum() == 0
    assert torch.equal(logits[[0, 3]], before[[0, 3]])
