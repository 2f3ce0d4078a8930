"""LoRA adapters: zllm's greedy output with each adapter equals transformers + PEFT with the
same adapter; requests of several adapters (and the base) batched in one step equal each run
alone; adapters never share KV blocks; bad adapters are refused before anything changes;
served through `zllm serve` with the openai client, with loading and unloading at run time.

Adapters are made with PEFT (tests/lora_adapters.py: random A and non-zero random B) on a
tiny random model and, in the slow tests, on an fp32 Hugging Face copy of SmolLM2 made from
its GGUF.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from lora_adapters import ADAPTERS, make_adapter
from parity import assert_greedy_parity, hf_greedy, hf_greedy_batch
from servers import start_server, stop_server, wait_until
from tiny_models import arch_config_of, tiny_hf_config, write_lora_adapter, write_tiny_model

from zllm import LLM, LoRARequest, SamplingParams
from zllm.config.engine import SchedulerConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.errors import ParamError
from zllm.kv.block_hash import cache_salt
from zllm.lora import LoRAError, adapter_digest, parse_lora_modules, read_adapter, with_digest
from zllm.protocol import RequestOptions

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def peft_model(base_dir: str, adapter_dir: Path | None):
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    if adapter_dir is None:
        return base.eval()
    return peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 430) for _ in range(rng.randrange(4, 40))] for _ in range(count)]


def greedy_tokens(llm: LLM, prompts, lora=None, params=GREEDY) -> list[list[int]]:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


# ---- the tiny model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-lora-base")))


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: LoRARequest(name, i, str(make_adapter(base_dir, root / name, seed=i, **config)))
        for i, (name, config) in enumerate(ADAPTERS.items(), start=1)
    }


@pytest.fixture(scope="module")
def llm(base_dir) -> LLM:
    return LLM(base_dir, enable_lora=True, max_loras=4, kv_cache_memory_bytes=32 << 20)


def test_each_adapter_equals_peft(llm, base_dir, adapters) -> None:
    prompts = random_prompts(4, seed=0)
    base_out = greedy_tokens(llm, prompts)
    for name, lora in adapters.items():
        reference = peft_model(base_dir, Path(lora.lora_path))
        ours = greedy_tokens(llm, prompts, lora)
        for prompt, out in zip(prompts, ours, strict=True):
            theirs = hf_greedy(reference, prompt, GREEDY.max_tokens)
            assert_greedy_parity(reference, prompt, out, theirs, label=f"lora {name}")
        assert ours != base_out, f"adapter {name} changed nothing"
    reference = peft_model(base_dir, None)
    for prompt, out in zip(prompts, base_out, strict=True):
        assert_greedy_parity(reference, prompt, out, hf_greedy(reference, prompt, 16), label="base")


def test_mixed_batch_equals_each_alone(llm, adapters) -> None:
    """Three adapters and the base interleaved in one batch (the model runner puts each
    adapter's rows side by side) give what each request gives alone."""
    prompts = random_prompts(12, seed=1)
    choices = [*adapters.values(), None]
    loras = [choices[i % len(choices)] for i in range(len(prompts))]
    manager = llm.model_runner.lora
    seen: list[int] = []  # adapters per step, as the layers were told
    set_batch = manager.set_batch

    def recording(lora_ids, query_lens):
        set_batch(lora_ids, query_lens)
        seen.append(len(manager.batch.groups))

    manager.set_batch = recording
    try:
        batched = greedy_tokens(llm, prompts, loras)
    finally:
        del manager.set_batch
    assert max(seen) == 3  # three adapters and the base in one step
    alone = [greedy_tokens(llm, [p], lora)[0] for p, lora in zip(prompts, loras, strict=True)]
    assert batched == alone


def test_max_loras_one_serves_a_mix_one_adapter_at_a_time(base_dir, adapters) -> None:
    small = LLM(base_dir, enable_lora=True, max_loras=1, kv_cache_memory_bytes=32 << 20)
    prompts = random_prompts(8, seed=2)
    choices = [*adapters.values(), None]
    loras = [choices[i % len(choices)] for i in range(len(prompts))]
    mixed = greedy_tokens(small, prompts, loras)
    alone = [greedy_tokens(small, [p], lora)[0] for p, lora in zip(prompts, loras, strict=True)]
    assert mixed == alone


def test_slot_buffers_give_what_the_segmented_updates_give(base_dir, adapters, monkeypatch):
    """Where CUDA graphs replay steps, adapters sit in fixed slot buffers (lora/slots.py).
    The engine here runs that path on CPU (the device check answered yes, no graphs
    captured): three adapters and the base through two slots, so slots are reused between
    steps, give the segmented engine's tokens."""
    from zllm.executor.host.decode_path import DecodePath
    from zllm.executor.host.layout import RankLayout

    # (Engines of its own: the module's `llm` keeps a prefix cache other tests count on.)
    segmented = LLM(base_dir, enable_lora=True, max_loras=2, kv_cache_memory_bytes=32 << 20)
    assert segmented.model_runner.lora.slots is None
    monkeypatch.setattr(RankLayout, "graphs_run_here", lambda self: True)
    monkeypatch.setattr(DecodePath, "_capture_cuda_graphs", lambda self: None)
    slotted = LLM(base_dir, enable_lora=True, max_loras=2, kv_cache_memory_bytes=32 << 20)
    manager = slotted.model_runner.lora
    assert manager.slots is not None and manager.slots.num_slots == 2
    prompts = random_prompts(12, seed=4)
    choices = [*adapters.values(), None]
    loras = [choices[i % len(choices)] for i in range(len(prompts))]
    assert greedy_tokens(slotted, prompts, loras) == greedy_tokens(segmented, prompts, loras)
    assert not manager.batch.groups  # every update came from the slots


def test_preemption_and_sampling_with_adapters(base_dir, adapters) -> None:
    """A pool too small for the batch preempts and recomputes; n > 1 forks keep the adapter;
    a seeded sample is the same in a mixed batch as alone."""
    tight = LLM(base_dir, enable_lora=True, max_loras=4, num_gpu_blocks_override=20, block_size=4)
    prompts = [p[:20] for p in random_prompts(6, seed=3)]
    loras = [adapters["all"], adapters["mlp"], None] * 2
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    preempting = greedy_tokens(tight, prompts, loras, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert preempting == [
        greedy_tokens(tight, [p], lora, params)[0] for p, lora in zip(prompts, loras, strict=True)
    ]
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=2, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts[:3]]
    mixed = tight.generate(inputs, sampled, use_tqdm=False, lora_request=loras[:3])
    for prompt, lora, out in zip(prompts[:3], loras[:3], mixed, strict=True):
        alone = tight.generate(
            {"prompt_token_ids": prompt}, sampled, use_tqdm=False, lora_request=lora
        )[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]


def test_speculative_decoding_with_adapters(base_dir, adapters, llm) -> None:
    """Proposals verified by the adapted model: greedy output as without speculation."""
    spec = LLM(
        base_dir,
        enable_lora=True,
        max_loras=4,
        kv_cache_memory_bytes=32 << 20,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    prompts = [p[:12] * 3 for p in random_prompts(4, seed=8)]  # lookups find continuations
    loras = [adapters["all"], adapters["mlp"], None, adapters["qv-rslora"]]
    assert greedy_tokens(spec, prompts, loras) == greedy_tokens(llm, prompts, loras)
    assert spec.engine.scheduler.spec.num_drafts > 0


def test_adapters_never_share_kv_blocks(llm, adapters) -> None:
    prompt = {"prompt_token_ids": random_prompts(1, seed=4)[0] * 3}  # several full blocks
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(lora) -> int:
        out = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
        return out[0].num_cached_tokens

    assert cached(adapters["all"]) == 0
    assert cached(adapters["all"]) > 0  # the same adapter hits its own blocks
    assert cached(adapters["mlp"]) == 0
    assert cached(None) == 0
    assert cached(None) > 0


def test_block_hashes_are_salted_by_adapter() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(13))

    def salt(lora_int_id: int | None) -> int | None:
        lora = None if lora_int_id is None else LoRARequest(f"a{lora_int_id}", lora_int_id, "/a")
        return cache_salt(RequestOptions(lora=lora))

    assert bm.allocate_slots("a", tokens, 0, 13, salt=salt(1))
    assert bm.find_cached_prefix(tokens, salt(1)).num_tokens == 12
    assert bm.find_cached_prefix(tokens, salt(2)).num_tokens == 0
    assert bm.find_cached_prefix(tokens, salt(None)).num_tokens == 0


def test_an_adapters_blocks_are_salted_by_its_files_not_its_id(base_dir, adapters, tmp_path):
    """Two engines that give the same adapter different ids salt its blocks alike (a
    disaggregated pair, a disk tier after a restart); other files salt apart, and so do
    the same files after they change."""
    import shutil

    path = adapters["all"].lora_path
    copy = shutil.copytree(path, tmp_path / "copy")
    first, second = (LLM(base_dir, enable_lora=True, kv_cache_memory_bytes=8 << 20) for _ in "ab")
    tokens = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(max_tokens=1)
    first.generate(tokens, params, lora_request=LoRARequest("x", 1, path), use_tqdm=False)
    second.generate(tokens, params, lora_request=LoRARequest("y", 7, str(copy)), use_tqdm=False)
    salts = [llm._adapters[i].lora_digest for llm, i in ((first, 1), (second, 7))]
    assert salts[0] == salts[1] and len(salts[0]) == 16
    other = with_digest(adapters["mlp"])
    assert other.lora_digest != salts[0]
    assert cache_salt(RequestOptions(lora=other)) != cache_salt(
        RequestOptions(lora=first._adapters[1])
    )
    weights = copy / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert adapter_digest(str(copy)) != salts[0]


def test_scheduler_holds_a_third_adapter_beyond_max_loras() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64)
    sched = Scheduler(config, bm, max_loras=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a, b, c = (LoRARequest(name, i, f"/{name}") for i, name in enumerate("abc", start=1))
    for req_id, lora in [("r1", a), ("r2", b), ("r3", c), ("r4", a), ("r5", None)]:
        sched.add_request(Request(req_id, [1, 2, 3], params, lora=lora))
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"r1", "r2", "r4", "r5"}
    assert sched.lora_adapters() == (["a", "b"], ["c"])
    sched.abort_requests(["r2"])  # adapter b leaves the batch: c may come in
    assert "r3" in sched.schedule().num_scheduled_tokens


