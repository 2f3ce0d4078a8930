"""DeepSeek-V3 (and Kimi K2, its architecture under another model_type) in the deepseek_v2
family: its router (sigmoid scores, the choice corrected by a per-expert bias, groups ranked by
their two best scores, renormalised, times routed_scaling_factor), its config keys and their
GGUF forms, the multi-token-prediction layer its checkpoints append (skipped), rope_interleave
false, and what it refuses. Parity of the family row's model (HF directory and the converter's
GGUF) is tests/executor/models/test_families.py's `deepseek_v3` case; this runs that model."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from family_cases import CASES, DEEPSEEK_V3, corrected_with_mtp
from llama_cpp_convert import SPM_VOCAB_SIZE, convert_hf_to_gguf
from parity import assert_greedy_parity, hf_greedy
from safetensors.torch import load_file

from zllm import LLM, SamplingParams
from zllm.executor.layers.moe.router import SIGMOID_BIAS_TOPK, deepseek_rule, route
from zllm.executor.weights.loader import load_weights
from zllm.model.arch import read_arch_config
from zllm.model.gguf import read_gguf

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, SPM_VOCAB_SIZE) for _ in range(n)] for n in (9, 23, 41)]


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    return CASES["deepseek_v3"].write(tmp_path_factory.mktemp("v3") / "hf")


@pytest.fixture(scope="module")
def v3_gguf(v3_dir, tmp_path_factory):
    return convert_hf_to_gguf(v3_dir, tmp_path_factory.mktemp("v3-gguf") / "v3.gguf", "f32")


def generate(path, prompts=PROMPTS) -> list[list[int]]:
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def check_parity(directory, prompts, outputs, label: str) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    for i, (prompt, ours) in enumerate(zip(prompts, outputs, strict=True)):
        assert len(set(ours)) > 2, f"{label}[{i}]: a degenerate output: {ours}"
        theirs = hf_greedy(hf, prompt, len(ours))
        assert_greedy_parity(hf, prompt, ours, theirs, label=f"{label}[{i}]")


def test_config_json_and_the_gguf_file_read_as_v3s_router(v3_dir, v3_gguf) -> None:
    arch = read_arch_config(str(v3_dir))
    moe = arch.moe
    assert arch.family == "deepseek_v2" and arch.architecture == "deepseek_v3"
    assert moe.sigmoid_scores and moe.norm_topk_prob and moe.routed_scaling_factor == 2.5
    assert (moe.expert_group_count, moe.expert_groups_used) == (4, 2)
    assert arch.num_layers == DEEPSEEK_V3["num_hidden_layers"]  # not the MTP layer
    assert arch.mla.rope_interleave
    rule = deepseek_rule(arch)
    assert (rule.router, rule.group_count, rule.groups_used) == (SIGMOID_BIAS_TOPK, 4, 2)
    gguf = read_gguf(str(v3_gguf))
    assert gguf.metadata["deepseek2.expert_gating_func"] == 2  # llama.cpp's sigmoid
    assert "blk.1.exp_probs_b.bias" in gguf.tensors
    assert read_arch_config(str(v3_gguf)).moe == moe  # every expert field


def test_the_correction_bias_loads_and_changes_the_choice(v3_dir, v3_gguf) -> None:
    """Each form's loaded e_score_correction_bias is the checkpoint's, and it moves some
    token's experts (so the parity test would see it missing)."""
    stored = load_file(str(next(v3_dir.glob("*.safetensors"))))
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    bias = stored[name]
    assert bias.abs().sum() > 0
    for path in (v3_dir, v3_gguf):
        loaded = dict(load_weights(str(path), read_arch_config(str(path))))
        assert torch.equal(loaded[name], bias)  # (a GGUF file: its exp_probs_b.bias)
    arch = read_arch_config(str(v3_dir))
    logits = torch.randn(256, arch.moe.num_experts, generator=torch.Generator().manual_seed(0))
    with_bias = route(logits, 2, deepseek_rule(arch), bias)[1]
    without = route(logits, 2, deepseek_rule(arch), torch.zeros_like(bias))[1]
    assert not torch.equal(with_bias, without)


def test_the_mtp_layer_is_in_the_checkpoint_and_skipped(v3_dir) -> None:
    """The checkpoint appends layer num_hidden_layers (the MTP block) as DeepSeek-V3's do;
    the model loads without it and answers as transformers (which also skips it)."""
    stored = load_file(str(next(v3_dir.glob("*.safetensors"))))
    mtp = f"model.layers.{DEEPSEEK_V3['num_hidden_layers']}."
    assert f"{mtp}eh_proj.weight" in stored and f"{mtp}mlp.gate.weight" in stored
    check_parity(v3_dir, PROMPTS, generate(v3_dir), "v3")


def test_kimi_k2s_model_type_reads_as_deepseek_v3(v3_dir, tmp_path) -> None:
    """Kimi K2 ships DeepSeek-V3's architecture under model_type kimi_k2."""
    kimi = tmp_path / "kimi"
    shutil.copytree(v3_dir, kimi)
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps(config | {"model_type": "kimi_k2"}))
    theirs, ours = read_arch_config(str(v3_dir)), read_arch_config(str(kimi))
    assert ours.architecture == "kimi_k2" and ours.family == "deepseek_v2"
    assert (ours.moe, ours.mla, ours.rope_scaling) == (theirs.moe, theirs.mla, theirs.rope_scaling)


def test_rope_as_two_halves_answers_as_transformers(tmp_path) -> None:
    """A config with rope_interleave false rotates the rope dims as Llama's two halves."""
    directory = corrected_with_mtp("deepseek_v3", **dict(DEEPSEEK_V3, rope_interleave=False))(
        tmp_path / "halves"
    )
    assert not read_arch_config(str(directory)).mla.rope_interleave
    check_parity(directory, PROMPTS[:2], generate(directory, PROMPTS[:2]), "halves")


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"model_type": "deepseek_v32", "index_topk": 2048, "index_n_heads": 64},
         "DeepSeek-V3.2's sparse-attention indexer"),
        ({"scoring_func": "sigmoid", "topk_method": "greedy"},
         "scoring_func 'sigmoid' with topk_method 'greedy'"),
        ({"scoring_func": "softmax", "topk_method": "noaux_tc"},
         "scoring_func 'softmax' with topk_method 'noaux_tc'"),
    ],
)  # fmt: skip
def test_what_it_does_not_run_is_refused_naming_it(v3_dir, tmp_path, change, refusal) -> None:
    changed = tmp_path / "changed"
    changed.mkdir()
    config = json.loads((v3_dir / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=refusal):
        read_arch_config(str(changed))


@pytest.mark.e2e
def test_served_answers_as_transformers(v3_dir, engine_pool, tmp_path) -> None:
    """Token-id prompts through `zllm serve`: transformers' greedy tokens."""
    with engine_pool.serve(str(v3_dir), tmp_path / "server.log", "--block-size", "4") as server:
        model = server.get("/v1/models").json()["data"][0]["id"]
        body = dict(model=model, max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
        body |= dict(return_tokens_as_token_ids=True, prompt=PROMPTS[:2])
        answer = server.post("/v1/completions", body).json()
    assert "choices" in answer, answer
    outputs = [
        [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        for choice in sorted(answer["choices"], key=lambda c: c["index"])
    ]
    check_parity(v3_dir, PROMPTS[:2], outputs, "served")
