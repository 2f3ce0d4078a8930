"""Every model family in the registry (zllm/model/registry.py's FAMILIES) against transformers.

For each family, its row in tests/family_cases.py writes a tiny random model from transformers'
own config class of the real architecture; zllm.LLM runs it as a Hugging Face directory and,
where llama.cpp's converter writes the architecture, as the GGUF file the converter writes of
that same directory (F32: every weight as the checkpoint has it). One batch of three prompts,
12 greedy tokens each: the tokens equal transformers' forward on the directory (tests/parity.py,
its near-tie rule). Families on the transformers backend count too (LLaVA: a text prompt); the
encoders pool rather than generate: their embeddings equal sentence-transformers'.

A family registered without a row fails here, and so does a family that reads GGUF files
(gguf_architectures) whose row has no GGUF form and does not say why, and one whose model class
or image encoder does not import by the name it gives. The models are built
once per module, on first use; the GGUF forms the run selects are converted in one converter
process (llama_cpp_convert.convert_many).
"""

from __future__ import annotations

import importlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from family_cases import CASES, FamilyCase
from llama_cpp_convert import convert_many
from parity import assert_greedy_parity, hf_greedy
from pooling_models import assert_same_vectors, st_vectors

from zllm import LLM, SamplingParams
from zllm.model.family import Family, Trait
from zllm.model.gguf import read_gguf
from zllm.model.registry import FAMILIES, TRANSFORMERS, family_named

# Past the windows of gpt-oss, Gemma 3 and Phi-3 here (8), and Phi-3's pretraining context (32).
PROMPT_LENGTHS = [40, 45, 52]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "def add(a, b): return a + b"]
HF, GGUF = "hf", "gguf"


def cases_of(family: Family) -> list[str]:
    """The rows a family runs: its own (by its name) and any second case of it (a row whose
    `family` names it: DeepSeek-V3 under deepseek_v2)."""
    return [family.name] + [n for n, c in CASES.items() if c.family == family.name]


def forms_of(name: str) -> list[str]:
    """The forms a row runs here: its directory, and the converter's file where the row has
    one (a family without a row still gets its directory's case, which fails naming it)."""
    case = CASES.get(name)
    return [HF, GGUF] if case is not None and case.gguf_outtype else [HF]


FORMS = [
    pytest.param(name, form, id=f"{name}-{form}")
    for f in FAMILIES
    for name in cases_of(f)
    for form in forms_of(name)
]


def row_of(name: str) -> FamilyCase:
    case = CASES.get(name)
    assert case is not None, f"family {name!r} has no row in tests/family_cases.py"
    return case


# ---------------------------------------------------------------------------------------------
# The rows


def test_every_registered_family_has_a_row() -> None:
    registered = [f.name for f in FAMILIES]
    missing = [name for name in registered if name not in CASES]
    assert not missing, f"add a row to tests/family_cases.py for each of {missing}"
    stale = [name for name, case in CASES.items() if (case.family or name) not in registered]
    assert not stale, f"rows for families the registry does not list: {stale}"


def test_a_family_that_reads_gguf_files_has_its_gguf_form() -> None:
    """Where the family names GGUF architectures, its row converts its model to GGUF, or says
    why llama.cpp's converter cannot write it; a row without them has no GGUF form."""
    for family in FAMILIES:
        case = row_of(family.name)
        if family.gguf_architectures:
            assert case.gguf_outtype or case.no_gguf, (
                f"{family.name} reads GGUF files {family.gguf_architectures}: give its row in "
                f"tests/family_cases.py a gguf_outtype, or no_gguf saying why the converter "
                f"cannot write it"
            )
        else:
            assert not case.gguf_outtype, f"{family.name} reads no GGUF files"


def test_the_code_each_family_names_imports() -> None:
    """Its model class and its image encoder, by the "module:Class" the family gives (the
    executor imports them by that name only when it builds the model)."""
    for family in (*FAMILIES, TRANSFORMERS):
        named = [family.model_class] + ([family.images.encoder] if family.images else [])
        for where in named:
            module, _, name = where.partition(":")
            try:
                found = getattr(importlib.import_module(module), name, None)
            except ImportError as e:
                raise AssertionError(f"{family.name}: {where}: {e}") from None
            assert isinstance(found, type), f"{family.name}: {where} names no class"