# ---- refusals ----------------------------------------------------------------------------------


def test_lora_request_needs_enable_lora(base_dir, adapters) -> None:
    plain = LLM(base_dir, kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ParamError, match="enable_lora"):
        plain.generate("hello", GREEDY, use_tqdm=False, lora_request=adapters["all"])
    assert not plain.engine.has_unfinished_requests()


def test_bad_adapters_are_refused_with_why(base_dir, adapters, tmp_path) -> None:
    arch = arch_config_of(tiny_hf_config(vocab_size=512))
    good = Path(adapters["all"].lora_path)

    def variant(name: str) -> Path:
        path = tmp_path / name
        shutil.copytree(good, path)
        return path

    with pytest.raises(LoRAError, match="exceeds --max-lora-rank 4"):
        read_adapter(str(good), arch, max_lora_rank=4)
    unknown = variant("unknown-target")
    config = json.loads((unknown / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "fc1"]
    (unknown / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match=r"\['fc1'\] do not exist"):
        read_adapter(str(unknown), arch, 64)
    truncated = variant("truncated")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(LoRAError, match="malformed"):
        read_adapter(str(truncated), arch, 64)
    garbage = variant("garbage")
    (garbage / "adapter_model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"
    )
    with pytest.raises(LoRAError, match="malformed"):
        read_adapter(str(garbage), arch, 64)
    dora = variant("dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    config["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match="DoRA"):
        read_adapter(str(dora), arch, 64)
    with pytest.raises(LoRAError, match="not a directory"):
        read_adapter(str(tmp_path / "missing"), arch, 64)
    # An adapter made for another model: its shapes do not fit this one.
    other = write_tiny_model(tmp_path / "wider", hidden_size=96, intermediate_size=160)
    foreign = make_adapter(str(other), tmp_path / "foreign", seed=9, r=4, target_modules=["q_proj"])
    with pytest.raises(LoRAError, match="base model needs A"):
        read_adapter(str(foreign), arch, 64)


def test_a_bad_adapter_offline_queues_nothing(llm, adapters, tmp_path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(adapters["all"].lora_path, bad)
    (bad / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(LoRAError):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 50, str(bad)))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ParamError, match="already names"):
        clash = LoRARequest("other", adapters["all"].lora_int_id, adapters["mlp"].lora_path)
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=clash)


