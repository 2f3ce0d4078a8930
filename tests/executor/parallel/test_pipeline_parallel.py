"""Pipeline parallelism (--pipeline-parallel-size): which layers each stage holds, how the
scheduler feeds the stages (a request in one step in flight at a time, about a stage's share
of the running requests per step, the sampled tokens sent to the earlier stages), and the
engine with 2 and 3 stages (and 2 x 2 ranks with tensor parallelism) against one rank,
offline and through `zllm serve` with the openai client."""

from __future__ import annotations

import collections
import gc
import itertools
import random
import re
from dataclasses import dataclass, field

import pytest
from parity import SERVED_PROMPTS, count_flips, served_greedy
from scheduler_parts import BS, make_request
from servers import kill_rank_under_load, start_server, stop_server, wait_until

from zllm import LLM, SamplingParams
from zllm.config.engine import SchedulerConfig
from zllm.config.engine_args import EngineArgs
from zllm.config.parallel import stage_layers
from zllm.core.kv.block_manager import BlockManager
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.protocol import LogprobsLists, ModelRunnerOutput

# ---- which layers a stage holds ------------------------------------------------------------


def test_stages_hold_consecutive_layers_the_earlier_ones_one_more():
    assert [stage_layers(30, 3, s) for s in range(3)] == [
        range(0, 10),
        range(10, 20),
        range(20, 30),
    ]
    assert [stage_layers(30, 4, s) for s in range(4)] == [
        range(0, 8),
        range(8, 16),
        range(16, 23),
        range(23, 30),
    ]
    assert [stage_layers(2, 2, s) for s in range(2)] == [range(0, 1), range(1, 2)]
    for layers, stages in ((18, 4), (7, 7), (5, 2)):
        held = [i for s in range(stages) for i in stage_layers(layers, stages, s)]
        assert held == list(range(layers))


def test_engine_arguments_refuse_what_pipeline_parallel_does_not_cover(tiny_llama_dir):
    with pytest.raises(ValueError, match="--pipeline-parallel-size 9 is more than this model's"):
        EngineArgs(model=tiny_llama_dir, pipeline_parallel_size=9).create_engine_config()
    # The transformers backend runs stages (test_composition.py); an architecture it cannot
    # cut into stages is refused at load.
    config = EngineArgs(
        model=tiny_llama_dir, pipeline_parallel_size=2, model_impl="transformers"
    ).create_engine_config()
    assert config.model_impl == "transformers" and config.pipeline_parallel_size == 2
    config = EngineArgs(
        model=tiny_llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2
    ).create_engine_config()
    assert config.world_size == 4 and config.scheduler.pipeline_stages == 2


# ---- the scheduler with stages -------------------------------------------------------------


def staged_scheduler(stages: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=64, max_model_len=1000, pipeline_stages=stages
    )
    return Scheduler(config, BlockManager(100, BS))


def answer(so, sampled: dict[str, int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        step_id=so.step_id,
        req_ids=list(sampled),
        sampled_token_ids=[[t] for t in sampled.values()],
    )


def test_stages_get_alternating_micro_batches_and_the_sampled_tokens():
    """Four requests on two stages: once they decode, each step takes two of them (a stage's
    share), a request is not scheduled again while its step is in flight, and the step
    after its return sends the earlier stages the token it sampled."""
    sched = staged_scheduler(2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 4, start=10 * i))
    first = sched.schedule()  # every prompt: four new requests (2 stages, no one running yet)
    assert sorted(first.num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]
    assert sched.schedule().num_scheduled_tokens == {}  # all four in flight: none again
    sched.update_from_output(first, answer(first, {f"r{i}": 100 + i for i in range(4)}))

    a = sched.schedule()  # two of the four running
    assert a.num_scheduled_tokens == {"r0": 1, "r1": 1}
    assert {c.req_id: c.new_token_ids for c in a.cached_requests} == {"r0": [100], "r1": [101]}
    b = sched.schedule()  # the other two, while a is in flight
    assert b.num_scheduled_tokens == {"r2": 1, "r3": 1}
    assert {c.req_id: c.new_token_ids for c in b.cached_requests} == {"r2": [102], "r3": [103]}
    assert sched.schedule().num_scheduled_tokens == {}  # both micro-batches in flight
    sched.update_from_output(a, answer(a, {"r0": 200, "r1": 201}))
    c = sched.schedule()
    assert c.num_scheduled_tokens == {"r0": 1, "r1": 1}
    assert {x.req_id: x.new_token_ids for x in c.cached_requests} == {"r0": [200], "r1": [201]}


