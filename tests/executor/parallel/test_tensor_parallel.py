"""Tensor parallelism (executor/parallel/): how a model is cut, and a cut model's logits
against the whole model's, with 2 and 3 gloo ranks as processes on loopback."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from model_cases import BASE, MODELS, PROMPTS
from paged_runner import PagedRunner, Sequence
from parity import SERVED_PROMPTS, count_flips, served_greedy
from servers import free_port, start_server, stop_server
from tiny_models import arch_config_of

from zllm.config.parallel import check_divisible
from zllm.executor.models import model_class_of
from zllm.executor.parallel.groups import SINGLE, TensorParallel, init_parallel
from zllm.executor.parallel.shards import kv_heads_of, local_arch, shard_blocks, shard_weight
from zllm.executor.ranks.processes import rank_start_context

# name -> (model_cases.MODELS entry, HF config overrides, ranks)
CASES = {
    "llama-2": ("llama", {}, 2),  # 4 heads / 2 KV heads: one KV head per rank
    "llama-tied-2": ("llama-tied", {}, 2),  # logits from the tied embedding's rows
    "qwen2-bias-2": ("qwen2", {}, 2),  # q/k/v biases cut with their rows
    # 6 heads / 1 KV head on 3 ranks: the KV head replicated; vocabulary 256 over 3 ranks
    # leaves the last share one row short (padded, then cut off after the gather).
    "gqa-replicated-3": (
        "llama",
        dict(
            num_attention_heads=6,
            num_key_value_heads=1,
            head_dim=16,
            hidden_size=96,
            intermediate_size=96,
        ),
        3,
    ),
    # SmolLM2's shape of heads: 9 query / 3 KV heads on 3 ranks.
    "smollm2-heads-3": (
        "llama",
        dict(
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=16,
            hidden_size=144,
            intermediate_size=96,
        ),
        3,
    ),
}


def arch_of(case: str):
    config, _ = build_case(case)
    return arch_config_of(config)


def build_case(case: str):
    name, overrides, _ = CASES[case]
    architecture, base_overrides = MODELS[name]
    from tiny_models import tiny_hf_config, tiny_hf_model

    config = tiny_hf_config(architecture, **{**BASE, **base_overrides, **overrides})
    hf = tiny_hf_model(config, 0).eval()
    with torch.no_grad():
        for pname, param in hf.named_parameters():
            scale = 0.2 if "norm" in pname else 0.15
            param.copy_((1 if "norm" in pname else 0) + scale * torch.randn_like(param))
    return config, hf


def run_model(case: str, tp: TensorParallel) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill all PROMPTS in one step (logits of every token), then 6 greedy decode steps."""
    torch.manual_seed(0)
    config, hf = build_case(case)
    arch = arch_config_of(config)
    model = model_class_of(arch)(arch, tp=tp).eval()
    model.load_weights(hf.state_dict().items())
    runner = PagedRunner(model)
    seqs = [Sequence(list(p)) for p in PROMPTS]
    prefill = runner.step([(s, len(s.tokens)) for s in seqs])
    runner_seqs = seqs
    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    for s, token in zip(runner_seqs, prefill[ends].argmax(-1).tolist(), strict=True):
        s.tokens.append(token)
    for _ in range(6):
        runner.step_and_sample([(s, 1) for s in runner_seqs])
    return prefill, [s.tokens for s in runner_seqs]


def _rank_main(rank: int, size: int, port: int, case: str, results) -> None:
    tp = init_parallel(rank, f"tcp://127.0.0.1:{port}", "cpu", tp_size=size).tp
    try:
        torch.set_num_threads(1)
        logits, tokens = run_model(case, tp)
        results.put((rank, logits.numpy(), tokens))  # plain pickles: the process may exit first
        # Once every rank has its result out, leave without tearing gloo down: its teardown at
        # exit aborted a rank once in a whole-suite run ("terminate called without an active
        # exception", SIGABRT after the result was sent), which says nothing of the logits.
        torch.distributed.barrier()
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    os._exit(0)


