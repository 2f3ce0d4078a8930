"""An encoder's own kernels on the transformers backend: attention over a step's flat batch
(executor/models/transformers/backend.py: prompts lie back to back, runs of one length go
through SDPA as views of the batch; each prompt must attend to its own tokens only, as SDPA
over that prompt alone does), and its matmuls through oneDNN with bias and GELU fused
(executor/models/encoder_matmuls.py: the same outputs as transformers' modules)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zllm.executor.models.transformers.backend import _encoder_attention, _equal_length_runs
from zllm.executor.models.transformers.encoder_matmuls import PackedLinear, pack_encoder_matmuls_


def test_runs_group_consecutive_prompts_of_one_length() -> None:
    prompts = [(0, 3), (3, 6), (6, 11), (11, 14), (14, 15)]
    assert _equal_length_runs(prompts) == [(0, 2, 3), (6, 1, 5), (11, 1, 3), (14, 1, 1)]


@pytest.mark.parametrize("window", [None, 2])
def test_each_prompt_attends_to_itself_alone(window: int | None) -> None:
    torch.manual_seed(0)
    lengths = [3, 3, 5, 3, 3, 1, 4]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    prompts = [(s, s + n) for s, n in zip(starts, lengths, strict=True)]
    total, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q = torch.randn(total, heads, dim)
    k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    out = _encoder_attention(q, k, v, prompts, 0.3, window)
    for start, end in prompts:
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(2, dim=0), vs.repeat_interleave(2, dim=0)
        index = torch.arange(end - start)
        mask = None if window is None else (index[:, None] - index[None, :]).abs() < window
        expected = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.3)
        torch.testing.assert_close(out[start:end], expected.transpose(0, 1))


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta", "modernbert"])
def test_packed_matmuls_give_transformers_outputs(model_type: str) -> None:
    """Every layer matmul packed (BERT's intermediate with its exact GELU inside the GEMM,
    ModernBERT's gated Wi without), and the model's hidden states those of its own modules."""
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, vocab_size=100, pad_token_id=0)  # fmt: skip
    model = AutoModel.from_config(AutoConfig.for_model(model_type, **shape)).eval()
    ids = torch.randint(1, 100, (2, 12))
    with torch.inference_mode():
        expected = model(input_ids=ids).last_hidden_state
        linears = sum(type(m) is torch.nn.Linear for m in model.modules())
        assert pack_encoder_matmuls_(model) == linears
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert len(packed) == linears and not any(
            type(m) is torch.nn.Linear for m in model.modules()
        )
        assert sum(m.gelu for m in packed) == (0 if model_type == "modernbert" else 2)
        torch.testing.assert_close(
            model(input_ids=ids).last_hidden_state, expected, atol=1e-5, rtol=1e-4
        )


def test_the_engine_packs_an_encoder_unless_another_feature_owns_its_matmuls(tmp_path) -> None:
    """An fp32 encoder on CPU runs its layer matmuls packed; under --deterministic (whose
    fixed-size tiles wrap torch's matmuls) they stay transformers' modules, and the vectors
    are sentence-transformers' either way."""
    import numpy as np
    from pooling_models import st_vectors, write_st_encoder

    from zllm import LLM

    path = write_st_encoder(tmp_path / "model", "bert", "mean", True)
    texts = ["the quick brown fox", "paged attention keys", "hello world"]
    expected = np.asarray(st_vectors(path, texts))
    for deterministic in (False, True):
        llm = LLM(str(path), kv_cache_memory_bytes=32 << 20, deterministic=deterministic)
        model = llm.model_runner.host.weights.model
        packed = sum(isinstance(m, PackedLinear) for m in model.modules())
        assert (packed > 0) is not deterministic
        vectors = np.asarray([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        assert ((vectors * expected).sum(1) > 0.9999).all()  # (both normalised)
