"""Sleep mode (vLLM's `LLM.sleep()` / `wake_up()`): while asleep the weights and the KV pool
are released (the process's resident memory falls by at least the pool plus 90% of the
weights' bytes); after waking, outputs equal those before, and the prefix cache starts empty."""

from __future__ import annotations

import pytest
import torch

from zllm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=2, ignore_eos=True)


def texts(outs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outs]


def test_outputs_after_waking_equal_those_before(tiny_llama_dir) -> None:
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20)
    prompts = [
        "The quick brown fox jumps over the lazy dog, again and again, all day long.",
        "Paged attention stores keys and values in fixed-size blocks of the KV cache.",
    ]
    before = texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    sampled = texts(llm.generate(prompts, SAMPLED, use_tqdm=False))
    assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.sleep()
    assert llm.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.wake_up()
    assert not llm.is_sleeping()
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [0, 0]  # the prefix cache starts empty
    assert texts(again) == before
    assert texts(llm.generate(prompts, SAMPLED, use_tqdm=False)) == sampled


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, buffers, the GGUF kernel's blocks
    and fp32 copies), each storage counted once."""
    storages: dict[int, int] = {}
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for t in held:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.slow
def test_sleep_releases_weights_and_kv_pool(smollm2_path) -> None:
    llm = LLM(smollm2_path, kv_cache_memory_bytes=48 << 20)
    prompts = [f"Write a long story about the number {i}." for i in range(10)]
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    before = texts(llm.generate(prompts, long, use_tqdm=False))  # touches the whole pool
    runner = llm.model_runner
    weights = tensor_bytes(runner.model)
    pool = sum(t.nbytes for t in runner.kv_tensors)
    resident = resident_bytes()
    llm.sleep()
    released = resident - resident_bytes()
    assert released >= pool + 0.9 * weights, (released, pool, weights)
    llm.wake_up()
    assert texts(llm.generate(prompts, long, use_tqdm=False)) == before