def test_adapter_files_gone_after_check_fail_that_request_only(base_dir, adapters, tmp_path):
    """The executor loads an adapter when a request first needs it; if its files went away
    since they were checked, that request ends with finish reason "error" (its message
    says why) and the others in the batch finish as usual."""
    small = LLM(base_dir, enable_lora=True, max_loras=1, kv_cache_memory_bytes=16 << 20)
    prompt = {"prompt_token_ids": random_prompts(1, seed=6)[0]}
    gone = LoRARequest("gone", 10, str(shutil.copytree(adapters["mlp"].lora_path, tmp_path / "g")))
    first = small.generate(prompt, GREEDY, use_tqdm=False, lora_request=gone)[0]
    for other in (adapters["all"], adapters["qv-rslora"]):  # evicts the idle adapter
        small.generate(prompt, GREEDY, use_tqdm=False, lora_request=other)
    shutil.rmtree(gone.lora_path)
    outs = small.generate([prompt, prompt], GREEDY, use_tqdm=False, lora_request=[gone, None])
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    assert outs[1].outputs[0].finish_reason == "length"
    assert first.outputs[0].finish_reason == "length"
    assert not small.engine.has_unfinished_requests()


def test_parse_lora_modules() -> None:
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == [("a", "/x"), ("b", "/y")]
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["nopath"])
    with pytest.raises(ValueError, match="repeat"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_the_adapter_registry_is_bounded(base_dir, adapters, monkeypatch) -> None:
    """POST /v1/load_lora_adapter's registry holds at most MAX_REGISTERED_ADAPTERS: past it a
    load is a 400 naming the bound and registers nothing; unloading makes room (issue 56)."""
    import asyncio

    from zllm.config.engine_args import EngineArgs
    from zllm.errors import RequestError
    from zllm.frontend import lora_adapters

    monkeypatch.setattr(lora_adapters, "MAX_REGISTERED_ADAPTERS", 2)
    engine = EngineArgs(model=base_dir, enable_lora=True).create_engine_config()
    registry = lora_adapters.LoRAAdapters(engine, [base_dir], [])
    path = adapters["all"].lora_path
    asyncio.run(registry.load("a", path))
    asyncio.run(registry.load("b", path))
    with pytest.raises(RequestError, match="2 LoRA adapters are registered, the most"):
        asyncio.run(registry.load("c", path))
    assert set(registry.by_name) == {"a", "b"}
    registry.unload("a")
    assert asyncio.run(registry.load("c", path)).lora_name == "c"


# ---- served ------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_served_adapters_load_unload_and_batch(base_dir, adapters, llm, tmp_path) -> None:
    import openai

    start = adapters["all"]
    server = start_server(
        base_dir,
        tmp_path / "server.log",
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"{start.lora_name}={start.lora_path}",
        api_key="sekret",
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {base_dir, "all"}
        assert models["all"].model_extra["parent"] == base_dir
        spec = server.get("/openapi.json").json()
        assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(spec["paths"])
        model_field = spec["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
        assert {"type": "string"} in model_field["anyOf"]  # adapters come and go

        prompts = random_prompts(6, seed=5)

        def complete(model: str, prompt: list[int]) -> str:
            answer = client.completions.create(
                model=model, prompt=prompt, max_tokens=16, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return answer.choices[0].text

        # Loading needs the API key; a bad adapter is a 400 that changes nothing.
        body = {"lora_name": "mlp", "lora_path": adapters["mlp"].lora_path}
        assert server.post("/v1/load_lora_adapter", body, headers={}).status_code == 401
        too_big = write_lora_adapter(tmp_path / "r32", base_dir, rank=32)
        alien = write_lora_adapter(tmp_path / "alien", base_dir)
        config = json.loads((alien / "adapter_config.json").read_text())
        (alien / "adapter_config.json").write_text(
            json.dumps({**config, "target_modules": ["c_attn"]})
        )
        for path, why in [
            ("/nope", "not a directory"),
            (too_big, "rank 32 exceeds --max-lora-rank 16"),
            (alien, "['c_attn'] do not exist"),
        ]:
            bad = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(path)})
            assert bad.status_code == 400 and why in bad.json()["error"]["message"], bad.text
        assert {m.id for m in client.models.list().data} == {base_dir, "all"}
        assert server.post("/v1/load_lora_adapter", body).status_code == 200
        assert server.post("/v1/load_lora_adapter", body).status_code == 400  # already there
        assert {m.id for m in client.models.list().data} == {base_dir, "all", "mlp"}

        names = ["all", "mlp", base_dir] * 2
        with ThreadPoolExecutor(6) as pool:
            served = list(pool.map(complete, names, prompts))
        for name, prompt, out in zip(names, prompts, served, strict=True):
            lora = adapters.get(name)
            offline = llm.generate(
                {"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=lora
            )
            assert out == offline[0].outputs[0].text, name

        metrics = server.get("/metrics").text
        assert re.search(r'^vllm:lora_requests_info\{[^}]*max_lora="2"', metrics, re.M)

        assert server.post("/v1/unload_lora_adapter", {"lora_name": "mlp"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete("mlp", prompts[0])
        assert server.post("/v1/unload_lora_adapter", {"lora_name": "mlp"}).status_code == 404
        # An adapter whose files vanish after loading fails its request, and only that one.
        gone = tmp_path / "gone"
        shutil.copytree(adapters["mlp"].lora_path, gone)
        body = {"lora_name": "gone", "lora_path": str(gone)}
        assert server.post("/v1/load_lora_adapter", body).status_code == 200
        shutil.rmtree(gone)
        with pytest.raises(openai.InternalServerError, match="LoRA adapter 'gone'"):
            complete("gone", prompts[0])
        assert complete("all", prompts[0]) == served[0]  # the others serve on

        # A frontend that dies comes back serving the same adapters under the same ids.
        body = {"lora_name": "qv", "lora_path": adapters["qv-rslora"].lora_path}
        assert server.post("/v1/load_lora_adapter", body).status_code == 200
        qv_answer = complete("qv", prompts[1])
        os.kill(server.children()["frontend"], signal.SIGKILL)
        assert wait_until(server.healthy, 60), server.log_tail()
        assert {m.id for m in client.models.list().data} == {base_dir, "all", "qv", "gone"}
        assert complete("qv", prompts[1]) == qv_answer
    finally:
        stop_server(server)


def test_lora_modules_need_enable_lora(base_dir, adapters) -> None:
    from zllm.config.engine_args import EngineArgs
    from zllm.config.serve import ServerArgs
    from zllm.runtime.launch import serve_config_from

    engine = EngineArgs(model=base_dir).create_engine_config()
    spec = f"all={adapters['all'].lora_path}"
    with pytest.raises(ValueError, match="--enable-lora"):
        serve_config_from(engine, ServerArgs(lora_modules=[spec]))
    engine = EngineArgs(model=base_dir, enable_lora=True, max_lora_rank=4).create_engine_config()
    with pytest.raises(LoRAError, match="max-lora-rank"):
        serve_config_from(engine, ServerArgs(lora_modules=[spec]))


# ---- SmolLM2 -----------------------------------------------------------------------------------


SMOLLM2_TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]


@pytest.fixture(scope="module")
def smollm2_loras(smollm2_hf_dir, tmp_path_factory) -> list[LoRARequest]:
    """The three adapters on SmolLM2, with weights drawn from N(0, 0.05): enough to change
    the greedy output, not so much that the model stops writing words."""
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return [
        LoRARequest(name, i, str(make_adapter(smollm2_hf_dir, root / name, i, 0.05, **cfg)))
        for i, (name, cfg) in enumerate(ADAPTERS.items(), start=1)
    ]


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_hf_dir) -> LLM:
    return LLM(smollm2_hf_dir, enable_lora=True, max_loras=3, kv_cache_memory_bytes=256 << 20)


@pytest.mark.slow
def test_smollm2_adapters_equal_peft_alone_and_mixed(
    smollm2_hf_dir, smollm2_loras, smollm2_llm
) -> None:
    loras, ours = smollm2_loras, smollm2_llm
    prompts = [ours.get_tokenizer().encode(t) for t in SMOLLM2_TEXTS]
    base_out = greedy_tokens(ours, prompts)
    alone = {}
    for lora in loras:
        reference = peft_model(smollm2_hf_dir, Path(lora.lora_path))
        alone[lora.lora_name] = greedy_tokens(ours, prompts, lora)
        references = hf_greedy_batch(reference, prompts, GREEDY.max_tokens)
        for prompt, out, theirs in zip(prompts, alone[lora.lora_name], references, strict=True):
            assert_greedy_parity(reference, prompt, out, theirs, label=f"smollm2 {lora.lora_name}")
        assert alone[lora.lora_name] != base_out
    mixed_loras = [*loras, None]
    mixed_prompts = [prompts[i % len(prompts)] for i in range(len(mixed_loras))]
    mixed = greedy_tokens(ours, mixed_prompts, mixed_loras)
    for prompt, lora, out in zip(mixed_prompts, mixed_loras, mixed, strict=True):
        expected = base_out if lora is None else alone[lora.lora_name]
        assert out == expected[prompts.index(prompt)]


@pytest.mark.slow
def test_smollm2_gguf_base_with_an_adapter_equals_peft(
    smollm2_path, smollm2_hf_dir, smollm2_loras
) -> None:
    """The GGUF file as the base (its Q4_1 blocks multiplied by the CPU kernel, the default):
    the adapter's update is added to the kernel's output, and greedy output equals PEFT's over
    the fp32 copy transformers made of the same file (near-tie rule as for greedy parity)."""
    ours = LLM(smollm2_path, enable_lora=True, kv_cache_memory_bytes=128 << 20)
    lora = smollm2_loras[0]
    reference = peft_model(smollm2_hf_dir, Path(lora.lora_path))
    prompts = [ours.get_tokenizer().encode(t) for t in SMOLLM2_TEXTS]
    references = hf_greedy_batch(reference, prompts, GREEDY.max_tokens)
    for prompt, out, theirs in zip(
        prompts, greedy_tokens(ours, prompts, lora), references, strict=True
    ):
        assert_greedy_parity(reference, prompt, out, theirs, label="smollm2 gguf base + lora")


@pytest.mark.slow
@pytest.mark.e2e
def test_smollm2_served_adapters_loaded_at_run_time(
    smollm2_hf_dir, smollm2_loras, smollm2_llm, engine_pool, tmp_path
) -> None:
    """SmolLM2 served with no adapter at start: three are loaded over HTTP, then requests of
    all three and the base run concurrently and equal the offline API's answers."""
    import openai

    with engine_pool.serve(
        smollm2_hf_dir, tmp_path / "server.log", "--enable-lora", "--max-loras", "3",
        "--served-model-name", "smollm2",
    ) as server:  # fmt: skip
        for lora in smollm2_loras:
            body = {"lora_name": lora.lora_name, "lora_path": lora.lora_path}
            assert server.post("/v1/load_lora_adapter", body).status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        jobs = [(lora, text) for lora in [*smollm2_loras, None] for text in SMOLLM2_TEXTS]

        def complete(job) -> str:
            lora, text = job
            answer = client.completions.create(
                model=lora.lora_name if lora else "smollm2", prompt=text, max_tokens=16,
                temperature=0.0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return answer.choices[0].text

        with ThreadPoolExecutor(len(jobs)) as pool:
            served = list(pool.map(complete, jobs))
        offline = smollm2_llm.generate(
            [text for _, text in jobs], GREEDY, use_tqdm=False,
            lora_request=[lora for lora, _ in jobs],
        )  # fmt: skip
        for (lora, text), out, theirs in zip(jobs, served, offline, strict=True):
            assert out == theirs.outputs[0].text, (lora, text)
        first_prompt = {
            out for (_, text), out in zip(jobs, served, strict=True) if text == SMOLLM2_TEXTS[0]
        }
        assert len(first_prompt) > 1  # the adapters answer their own ways
        for lora in smollm2_loras:
            assert server.post("/v1/unload_lora_adapter", {"lora_name": lora.lora_name}).is_success
        assert [m.id for m in client.models.list().data] == ["smollm2"]