# ---------------------------------------------------------------------------------------------
# The models, built once


@dataclass
class Models:
    """Each family's directory and GGUF file, and transformers' model of it, on first use."""

    root: Path
    wanted_gguf: list[str]  # the families whose GGUF form this run selects
    dirs: dict[str, Path] = field(default_factory=dict)
    ggufs: dict[str, Path] = field(default_factory=dict)
    references: dict[str, Any] = field(default_factory=dict)

    def directory(self, name: str, request: pytest.FixtureRequest) -> Path:
        if name not in self.dirs:
            case = row_of(name)
            fixtures = {f: request.getfixturevalue(f) for f in case.fixtures}
            self.dirs[name] = case.write(self.root / name, **fixtures)
        return self.dirs[name]

    def gguf(self, name: str, request: pytest.FixtureRequest) -> Path:
        """The converter's file; every selected family's converted at the first ask."""
        if name not in self.ggufs:
            names = [n for n in dict.fromkeys([name, *self.wanted_gguf]) if n not in self.ggufs]
            jobs = [
                (self.directory(n, request), self.root / f"{n}.gguf", str(row_of(n).gguf_outtype))
                for n in names
            ]
            convert_many(jobs)
            self.ggufs.update({n: out for n, (_, out, _) in zip(names, jobs, strict=True)})
        return self.ggufs[name]

    def reference(self, name: str, request: pytest.FixtureRequest):
        """transformers' model of the family's directory (a vision-language model's whole)."""
        if name not in self.references:
            import transformers

            path = self.directory(name, request)
            vision = "vision_config" in json.loads((path / "config.json").read_text())
            auto = (
                transformers.AutoModelForImageTextToText
                if vision
                else transformers.AutoModelForCausalLM
            )
            self.references[name] = auto.from_pretrained(path).eval()
        return self.references[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory, request) -> Models:
    here = Path(__file__)
    wanted = [
        item.callspec.params["family"]
        for item in request.session.items
        if item.path == here
        and getattr(item, "callspec", None) is not None
        and item.callspec.params.get("form") == GGUF
    ]
    return Models(tmp_path_factory.mktemp("families"), list(dict.fromkeys(wanted)))


# ---------------------------------------------------------------------------------------------
# Parity


def prompts_of(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize(("family", "form"), FORMS)
def test_the_family_answers_as_transformers(models, request, family: str, form: str) -> None:
    """`family`: the row's name (a family's, or a second case of one)."""
    case = row_of(family)
    described = family_named(case.family or family)
    path = models.directory(family, request) if form == HF else models.gguf(family, request)
    if form == GGUF:
        architecture = read_gguf(str(path)).metadata["general.architecture"]
        assert architecture in described.gguf_architectures
    if described.has(Trait.ENCODER):
        assert_embeds_as_sentence_transformers(path, described)
        return
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, max_num_seqs=4, block_size=4)
    assert (llm.config.arch.family, llm.config.model_impl) == (described.name, described.code)
    prompts = prompts_of(case.prompt_vocab)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    hf = models.reference(family, request)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ours = list(out.outputs[0].token_ids)
        label = f"{family}-{form}[{i}]"
        assert len(set(ours)) > 2, f"{label}: a degenerate output proves little: {ours}"
        assert_greedy_parity(hf, prompt, ours, hf_greedy(hf, prompt, len(ours)), label=label)


def assert_embeds_as_sentence_transformers(path: Path, family: Family) -> None:
    """An encoder's vectors equal sentence-transformers' encode on the same model (the
    tolerance of tests/executor/test_pooling_models.py)."""
    llm = LLM(str(path), kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=256)
    assert (llm.config.arch.family, llm.config.model_impl) == (family.name, family.code)
    assert llm.config.runner == "pooling"
    ours = [out.outputs.embedding for out in llm.embed(TEXTS, use_tqdm=False)]
    assert_same_vectors(ours, st_vectors(path, TEXTS))