def run_ranks(case: str, timeout: float = 300) -> dict[int, tuple[torch.Tensor, list[list[int]]]]:
    """Every rank's (logits, tokens). A rank that dies early fails this at once, naming it,
    and the others (blocked in a collective or at the rendezvous, waiting for it) are
    killed: a blocking get() on the results would wait for the dead rank forever."""
    size = CASES[case][2]
    ctx = rank_start_context()  # the engine's: forked from a process that has imported torch
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, port, case, results)) for r in range(size)
    ]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < size:
            if not results.empty():
                rank, logits, tokens = results.get()
                out[rank] = (torch.from_numpy(logits), tokens)
                continue
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            assert not dead, f"{case}: ranks exited early (rank: exit code): {dead}"
            assert time.monotonic() < deadline, f"{case}: ranks gave no result in {timeout} s"
            time.sleep(0.05)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_compute_the_whole_models_logits(case):
    """Every rank ends with the same logits bits (they sample alike), within fp32 summation
    noise of the single-rank model's, and the same greedy tokens."""
    whole_logits, whole_tokens = run_model(case, SINGLE)
    ranks = run_ranks(case)
    logits0, tokens0 = ranks[0]
    for rank, (logits, tokens) in ranks.items():
        assert torch.equal(logits, logits0), f"rank {rank} differs from rank 0"
        assert tokens == tokens0
    assert logits0.shape == whole_logits.shape
    scale = whole_logits.abs().max().item()
    torch.testing.assert_close(logits0, whole_logits, atol=2e-5 * scale, rtol=0)
    assert tokens0 == whole_tokens


# ---- the cut, without processes ----------------------------------------------------------


def test_kv_heads_split_or_replicated():
    arch = arch_of("smollm2-heads-3")  # 9 / 3
    assert [list(kv_heads_of(arch, TensorParallel(r, 3))) for r in range(3)] == [[0], [1], [2]]
    rep = arch_of("gqa-replicated-3")  # 6 / 1: every rank holds KV head 0
    assert [list(kv_heads_of(rep, TensorParallel(r, 3))) for r in range(3)] == [[0], [0], [0]]
    two = dataclasses.replace(rep, num_heads=8, num_kv_heads=2)  # 4 ranks, 2 KV heads
    assert [list(kv_heads_of(two, TensorParallel(r, 4))) for r in range(4)] == [[0], [0], [1], [1]]
    local = local_arch(arch, TensorParallel(1, 3))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 32)