def test_one_stage_keeps_scheduling_ahead():
    """Without stages a request is scheduled again while its step is in flight (its token
    pending, which the executor holds) and no tokens are sent back."""
    sched = staged_scheduler(1)
    sched.add_request(make_request("a", 4))
    first = sched.schedule()
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    assert all(not c.new_token_ids for c in second.cached_requests)
    assert first.step_id + 1 == second.step_id


@dataclass
class StageMirror:
    """What one pipeline stage holds of each request (its tokens, how many are output),
    kept from the steps as the model runner keeps it: forks, beam tokens, finished, new, and
    on a stage before the last the tokens sent back in CachedRequestData.new_token_ids."""

    last: bool
    tokens: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)

    def apply(self, so) -> None:
        for fork in so.forked_requests:
            parent = self.tokens[fork.parent_req_id]
            prompt_len = len(parent) - self.outputs[fork.parent_req_id]
            kept = parent[: prompt_len + fork.num_parent_outputs]
            self.tokens[fork.req_id] = [*kept, fork.first_token_id]
            self.outputs[fork.req_id] = fork.num_parent_outputs + 1
        for req_id, token in so.beam_tokens.items():
            self.append(req_id, token)
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in so.new_requests:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.outputs[new.req_id] = len(new.output_token_ids)
        for cached in so.cached_requests:
            if not self.last:
                for token in cached.new_token_ids:
                    self.append(cached.req_id, token)

    def append(self, req_id: str, token: int) -> None:
        self.tokens[req_id].append(token)
        self.outputs[req_id] += 1


def random_requests(rng: random.Random) -> list[Request]:
    """Greedy, n = 2, prompt-logprob and beam-search requests of random lengths."""
    requests = []
    for i in range(10):
        kind = rng.choice(["plain", "n2", "prompt_logprobs", "beam"])
        extra = {
            "plain": {},
            "n2": {"n": 2, "seed": 1},
            "prompt_logprobs": {"prompt_logprobs": 0},
            "beam": {"use_beam_search": True, "n": 2, "beam_width": 2},
        }[kind]
        params = SamplingParams(max_tokens=rng.randrange(2, 10), ignore_eos=True, **extra)
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(3, 30))]
        requests.append(Request(f"r{i}", prompt, params))
    return requests


