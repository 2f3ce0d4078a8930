"""OLMo 2 and OLMo 3 in zllm's own code (executor/models/olmo2.py): OLMo 3's layer kinds and
window from config.json and from llama.cpp's converter's file alike, RoPE scaling on the full
layers only (as transformers gives it), and what the family refuses. Parity of the rows'
models (both forms) is tests/executor/models/test_families.py's `olmo2` and `olmo3` cases."""

from __future__ import annotations

import json
import random

import pytest
from family_cases import CASES, convertible
from llama_cpp_convert import SPM_VOCAB_SIZE, convert_hf_to_gguf
from parity import assert_greedy_parity, hf_greedy

from zllm import LLM, SamplingParams
from zllm.config.engine_args import EngineArgs
from zllm.model.arch import read_arch_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, SPM_VOCAB_SIZE) for _ in range(n)] for n in (30, 57)]
OLMO3 = dict(num_hidden_layers=4, sliding_window=8, pad_token_id=None)


@pytest.fixture(scope="module")
def olmo3_dir(tmp_path_factory):
    return CASES["olmo3"].write(tmp_path_factory.mktemp("olmo3") / "hf")


def test_layer_kinds_and_window_read_alike_from_both_forms(olmo3_dir, tmp_path) -> None:
    arch = read_arch_config(str(olmo3_dir))
    assert arch.family == "olmo2" and arch.architecture == "olmo3"
    assert arch.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert arch.sliding_window == 8 and arch.qk_norm_whole and not arch.qk_norm
    gguf = read_arch_config(str(convert_hf_to_gguf(olmo3_dir, tmp_path / "o.gguf", "f32")))
    assert (gguf.family, gguf.layer_types, gguf.sliding_window) == (
        "olmo2",
        arch.layer_types,
        arch.sliding_window,
    )


def test_rope_scaling_turns_the_full_layers_only(tmp_path) -> None:
    """A linear scaling of 4 in rope_parameters.full_attention: the full layer rotates by the
    scaled table, the sliding ones by the plain one; greedy tokens equal transformers'."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    path = convertible("olmo3", rope_parameters=rope, **OLMO3)(tmp_path / "scaled")
    arch = read_arch_config(str(path))
    assert arch.rope_scaling["rope_type"] == "linear" and arch.rope_scaling["factor"] == 4.0
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        ours = list(out.outputs[0].token_ids)
        assert len(set(ours)) > 2, ours
        assert_greedy_parity(hf, prompt, ours, hf_greedy(hf, prompt, len(ours)), label=str(i))


def test_other_sliding_rope_parameters_are_refused(olmo3_dir, tmp_path) -> None:
    config = json.loads((olmo3_dir / "config.json").read_text())
    config["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0}
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_parameters.sliding_attention"):
        read_arch_config(str(changed))


def test_tensor_ranks_are_refused_naming_the_family(olmo3_dir) -> None:
    args = EngineArgs(model=str(olmo3_dir), tensor_parallel_size=2)
    with pytest.raises(ValueError) as refused:
        args.create_engine_config()
    assert "its q/k norms span every head" in str(refused.value)
    assert "(the OLMo 2/3 family (olmo2) has no tensor parallelism)" in str(refused.value)
