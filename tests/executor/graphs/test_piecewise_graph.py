"""Piecewise graphs for prefill and mixed steps (executor/graphs/piecewise.py), on CPU: the
pieces are recorded and replayed by RecordedOps (aten ops replayed on the same tensors, as a
CUDA graph replays kernels on the same addresses), with the attention between them eager.
The replayed step must equal the eager model's: hidden states and the KV cache it wrote.
tests/test_cuda.py runs the same on a GPU with real CUDA graphs."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import write_tiny_model

from zllm.executor.attention.backend import TORCH_ATTENTION
from zllm.executor.attention.cuda import CUDA_ATTENTION, CudaAttentionMetadata
from zllm.executor.attention.layer_groups import LayerAttention
from zllm.executor.attention.paged import AttentionMetadata
from zllm.executor.graphs.piecewise import PiecewiseGraphRunner, RecordedPieces
from zllm.executor.kernels import cpu_layer_ops
from zllm.executor.kernels import cuda as ck
from zllm.executor.models.llama import LlamaForCausalLM
from zllm.executor.weights.loader import load_weights
from zllm.model.arch import read_arch_config

BLOCK = 16

# Per layer of the two-layer tiny model, (KV cache group, sliding window): one metadata for
# every layer, or a window on layer 0 only (two slot sets per step).
LAYOUTS = {"full": None, "mixed-window": [(0, 24), (0, None)]}


class Sequences:
    """A few sequences' block tables in one cache, and the metadata of a step over them."""

    def __init__(self, backend: str, layers: list[LayerAttention] | None, num_seqs: int) -> None:
        self.backend, self.layers = backend, layers
        gen = torch.Generator().manual_seed(3)
        # Disjoint, shuffled blocks: 8 per sequence (128 tokens each).
        order = torch.randperm(num_seqs * 8, generator=gen) + 1
        self.tables = [order[8 * i : 8 * i + 8].tolist() for i in range(num_seqs)]
        self.num_blocks = num_seqs * 8 + 1

    def slot(self, seq: int, pos: int) -> int:
        return self.tables[seq][pos // BLOCK] * BLOCK + pos % BLOCK

    def step(self, seqs: list[int], cached: list[int], new: list[int]) -> tuple:
        """(positions, metadata) of a step giving each sequence `new` tokens after `cached`."""
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new, strict=True)])
        slots = [self.slot(s, int(p)) for s, c, n in zip(seqs, cached, new, strict=True)
                 for p in range(c, c + n)]  # fmt: skip
        seq_lens = [c + n for c, n in zip(cached, new, strict=True)]
        tables = [self.tables[s][: -(-n // BLOCK)] for s, n in zip(seqs, seq_lens, strict=True)]
        build = CudaAttentionMetadata.build if self.backend == "cuda" else AttentionMetadata.build
        args = (new, seq_lens, tables, slots, BLOCK, "cpu")
        if self.layers is None:
            return positions, build(*args)
        built = {k: build(*args, sliding_window=k.sliding_window) for k in set(self.layers)}
        return positions, [built[k] for k in self.layers]


@pytest.fixture
def tiny(tmp_path, monkeypatch, request):
    """A two-layer fp32 model on the torch backend, or on the CUDA backend whose kernels run
    under the host emulator; our C++ row ops off (RecordedOps sees only aten ops)."""
    monkeypatch.setattr(cpu_layer_ops, "usable", lambda x: False)
    backend = request.param
    if backend == "cuda":
        emu = request.getfixturevalue("emu")
        monkeypatch.setattr(ck, "run_launches", emu.run_launches)
    path = str(write_tiny_model(tmp_path / "m", hidden_size=256, intermediate_size=256,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=1024))  # fmt: skip
    arch = read_arch_config(path)
    model = LlamaForCausalLM(
        arch, attention=CUDA_ATTENTION if backend == "cuda" else TORCH_ATTENTION
    )
    model.load_weights(load_weights(path, arch))
    return backend, arch, model


@torch.inference_mode()
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tiny", ["torch", "cuda"], indirect=True)
def test_piecewise_replay_equals_the_eager_step(tiny, layout):
    backend, arch, model = tiny
    layers = LAYOUTS[layout] and [LayerAttention(g, w) for g, w in LAYOUTS[layout]]
    seqs = Sequences(backend, layers, num_seqs=5)
    caches = [torch.zeros(2, seqs.num_blocks, BLOCK, 2, 64) for _ in range(arch.num_layers)]
    gen = torch.Generator().manual_seed(7)
    warnings.simplefilter("ignore")  # SDPA's "no fused kernel on CPU" notes

    # Earlier steps, eagerly: four sequences' prompts (a fifth arrives later).
    cached = [37, 5, 16, 60]
    positions, meta = seqs.step([0, 1, 2, 3], [0] * 4, cached)
    ids = torch.randint(0, arch.vocab_size, (sum(cached),), generator=gen)
    model(ids, positions, caches, meta)

    runner = PiecewiseGraphRunner(model, caches, RecordedPieces(), max_num_tokens=40,
                                  capture_sizes=(8, 16, 32, 48, 64), layer_attention=layers)  # fmt: skip
    assert runner.capture_sizes == [8, 16, 32, 48]
    assert runner.capture()
    assert all(len(p) == arch.num_layers + 1 for p in runner.pieces.values())
    mlp_calls = []
    model.layers[0].mlp.register_forward_pre_hook(lambda *a: mlp_calls.append(1))

    steps = [
        # decodes of 0 and 1, a chunk of 20 after 16 cached (2), a new prompt of 9 (4)
        ([0, 1, 2, 4], [37, 5, 16, 0], [1, 1, 20, 9]),
        # three tokens: a smaller size, whose padding rows follow the last step's real ones
        ([0, 3], [38, 60], [1, 2]),
        # decodes only: the piecewise runner takes those too
        ([0, 1, 2, 3, 4], [39, 6, 36, 62, 9], [1, 1, 1, 1, 1]),
        # a speculative verify step's shape: the last token and proposals, a few per row
        ([0, 1, 3], [40, 7, 63], [4, 3, 2]),
    ]
    for seq_ids, before, new in steps:
        positions, meta = seqs.step(seq_ids, before, new)
        ids = torch.randint(0, arch.vocab_size, (sum(new),), generator=gen)
        eager_caches = [c.clone() for c in caches]
        expected = model(ids, positions, eager_caches, meta).clone()
        calls = len(mlp_calls)
        replayed = runner.run(ids, positions, meta)
        assert replayed is not None and len(mlp_calls) == calls  # no Python forward ran
        # (A GEMM over the padded size may round differently: 1e-4, against the O(0.1) a
        # wrong attention input or a stale row would make.)
        torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)
        for c, c_eager in zip(caches, eager_caches, strict=True):
            torch.testing.assert_close(c, c_eager, atol=1e-4, rtol=1e-4)

    # More tokens than the largest size: the caller runs the model eagerly.
    positions, meta = seqs.step([4], [10], [49])
    assert runner.run(torch.zeros(49, dtype=torch.int64), positions, meta) is None


@torch.inference_mode()
@pytest.mark.parametrize("tiny", ["torch"], indirect=True)
def test_a_forward_that_cannot_be_cut_leaves_the_eager_path(tiny, monkeypatch, caplog):
    """A model whose attention calls do not come one per layer is refused at capture, with a
    warning, and every step then runs eagerly."""
    _, arch, model = tiny
    caches = [torch.zeros(2, 9, BLOCK, 2, 64) for _ in range(arch.num_layers)]
    runner = PiecewiseGraphRunner(model, caches, RecordedPieces(), max_num_tokens=16,
                                  capture_sizes=(8, 16))  # fmt: skip
    layer = model.layers[1]
    monkeypatch.setattr(layer, "forward", lambda x, residual, *a: (x, residual))  # no attention
    assert not runner.capture()
    assert "Piecewise CUDA graphs off" in caplog.text and not runner.pieces
    positions = torch.arange(4)
    meta = AttentionMetadata.build([4], [4], [[1]], [16, 17, 18, 19], BLOCK, "cpu")
    assert runner.run(torch.zeros(4, dtype=torch.int64), positions, meta) is None
    assert model.layers[0].self_attn.attn is runner.layers[0]  # the real layers are back


@torch.inference_mode()
@pytest.mark.parametrize("tiny", ["torch"], indirect=True)
def test_a_capture_that_fails_midway_leaves_nothing_recording(tiny, monkeypatch):
    """An error inside a piece (here the MLP of layer 0, on the recorded pass after the
    warm-up) ends the capture cleanly: no recording mode left on, the eager model intact."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    _, arch, model = tiny
    caches = [torch.zeros(2, 9, BLOCK, 2, 64) for _ in range(arch.num_layers)]
    runner = PiecewiseGraphRunner(model, caches, RecordedPieces(), max_num_tokens=8,
                                  capture_sizes=(8,))  # fmt: skip
    mlp, calls = model.layers[0].mlp, []
    original = mlp.forward

    def second_call_fails(x):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("not capturable")
        return original(x)

    monkeypatch.setattr(mlp, "forward", second_call_fails)
    assert not runner.capture()
    assert len(calls) == 2 and _get_current_dispatch_mode() is None
    assert runner._capturing is None and not runner._closed  # no half-made capture kept
    assert model.layers[0].self_attn.attn is runner.layers[0]
    meta = AttentionMetadata.build([4], [4], [[1]], [16, 17, 18, 19], BLOCK, "cpu")
    out = model(torch.zeros(4, dtype=torch.int64), torch.arange(4), caches, meta)
    assert out.shape == (4, arch.hidden_size) and torch.isfinite(out).all()


@torch.inference_mode()
@pytest.mark.parametrize("tiny", ["torch"], indirect=True)
def test_lora_slots_replay_the_steps_adapters(tiny, tmp_path):
    """LoRA steps in pieces (lora/slots.py): captured with no adapter in any row, the
    replay reads each step's rows-by-slot from memory, so steps with adapters (one, two,
    one reused in another slot) equal the eager model with the same adapters."""
    from tiny_models import write_lora_adapter

    from zllm.config.engine_args import EngineArgs
    from zllm.executor.lora.manager import LoRAManager
    from zllm.lora import LoRARequest

    _, arch, model = tiny
    path = tmp_path / "m"
    engine = EngineArgs(str(path), enable_lora=True, max_loras=2, max_lora_rank=8)
    lora = LoRAManager(model, engine.create_engine_config(), torch.float32,
                       torch.device("cpu"), slots=True)  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for i in (1, 2, 3):
        adapter = write_lora_adapter(tmp_path / f"a{i}", path, rank=2 * i, targets=targets, seed=i)
        lora.add(LoRARequest(f"a{i}", i, str(adapter)))
    seqs = Sequences("torch", None, num_seqs=4)
    caches = [torch.zeros(2, seqs.num_blocks, BLOCK, 2, 64) for _ in range(arch.num_layers)]
    runner = PiecewiseGraphRunner(model, caches, RecordedPieces(), max_num_tokens=32,
                                  capture_sizes=(8, 16, 32))  # fmt: skip
    assert runner.capture()
    gen = torch.Generator().manual_seed(5)
    steps = [  # (sequences, cached, new tokens, each sequence's adapter)
        ([0, 1, 2], [0, 0, 0], [9, 5, 12], [1, 1, None]),
        ([0, 1, 2, 3], [9, 5, 12, 0], [1, 1, 1, 7], [2, 1, None, 2]),
        ([0, 3], [10, 7], [1, 1], [3, 1]),  # adapter 3 takes adapter 2's slot
    ]
    for seq_ids, before, new, loras in steps:
        positions, meta = seqs.step(seq_ids, before, new)
        ids = torch.randint(0, arch.vocab_size, (sum(new),), generator=gen)
        lora.set_batch([None] * len(new), new)
        base = model(ids, positions, [c.clone() for c in caches], meta).clone()
        lora.set_batch(loras, new)
        eager_caches = [c.clone() for c in caches]
        expected = model(ids, positions, eager_caches, meta).clone()
        assert (expected - base).abs().max() > 1e-2  # the adapters change the step
        replayed = runner.run(ids, positions, meta)
        assert replayed is not None
        torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)
        for c, c_eager in zip(caches, eager_caches, strict=True):
            torch.testing.assert_close(c, c_eager, atol=1e-4, rtol=1e-4)