def run_pipelined(stages: int, seed: int) -> int:
    """Drive a scheduler with `stages` steps in flight, a small pool (preemptions) and
    chunked prefill, through a fake executor whose first and last stages keep their own
    copies of the requests; assert the pipeline's invariants at every step. Returns the
    preemptions seen."""
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=16, max_model_len=200, pipeline_stages=stages
    )
    sched = Scheduler(config, BlockManager(24, BS))
    prompt_lens = {}
    for req in random_requests(rng):
        sched.add_request(req)
        if req.sampling_params.prompt_logprobs is not None:
            prompt_lens[req.req_id] = req.num_prompt_tokens
    first, last = StageMirror(last=False), StageMirror(last=True)
    in_flight: collections.deque = collections.deque()
    next_token = itertools.count(5000)
    for _ in range(5000):
        if not (sched.has_unfinished_requests() or in_flight):
            return sched.num_preemptions
        if len(in_flight) < max(2, stages) and sched.has_unfinished_requests():
            so = sched.schedule()
            computed = {c.req_id: c.num_computed_tokens for c in so.cached_requests}
            computed |= {n.req_id: n.num_computed_tokens for n in so.new_requests}
            if so.total_num_scheduled_tokens or so.forked_requests or so.finished_req_ids:
                first.apply(so)
                for req_id, num in so.num_scheduled_tokens.items() if stages > 1 else ():
                    # The first stage embeds exactly the tokens the core knows (one stage
                    # schedules ahead instead: its pending tokens are the executor's own).
                    core = sched.requests[req_id].all_token_ids
                    held = first.tokens[req_id]
                    assert computed[req_id] + num <= len(held), (seed, so.step_id, req_id)
                    assert held == core[: len(held)], (seed, so.step_id, req_id)
                in_flight.append((so, computed))
                continue
            assert not so.beam_tokens, "a step left unsent took beam tokens with it"
        assert in_flight, f"seed {seed}: stuck"
        so, computed = in_flight.popleft()
        last.apply(so)
        req_ids, sampled, logprobs, prompt_logprobs = [], [], [], {}
        for req_id, num in so.num_scheduled_tokens.items():
            tokens = last.tokens[req_id]
            req = sched.requests.get(req_id)
            beam = req is not None and req.sampling_params.use_beam_search
            start, end = computed[req_id], computed[req_id] + num
            if req is not None and req.sampling_params.prompt_logprobs is not None:
                stop = min(end, req.num_prompt_tokens - 1)
                if stop > start and last.outputs[req_id] == 0:
                    rows = list(range(start + 1, stop + 1))
                    prompt_logprobs[req_id] = LogprobsLists(
                        [[p] for p in rows], [[0.0]] * len(rows), [1] * len(rows)
                    )
            if end < len(tokens):
                continue
            if beam:  # reports for the position the core's beam is at
                assert req.num_tokens == len(tokens), (seed, so.step_id, req_id)
            draws = [next(next_token) for _ in range(so.num_samples.get(req_id, 1))]
            if not beam:
                last.append(req_id, draws[0])
            req_ids.append(req_id)
            sampled.append(draws)
            t = draws[0]
            logprobs.append(
                LogprobsLists([[t, t + 10**5, t + 2 * 10**5]], [[-1.0, -1.5, -2.0]], [1])
            )
        outputs = sched.update_from_output(
            so,
            ModelRunnerOutput(
                so.step_id, req_ids, sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs
            ),
        )
        for out in outputs:  # a request's first output carries every prompt position's
            if out.req_id in prompt_lens and out.sample_index == 0:
                rows = out.new_prompt_logprobs
                positions = [row[0] for row in rows.token_ids] if rows else []
                expected = list(range(1, prompt_lens.pop(out.req_id)))
                assert positions == expected, (seed, so.step_id, out.req_id)
        for req in sched.requests.values():  # prompt logprobs: every position once, in order
            if req.prompt_logprobs is not None:
                positions = [row[0] for row in req.prompt_logprobs.token_ids]
                assert positions == list(range(1, len(positions) + 1)), (seed, req.req_id)
    raise AssertionError(f"seed {seed}: no end in 5000 steps")


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_steps_in_flight_keep_every_stage_in_step(stages):
    """Randomized (fixed seeds): every kind of request, preempted while its steps are in
    flight. The first stage always holds the tokens it embeds; beams report for their
    current position; an n > 1 request whose parent is preempted mid-step forks cleanly;
    prompt logprobs come whole, once per position."""
    preemptions = [run_pipelined(stages, seed) for seed in range(40)]
    assert sum(p > 0 for p in preemptions) >= 10  # the pool is small enough to preempt


# ---- offline -------------------------------------------------------------------------------