def test_query_heads_read_their_own_kv_head():
    """Rank r's query heads are the ones that, in the whole model, read rank r's KV heads."""
    for heads, kv, size in [(9, 3, 3), (8, 2, 4), (6, 1, 3), (16, 4, 2), (4, 4, 4)]:
        arch = dataclasses.replace(arch_of("llama-2"), num_heads=heads, num_kv_heads=kv)
        group = heads // kv
        for rank in range(size):
            tp = TensorParallel(rank, size)
            q_heads = range(rank * heads // size, (rank + 1) * heads // size)
            held = kv_heads_of(arch, tp)
            assert {h // group for h in q_heads} <= set(held), (heads, kv, size, rank)
            assert len(held) == max(1, kv // size)


def test_indivisible_sizes_are_refused_with_what_fits():
    arch = arch_of("smollm2-heads-3")  # 9 heads, 3 KV heads, intermediate 96
    with pytest.raises(ValueError, match=r"9 attention heads.*sizes that fit: \[3\]"):
        check_divisible(arch, 2)
    check_divisible(arch, 3)


def test_shard_weight_rows_columns_and_vocab():
    arch = arch_of("llama-2")  # 4 heads of 16, 2 KV heads, intermediate 128, vocab 256
    tp = TensorParallel(1, 2)
    w = torch.arange(256 * 128, dtype=torch.float32).view(256, 128)
    layer = "model.layers.0."
    assert torch.equal(shard_weight(layer + "self_attn.q_proj.weight", w[:64], arch, tp), w[32:64])
    assert torch.equal(shard_weight(layer + "self_attn.k_proj.weight", w[:32], arch, tp), w[16:32])
    assert torch.equal(shard_weight(layer + "mlp.up_proj.weight", w[:128], arch, tp), w[64:128])
    o = w[:64, :64]
    assert torch.equal(shard_weight(layer + "self_attn.o_proj.weight", o, arch, tp), o[:, 32:])
    down = w[:64]  # [hidden 64, intermediate 128]
    assert torch.equal(shard_weight(layer + "mlp.down_proj.weight", down, arch, tp), down[:, 64:])
    assert torch.equal(shard_weight("model.norm.weight", w[0], arch, tp), w[0])
    odd = TensorParallel(2, 3)  # 256 rows over 3 ranks: 86, 86, 84 + 2 zero rows
    last = shard_weight("lm_head.weight", w, arch, odd)
    assert last.shape == (86, 128) and torch.equal(last[:84], w[172:]) and not last[84:].any()


def test_shard_blocks_on_block_boundaries_only():
    arch = arch_of("llama-2")  # q_proj: 64 rows; o_proj: 64 inputs, 32 per rank
    tp = TensorParallel(1, 2)
    # 64 rows of 2 blocks (32 values in 18 bytes each: Q4_1's geometry).
    blocks = (torch.arange(64 * 36) % 251).to(torch.uint8).view(64, 36)
    o = shard_blocks("model.layers.0.self_attn.o_proj.weight", blocks, 32, 18, arch, tp)
    assert torch.equal(o, blocks[:, 18:])
    q = shard_blocks("model.layers.0.self_attn.q_proj.weight", blocks, 32, 18, arch, tp)
    assert torch.equal(q, blocks[32:])
    # 256-value blocks (K-quants) cannot be cut at 32: that matmul keeps fp32 weights.
    name = "model.layers.0.self_attn.o_proj.weight"
    assert shard_blocks(name, blocks, 256, 144, arch, tp) is None


# ---- through `zllm serve` ----------------------------------------------------------------


def serve_and_generate(model: str, log, tp: int, max_tokens: int) -> tuple[list, dict]:
    server = start_server(model, log, "--tensor-parallel-size", str(tp))
    try:
        return served_greedy(server, SERVED_PROMPTS, max_tokens), server.children()
    finally:
        assert stop_server(server) == 0


@pytest.mark.e2e
@pytest.mark.slow
def test_served_smollm2_tp3_equals_one_rank(smollm2_path, one_rank_greedy, tmp_path):
    """SmolLM2 (9 query / 3 KV heads, Q4_1 blocks cut per rank) on 3 ranks through the server:
    greedy output equal to one rank's (near-tie rule)."""
    single = one_rank_greedy(smollm2_path, 32)
    split, children = serve_and_generate(smollm2_path, tmp_path / "tp3.log", 3, 32)
    assert {"executor 0", "executor 1", "executor 2"} <= children.keys()
    flips = count_flips(split, single, "smollm2 TP=3")
    assert flips <= 1, f"{flips} near-tie flips in {len(SERVED_PROMPTS)} prompts"
    log = (tmp_path / "tp3.log").read_text()
    assert log.count("GGUF kernels: 120 of 120 decoder matmuls") == 3  # every rank, on blocks


@pytest.mark.e2e
def test_served_tp2_equals_one_rank_and_kill_9_of_one_rank_restarts_every_rank(
    tiny_llama_dir, one_rank_greedy, tmp_path
):
    """`zllm serve --tensor-parallel-size 2`: two executor processes, titled by rank, whose
    greedy output equals one rank's (near-tie rule). Then SIGKILL rank 1 while requests run:
    it is an executor death. In-flight requests end with a 503 or an error event, every rank
    (and the core) is restarted, /health comes back, and the restarted ranks serve the same
    greedy output as before."""
    from servers import kill_rank_under_load

    single = one_rank_greedy(tiny_llama_dir, 24)
    server = start_server(tiny_llama_dir, tmp_path / "server.log", "--tensor-parallel-size", "2")
    try:
        children = server.children()
        assert {"executor 0", "executor 1"} <= children.keys() and "executor" not in children
        flips = count_flips(served_greedy(server, SERVED_PROMPTS, 24), single, "tiny TP=2")
        assert flips <= 1, f"{flips} near-tie flips in {len(SERVED_PROMPTS)} prompts"

        before = served_greedy(server, SERVED_PROMPTS[:2], 16)
        victim = kill_rank_under_load(server, "executor 1", ("executor 0", "executor 1", "core"))
        assert f"executor 1 (pid {victim}) died" in server.log_text()
        after = served_greedy(server, SERVED_PROMPTS[:2], 16)
        # The tokens; their logprobs may differ in the last bits, as the two prompts may share
        # the first step or not depending on when each reaches the core.
        assert [tokens for tokens, _ in after] == [tokens for tokens, _ in before]
    finally:
        assert stop_server(server) == 0


def test_engine_arguments_refuse_what_tensor_parallel_does_not_cover(tiny_llama_dir):
    from zllm.config.engine_args import EngineArgs

    with pytest.raises(ValueError, match=r"4 attention heads.*sizes that fit: \[2, 4\]"):
        EngineArgs(model=tiny_llama_dir, tensor_parallel_size=3).create_engine_config()
    # The transformers backend is cut by transformers' plan at load (test_composition.py).
    hf = EngineArgs(model=tiny_llama_dir, tensor_parallel_size=2, model_impl="transformers")
    assert hf.create_engine_config().model_impl == "transformers"
    # Pipeline stages keep a disk tier each (test_pipeline_tiers.py), in directories named
    # apart from one stage's: a stage's files hold its layers' part of a block.
    from zllm.config.kv_layout import tier_directory

    disk = dict(kv_offload_bytes=1 << 20, kv_offload_dir="/tmp/unused")
    staged = EngineArgs(model=tiny_llama_dir, pipeline_parallel_size=2, **disk)
    staged = staged.create_engine_config()
    whole = EngineArgs(model=tiny_llama_dir, **disk).create_engine_config()
    assert tier_directory(staged, 1).name == "rank-1"
    assert tier_directory(staged, 0).parent != tier_directory(whole)
    config = EngineArgs(model=tiny_llama_dir, tensor_parallel_size=2).create_engine_config()
    assert config.tensor_parallel_size == 2


def test_offline_llm_with_two_ranks(tiny_llama_dir):
    """LLM(tensor_parallel_size=2): rank 1 in a process of its own, the same greedy tokens as
    one rank; when the LLM is collected its rank stops, and a second one can be made."""
    import gc

    from zllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(kv_cache_memory_bytes=64 << 20)
    single = [
        o.outputs[0].token_ids for o in LLM(tiny_llama_dir, **kw).generate(SERVED_PROMPTS, params)
    ]
    for _ in range(2):
        llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **kw)
        (rank1,) = llm.executor.ranks.processes
        split = [o.outputs[0].token_ids for o in llm.generate(SERVED_PROMPTS, params)]
        assert split == single
        del llm
        gc.collect()
        rank1.join(10)
        assert not rank1.is_alive()


def test_offline_gemma3_with_two_ranks(tmp_path):
    """Gemma 3 (sliding and global layers, q/k norms, sandwich norms) with one KV head, which
    both ranks then hold: the same greedy tokens as one rank."""
    from tiny_models import randomize_norms_and_biases, tiny_gemma3_overrides, write_tiny_model

    from zllm import LLM, SamplingParams

    overrides = {**tiny_gemma3_overrides(8), "num_key_value_heads": 1}
    path = str(randomize_norms_and_biases(write_tiny_model(tmp_path, **overrides)))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = {}
    for ranks in (1, 2):
        llm = LLM(path, tensor_parallel_size=ranks, kv_cache_memory_bytes=64 << 20)
        assert llm.config.arch.num_kv_heads == 1
        outputs[ranks] = [o.outputs[0].token_ids for o in llm.generate(SERVED_PROMPTS, params)]
        del llm
    assert outputs[2] == outputs[1]
    assert len({t for out in outputs[1] for t in out}) > 10  # not a degenerate output


def test_offline_unseeded_sampling_ignores_the_callers_random_state(tiny_llama_dir):
    """Unseeded rows draw from a generator every rank holds alike, not from torch's global
    one, which the offline engine's rank 0 shares with the caller: two engines give the same
    samples whether or not the caller drew random numbers before generating (the other
    ranks, in their own processes, could not follow such draws)."""
    import gc

    from zllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    samples = []
    for caller_draws in (0, 1000):
        llm = LLM(tiny_llama_dir, tensor_parallel_size=2, kv_cache_memory_bytes=64 << 20)
        torch.rand(caller_draws)  # the caller's own use of the global generator
        samples.append([o.outputs[0].token_ids for o in llm.generate(SERVED_PROMPTS, params)])
        del llm
        gc.collect()
    assert samples[0] == samples[1]


@pytest.mark.parametrize("when", ["before joining", "while loading"])
def test_offline_rank_that_dies_starting_fails_the_llm_at_once(tiny_llama_dir, monkeypatch, when):
    """Rank 1 killed before it joins the process group (rank 0 would wait at the rendezvous
    for COLLECTIVE_TIMEOUT_S, 10 minutes), or after, while the ranks load the model (rank 0's
    first collective meets a closed connection): LLM() raises within seconds and leaves no
    rank process behind."""
    import os
    import signal
    import time

    from zllm import LLM
    from zllm.executor import offline
    from zllm.executor.host.model_weights import ModelWeights
    from zllm.executor.parallel import groups as parallel
    from zllm.executor.ranks import processes as ranks

    started: list = []

    class RanksKilledAtOnce(ranks.RankProcesses):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            started.extend(self.processes)
            if when == "before joining":
                os.kill(self.processes[0].pid, signal.SIGKILL)
                self.processes[0].join(10)

    load = ModelWeights.load

    def killed_while_loading(weights) -> None:
        if when == "while loading":  # every rank has joined: rank 0's init returned
            os.kill(started[0].pid, signal.SIGKILL)
            started[0].join(10)
        load(weights)

    monkeypatch.setattr(offline, "RankProcesses", RanksKilledAtOnce)
    monkeypatch.setattr(ModelWeights, "load", killed_while_loading)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="executor rank processes died|[Cc]onnection"):
        LLM(tiny_llama_dir, tensor_parallel_size=2, kv_cache_memory_bytes=64 << 20)
    assert time.monotonic() - start < parallel.COLLECTIVE_TIMEOUT_S / 10
    assert [p.is_alive() for p in started] == [False]


def test_offline_step_that_fails_stops_the_ranks_and_says_so(tiny_llama_dir, monkeypatch):
    """A step that fails on rank 0 (here: an injected error) leaves the other ranks where
    rank 0 cannot rejoin them: they are stopped, and the next call says to make a new LLM
    instead of hanging in a collective."""
    from zllm import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, kv_cache_memory_bytes=64 << 20)
    (rank1,) = llm.executor.ranks.processes
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def fail(step):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.model_runner, "execute_model", fail)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(SERVED_PROMPTS[:1], params, use_tqdm=False)
    rank1.join(10)
    assert not rank1.is_alive()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="make a new LLM"):
        llm.generate(SERVED_PROMPTS[:1], params, use_tqdm=False)
