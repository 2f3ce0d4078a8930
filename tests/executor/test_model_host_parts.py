"""The model host's memory owners, each releasing and restoring itself (executor/model_host.py):
the weights (weights/model_weights.py), the KV cache (kv/cache.py) and the decode path
(graphs/decode_path.py), built on CPU over a tiny random model; and sleep mode
(sleep_mode.py), which only calls them, by level and by tag. Whole engines asleep and awake
are test_sleep.py's."""

from __future__ import annotations

import pytest
import torch

from zllm.config.engine import EngineConfig
from zllm.config.engine_args import EngineArgs
from zllm.executor.host.kv_cache import KVCache
from zllm.executor.host.layout import RankLayout
from zllm.executor.host.model_host import ModelHost
from zllm.executor.host.model_weights import ModelWeights
from zllm.executor.host.sleep_mode import SleepMode
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.spec_decode.ngram import NgramProposer

POOL = 1 << 20  # bytes: 128 blocks of the tiny model's 16 slots x 512 bytes


def engine_config(model_dir: str, **options) -> EngineConfig:
    return EngineArgs(model=model_dir, kv_cache_memory_bytes=POOL, **options).create_engine_config()


def test_weights_stay_at_level_1_on_cpu_and_come_back_from_the_file_after_level_2(
    tiny_llama_dir,
) -> None:
    layout = RankLayout.of(engine_config(tiny_llama_dir, enable_lora=True, max_loras=2))
    weights = ModelWeights(layout)
    model, lora = weights.model, weights.lora
    assert lora is not None
    before = {name: t.clone() for name, t in model.state_dict().items()}
    addresses = [p.data_ptr() for p in model.parameters()]
    hidden = torch.randn(3, layout.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = weights.compute_logits(hidden)

    weights.release(1)  # on CPU the weights are in host memory already: nothing moves
    assert weights.model is model and [p.data_ptr() for p in model.parameters()] == addresses
    weights.restore()
    assert weights.model is model and weights.lora is lora

    weights.release(2)
    assert weights.model is None and weights.lora is None
    weights.restore()  # read from the model file again
    assert weights.model is not model and weights.model is not None
    assert weights.lora is not None and weights.lora is not lora
    after = weights.model.state_dict()
    assert after.keys() == before.keys()
    assert [name for name in before if not torch.equal(after[name], before[name])] == []
    assert torch.equal(weights.compute_logits(hidden), logits)


def test_kv_cache_is_sized_from_its_budget_and_restores_a_fresh_pool(tiny_llama_dir) -> None:
    layout = RankLayout.of(engine_config(tiny_llama_dir))
    kv = KVCache(layout)
    # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32, the budget in 16-slot blocks.
    assert kv.bytes_per_slot() == 2 * 2 * 2 * 16 * 4
    assert kv.num_blocks == POOL // (512 * 16) == 128 == layout.config.cache.num_blocks
    assert [tuple(t.shape) for t in kv.tensors] == [(2, 128, 16, 2, 16)] * 2
    assert [c is t for c, t in zip(kv.caches, kv.tensors, strict=True)] == [True, True]
    assert kv.pool.tensors is kv.tensors and kv.proposer is None and kv.tiers is None
    kv.tensors[1][:, 3] = 7.0
    kv.copy_block(3, 5)
    assert torch.equal(kv.tensors[1][:, 5], kv.tensors[1][:, 3])

    kv.release(1)
    assert kv.tensors == [] and kv.caches == [] and kv.pool.tensors == []
    kv.restore()
    assert [tuple(t.shape) for t in kv.tensors] == [(2, 128, 16, 2, 16)] * 2
    assert all(not t.any() for t in kv.tensors)  # fresh: the old contents are gone
    assert kv.pool.tensors is kv.tensors and kv.caches[1] is kv.tensors[1]


def test_kv_cache_restores_its_proposer_only_when_asked(tiny_llama_dir) -> None:
    """The proposer comes back with restore_proposer (sleep mode: once the weights are back
    too), not with the pool."""
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    kv = KVCache(RankLayout.of(engine_config(tiny_llama_dir, speculative_config=ngram)))
    proposer = kv.proposer
    assert isinstance(proposer, NgramProposer)
    kv.release(2)
    assert kv.proposer is None
    kv.restore()
    assert kv.proposer is None and len(kv.tensors) == 2
    kv.restore_proposer()
    assert isinstance(kv.proposer, NgramProposer) and kv.proposer is not proposer


@pytest.mark.skipif(
    not cpu_kernels.cpu_supports_kernels(), reason="the fused stack needs AVX2/FMA/F16C"
)
def test_decode_path_keeps_its_fused_stack_at_level_1_and_rebuilds_it_over_new_weights(
    tiny_llama_dir,
) -> None:
    host = ModelHost(engine_config(tiny_llama_dir))
    decode = host.decode
    fused = decode.fused
    assert fused is not None and fused.model is host.weights.model
    assert decode.graph_runner is None and decode.piecewise_runner is None  # (no GPU)

    decode.release(1)  # the weights stay: so does the stack over them
    decode.restore()
    assert decode.fused is fused

    decode.release(2)
    assert decode.fused is None
    host.weights.release(2)
    host.weights.restore()
    decode.restore()
    assert decode.fused is not None and decode.fused is not fused
    assert decode.fused.model is host.weights.model


class RecordingOwner:
    """A memory owner that records its calls and holds nothing else, so sleep mode touching
    any attribute of it would fail."""

    __slots__ = ("name", "calls")

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def release(self, level: int) -> None:
        self.calls.append(f"{self.name}.release({level})")

    def restore(self) -> None:
        self.calls.append(f"{self.name}.restore")

    def restore_proposer(self) -> None:
        self.calls.append(f"{self.name}.restore_proposer")


def test_sleep_mode_calls_the_owners_by_level_and_tag() -> None:
    calls: list[str] = []
    weights, kv, decode = (RecordingOwner(name, calls) for name in ("weights", "kv", "decode"))
    sleep = SleepMode(weights, kv, decode, torch.device("cpu"))  # type: ignore[arg-type]
    assert not sleep.asleep
    sleep.wake_up()  # awake: nothing to restore
    assert calls == []

    sleep.sleep(2)
    assert calls == ["kv.release(2)", "decode.release(2)", "weights.release(2)"]
    assert sleep.asleep and sleep.sleeping == {"weights", "kv_cache"}
    sleep.sleep(1)  # asleep already
    assert len(calls) == 3

    calls.clear()
    sleep.wake_up(["kv_cache"])
    sleep.wake_up(["kv_cache"])  # back already
    assert calls == ["kv.restore"] and sleep.sleeping == {"weights"}
    sleep.wake_up(["weights"])  # both back: then what reads both
    assert calls == ["kv.restore", "weights.restore", "decode.restore", "kv.restore_proposer"]
    assert not sleep.asleep

    calls.clear()
    sleep.sleep(1)
    sleep.wake_up()
    assert calls == [
        "kv.release(1)",
        "decode.release(1)",
        "weights.release(1)",
        "weights.restore",
        "kv.restore",
        "decode.restore",
        "kv.restore_proposer",
    ]