def generate(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    outs = llm.generate(SERVED_PROMPTS, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_offline_stages_equal_one_rank(tiny_llama_dir):
    """LLM(pipeline_parallel_size=2), and 2 stages x 2 tensor-parallel ranks: greedy tokens,
    and seeded n = 2 samples (the second sample forked after the prompt, its first token
    given to every stage), equal one rank's; the stages' processes stop with the LLM."""
    kw = dict(kv_cache_memory_bytes=64 << 20)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2, ignore_eos=True)
    single = LLM(tiny_llama_dir, **kw)
    expected = (generate(single, greedy), generate(single, sampled))
    del single
    for ranks in (
        {"pipeline_parallel_size": 2},
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    ):
        llm = LLM(tiny_llama_dir, **ranks, **kw)
        processes = llm.executor.ranks.processes
        assert (generate(llm, greedy), generate(llm, sampled)) == expected, ranks
        del llm
        gc.collect()
        for proc in processes:
            proc.join(10)
            assert not proc.is_alive()


def test_offline_gemma3_stages_split_sliding_and_global_layers(tmp_path):
    """Gemma 3 (sliding, global, sliding layers: hybrid KV cache groups) on 3 stages, a layer
    each: the same greedy tokens as one rank."""
    from tiny_models import randomize_norms_and_biases, tiny_gemma3_overrides, write_tiny_model

    path = str(randomize_norms_and_biases(write_tiny_model(tmp_path, **tiny_gemma3_overrides(8))))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = {}
    for stages in (1, 3):
        llm = LLM(path, pipeline_parallel_size=stages, kv_cache_memory_bytes=64 << 20)
        outputs[stages] = generate(llm, params)
        del llm
        gc.collect()
    assert outputs[3] == outputs[1]
    assert len({t for out in outputs[1] for t in out[0]}) > 10  # not a degenerate output


@pytest.mark.parametrize("tied", [True, False])
def test_stages_let_go_of_the_embedding_and_logits_they_do_not_use(tied):
    """Three stages of a tiny Llama: only the first holds the embedding table, only the last
    the logits weights (tied: the embedding table, which serves as them); what each keeps
    gives the whole model's results."""
    import torch
    from tiny_models import arch_config_of, tiny_hf_config, tiny_hf_model

    from zllm.executor.models.llama import LlamaForCausalLM
    from zllm.executor.parallel.groups import PipelineParallel
    from zllm.executor.parallel.shards import release_other_stages_ends

    config = tiny_hf_config("llama", tie_word_embeddings=tied, num_hidden_layers=3)
    weights = tiny_hf_model(config, 0).state_dict()
    arch = arch_config_of(config)
    whole = LlamaForCausalLM(arch)
    whole.load_weights(weights.items())
    ids = torch.tensor([3, 1, 4, 1, 5])
    hidden = torch.randn(2, arch.hidden_size)
    table = arch.vocab_size * arch.hidden_size
    for stage in range(3):
        pp = PipelineParallel(stage=stage, size=3, layers=stage_layers(3, 3, stage))
        model = LlamaForCausalLM(arch, pp=pp)
        model.load_weights(weights.items())
        assert release_other_stages_ends(model, pp)
        ends = model.embed_tokens.numel() + (0 if model.lm_head is None else model.lm_head.numel())
        first, last = stage == 0, stage == 2
        expected = table * (first + (last and not tied)) + (table if last and tied else 0)
        assert ends == expected, (stage, ends, expected)
        if first:
            assert torch.equal(model.embed(ids), whole.embed(ids))
        elif not (tied and last):  # (the last stage's table serves as the logits, tied)
            with pytest.raises(RuntimeError):
                model.embed(ids)
        if last:
            assert torch.equal(model.compute_logits(hidden), whole.compute_logits(hidden))
        elif not (tied and first):  # (the first stage's table would serve, tied)
            with pytest.raises(RuntimeError):
                model.compute_logits(hidden)
    assert not release_other_stages_ends(whole, PipelineParallel())


@pytest.mark.parametrize("tied", [True, False])
def test_a_transformers_stage_keeps_its_layers_and_the_ends_it_uses(tied):
    """cut_to_stage on a tiny transformers Llama's 3 stages: each keeps its decoder layer
    (with its whole-model layer_idx), the dropped layers are freed, and only the first stage
    keeps the embedding table, only the last the logits weights (tied: one table, kept by
    either)."""
    import weakref

    from tiny_models import arch_config_of, tiny_hf_config, tiny_hf_model

    from zllm.executor.models.transformers.pp import cut_to_stage
    from zllm.executor.parallel.groups import PipelineParallel

    config = tiny_hf_config("llama", tie_word_embeddings=tied, num_hidden_layers=3)
    arch = arch_config_of(config)
    for stage in range(3):
        model = tiny_hf_model(config, 0)
        dropped = [weakref.ref(layer) for i, layer in enumerate(model.model.layers) if i != stage]
        pp = PipelineParallel(stage, 3, stage_layers(3, 3, stage))
        ends = cut_to_stage(model, arch, pp)
        gc.collect()
        assert [layer.self_attn.layer_idx for layer in model.model.layers] == [stage]
        assert all(ref() is None for ref in dropped)
        assert (ends.first, ends.last) == (stage == 0, stage == 2)
        embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
        assert (embedding.numel() > 0) == (stage == 0 or (tied and stage == 2))
        assert (head.numel() > 0) == (stage == 2 or (tied and stage == 0))


def test_a_transformers_stages_ends_replace_and_take_the_stream():
    """StageEnds around a forward that scales its embeddings and ends with a norm (as some
    transformers base models do): a middle stage's first layer sees the received stream as
    sent, not scaled, and the stage returns the stream leaving its last layer, not normed;
    the first and last stages keep what the forward does at their end. Layers that pass
    something other than the one stream are refused."""
    import torch
    from torch import nn

    from zllm.executor.models.transformers.pp import StageEnds

    class Layer(nn.Linear):
        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            self.entered = hidden
            return super().forward(hidden)

    class Base(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer(4, 4) for _ in range(2))

        def forward(self, inputs_embeds: torch.Tensor):
            hidden = inputs_embeds * 8.0  # Gemma-style scaling inside the forward
            for layer in self.layers:
                hidden = layer(hidden)
            return type("Out", (), {"last_hidden_state": torch.tanh(hidden)})

    stream = torch.randn(3, 4)
    for first, last in ((False, False), (True, False), (False, True)):
        base = Base()
        out = StageEnds(base.layers, first=first, last=last).run(base, stream)
        entered = base.layers[0].entered[0]
        torch.testing.assert_close(entered, stream * 8.0 if first else stream)
        after_layers = base.layers[1](base.layers[0](entered[None]))[0]
        torch.testing.assert_close(out, torch.tanh(after_layers) if last else after_layers)

    class Streams(Base):  # layers that pass two streams between them (Gemma 3n's AltUp four)
        def forward(self, inputs_embeds: torch.Tensor):
            return super().forward(torch.stack([inputs_embeds, inputs_embeds]))

    base = Streams()
    with pytest.raises(ValueError, match=r"\(2, 1, 3, 4\), not the \(1, 3, 4\) residual stream"):
        StageEnds(base.layers, first=False, last=True).run(base, stream)


def test_a_stage_reads_only_its_own_layers_weights(tiny_llama_dir, tmp_path):
    """load_weights and gguf_raw_weights with a stage's layers: that layer's tensors and
    every tensor outside the layers, equal to a whole read's (safetensors and GGUF)."""
    import torch
    from gguf_files import write_llama3_gguf

    from zllm.executor.weights.loader import gguf_raw_weights, layer_of, load_weights
    from zllm.model.arch import read_arch_config

    gguf = tmp_path / "tiny.gguf"
    write_llama3_gguf(gguf)
    for path in (tiny_llama_dir, str(gguf)):
        arch = read_arch_config(path)
        whole = dict(load_weights(path, arch))
        assert {layer_of(n) for n in whole} == {None, *range(arch.num_layers)}
        stage = dict(load_weights(path, arch, layers=range(1, 2)))
        assert stage.keys() == {n for n in whole if layer_of(n) in (None, 1)}, path
        assert all(torch.equal(stage[n], whole[n]) for n in stage)
    arch = read_arch_config(str(gguf))
    whole_raw = gguf_raw_weights(str(gguf), arch)
    raw = gguf_raw_weights(str(gguf), arch, layers=range(1, 2))
    assert raw.keys() == {n for n in whole_raw if layer_of(n) in (None, 1)}
    assert any(layer_of(n) == 1 for n in raw)
    assert all(torch.equal(raw[n][1], whole_raw[n][1]) for n in raw)


# ---- through `zllm serve` ------------------------------------------------------------------


def serve_and_generate(model: str, log, max_tokens: int, *flags: str):
    server = start_server(model, log, *flags)
    try:
        return served_greedy(server, SERVED_PROMPTS, max_tokens), server
    finally:
        assert stop_server(server) == 0


def stage_seconds(metrics: str, kind: str) -> dict[str, float]:
    name = f"zllm:pipeline_stage_{kind}_seconds_total"
    found = re.findall(rf'^{name}{{[^}}]*stage="(\d+)"[^}}]*}} (\S+)$', metrics, re.M)
    return {stage: float(value) for stage, value in found}


def check_served_split(server, single: list, label: str, ranks: int) -> None:
    """An executor process per rank, greedy output equal to one rank's (near-tie rule), and
    each stage's busy and idle seconds on /metrics."""
    assert {f"executor {r}" for r in range(ranks)} <= server.children().keys()
    flips = count_flips(served_greedy(server, SERVED_PROMPTS, 24), single, label)
    assert flips <= 1, f"{flips} near-tie flips in {len(SERVED_PROMPTS)} prompts"

    def timed() -> bool:  # (with the core's next heartbeat)
        busy = stage_seconds(server.get("/metrics").text, "busy")
        return set(busy) == {"0", "1"} and min(busy.values()) > 0

    assert wait_until(timed, 5)
    idle = stage_seconds(server.get("/metrics").text, "idle")
    assert set(idle) == {"0", "1"} and idle["1"] > 0  # stage 1 waits for stage 0


@pytest.mark.e2e
def test_served_stages_equal_one_rank_report_their_idle_time_and_restart_together(
    tiny_llama_dir, one_rank_greedy, tmp_path
):
    """`zllm serve --pipeline-parallel-size 2`, and 2 stages x 2 tensor-parallel ranks. On the
    two-stage server then, SIGKILL the last stage (the rank that answers the core) while
    requests run: an executor death. In-flight requests end with a 503 or an error event,
    every rank and the core restart, and the same greedy output follows."""
    single = one_rank_greedy(tiny_llama_dir, 24)
    for flags, ranks in (
        (("--pipeline-parallel-size", "2"), 2),
        (("--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"), 4),
    ):
        server = start_server(tiny_llama_dir, tmp_path / f"pp{ranks}.log", *flags)
        try:
            check_served_split(server, single, f"tiny {' '.join(flags)}", ranks)
            if ranks == 2:
                before = served_greedy(server, SERVED_PROMPTS[:2], 16)
                kill_rank_under_load(server, "executor 1", ("executor 0", "executor 1", "core"))
                after = served_greedy(server, SERVED_PROMPTS[:2], 16)
                assert [tokens for tokens, _ in after] == [tokens for tokens, _ in before]
        finally:
            assert stop_server(server) == 0


@pytest.mark.e2e
@pytest.mark.slow
def test_served_smollm2_three_stages_equal_one_rank(smollm2_path, one_rank_greedy, tmp_path):
    """SmolLM2 (30 layers: 10 a stage, Q4_1 blocks) on 3 stages through the server: greedy
    output equal to one rank's (near-tie rule), every stage's matmuls on GGUF blocks."""
    single = one_rank_greedy(smollm2_path, 32)
    split, _ = serve_and_generate(
        smollm2_path, tmp_path / "pp3.log", 32, "--pipeline-parallel-size", "3"
    )
    flips = count_flips(split, single, "smollm2 PP=3")
    assert flips <= 1, f"{flips} near-tie flips in {len(SERVED_PROMPTS)} prompts"
    assert (tmp_path / "pp3.log").read_text().count("GGUF kernels: 40 of 40 decoder matmuls") == 3
