"""How a pooling model's vectors are made (issue 61): an embeddings request's, read from the
model as sentence-transformers writes it and overridable by --pooler-config (vLLM's flag);
a classifier's labels (config.json's, or --hf-overrides' classifier tokens); which runner a
model gets; an encoder's one-step rule. No torch here.

A sentence-transformers checkpoint lists its modules in modules.json: the Transformer (the
model itself), a Pooling module (1_Pooling/config.json: which tokens' final hidden states make
the vector: the first, CLS; their mean; or the last, as decoder embedding models pool), and
optionally Normalize (the vector L2-normalised). config_sentence_transformers.json may name a
default prompt, an instruction every input is prefixed with. config.json's `is_matryoshka` /
`matryoshka_dimensions` say whether a request may ask for fewer `dimensions` (the vector's
first ones, normalised again).

A GGUF converted by llama.cpp from such a model says its pooling in `<arch>.pooling_type`.
A model without these pools by --pooling (mean) and normalises, as zllm always did.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zllm.model.arch import sequence_labels
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Feature, Trait
from zllm.model.gguf import read_gguf
from zllm.model.registry import classifier_families_text, family_for_config, family_of

if TYPE_CHECKING:
    from zllm.config.engine import EngineConfig

POOLING_TYPES = ("mean", "last", "cls")
# sentence-transformers' pooling modes (its 1_Pooling/config.json, old and new spellings)
_ST_MODES = {"mean": "mean", "mean_tokens": "mean", "lasttoken": "last", "cls": "cls",
             "cls_token": "cls"}  # fmt: skip
_ST_MODULES = ("Transformer", "Pooling", "Normalize")
# llama.cpp's pooling types (a GGUF's `<arch>.pooling_type`) that zllm runs.
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
# --pooler-config's fields (vLLM's names) that zllm reads.
_FLAG_FIELDS = ("pooling_type", "normalize")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a prompt's final hidden states become its embedding."""

    pooling: str = "mean"  # POOLING_TYPES
    normalize: bool = True
    prompt: str = ""  # prefixed to each text input (sentence-transformers' default prompt)
    # The sizes a request's `dimensions` may ask for: () none (not a Matryoshka model),
    # None any up to the hidden size, else these.
    matryoshka: tuple[int, ...] | None = ()
    source: str = "--pooling"  # where it was read, for the startup log
    # A classifier's labels (zllm/model/arch.py sequence_labels): its vector is their
    # probabilities (softmax; one label: a sigmoid score), from the last token. (): embeddings.
    labels: tuple[str, ...] = ()

    @property
    def task(self) -> str:
        """ "classify" (a sequence-classification head) or "embed"."""
        return "classify" if self.labels else "embed"

    def check_dimensions(self, dimensions: int, hidden_size: int) -> None:
        """ValueError unless a request may ask this model for `dimensions`."""
        if self.matryoshka == ():
            raise ValueError(
                "dimensions: this model's embeddings have one size (it is not a Matryoshka "
                "model: config.json has no is_matryoshka or matryoshka_dimensions)"
            )
        allowed = self.matryoshka
        if not 1 <= dimensions <= hidden_size or (
            allowed is not None and dimensions not in allowed
        ):
            sizes = f"one of {list(allowed)}" if allowed is not None else f"1 to {hidden_size}"
            raise ValueError(f"dimensions: {dimensions} is not {sizes}")

    def truncated(self, vector: list[float], dimensions: int | None) -> list[float]:
        """The vector's first `dimensions` (None: all), normalised again where the model
        normalises (a Matryoshka model's smaller embedding)."""
        if dimensions is None or dimensions >= len(vector):
            return vector
        head = vector[:dimensions]
        if not self.normalize:
            return head
        norm = math.sqrt(sum(x * x for x in head)) or 1.0
        return [x / norm for x in head]


def pooler_config_of(
    model_path: str,
    flag: str | dict | None = None,
    pooling: str | None = None,
    arch: ModelArchConfig | None = None,
) -> PoolerConfig:
    """The model's pooling: sentence-transformers' files where the model has them, else
    `pooling` (--pooling, mean by default), then --pooler-config's fields (`flag`) over it.
    A classifier's (its labels: config.json's, or `arch`'s classifier tokens) is fixed."""
    folder = Path(model_path)
    config = _read_json(folder / "config.json") if folder.is_dir() else {}
    labels = tuple(sequence_labels(folder)) if folder.is_dir() else ()
    if arch is not None and arch.classifier_tokens is not None:
        labels = tuple(f"LABEL_{i}" for i in range(arch.num_labels))
    if labels:  # a classifier: its head reads the last token's hidden state as it is
        if flag is not None or pooling is not None:
            raise ValueError(
                "--pooling and --pooler-config: a sequence-classification model's head reads "
                "its last token"
            )
        # A decoder's head reads the last token, an encoder's its [CLS] (the first).
        family = family_for_config(config)
        pooling = "cls" if family is not None and family.has(Trait.ENCODER) else "last"
        return PoolerConfig(pooling, False, source="classifier", labels=labels)
    found = _sentence_transformers(folder) if folder.is_dir() else gguf_pooling(model_path)
    if found is None:
        found = PoolerConfig(pooling=pooling or "mean")
    elif pooling is not None and pooling != found.pooling:
        found = PoolerConfig(pooling, found.normalize, found.prompt, source="--pooling")
    matryoshka: tuple[int, ...] | None = ()
    if config.get("matryoshka_dimensions"):
        matryoshka = tuple(int(d) for d in config["matryoshka_dimensions"])
    elif config.get("is_matryoshka"):
        matryoshka = None
    found = PoolerConfig(found.pooling, found.normalize, found.prompt, matryoshka, found.source)
    return _with_flag(found, flag)


# --hf-overrides' fields zllm reads (vLLM's, for a causal LM scored by some tokens' logits).
_OVERRIDE_FIELDS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")


def classifier_from_tokens(
    arch: ModelArchConfig, overrides: dict | None, tokenizer_path: str
) -> ModelArchConfig:
    """`arch` as a classifier made from its LM head (vLLM's --hf-overrides
    classifier_from_token): one label per token, or with is_original_qwen3_reranker and two
    tokens one label (the second's logit less the first's: Qwen3-Reranker's yes over no)."""
    if not overrides:
        return arch
    unknown = sorted(set(overrides) - set(_OVERRIDE_FIELDS))
    if unknown:
        raise ValueError(
            f"--hf-overrides: {', '.join(unknown)} not read (zllm reads "
            f"{', '.join(_OVERRIDE_FIELDS)})"
        )
    tokens = overrides.get("classifier_from_token")
    names = overrides.get("architectures") or []
    if not tokens or not all(str(n).endswith("ForSequenceClassification") for n in names):
        raise ValueError(
            "--hf-overrides: classifier_from_token (and a *ForSequenceClassification "
            "architecture) make a causal LM a classifier; nothing else is overridden"
        )
    from zllm.text.tokenizer import load_tokenizer

    backend = load_tokenizer(tokenizer_path).backend
    ids = [backend.token_to_id(str(t)) for t in tokens]
    if None in ids:
        raise ValueError(f"--hf-overrides: the tokenizer has no token {tokens[ids.index(None)]!r}")
    pair = bool(overrides.get("is_original_qwen3_reranker")) and len(ids) == 2
    return dataclasses.replace(arch, classifier_tokens=ids, num_labels=1 if pair else len(ids))


RUNNERS = ("auto", "generate", "pooling")
# Class names that generate (GPT-2's `GPT2LMHeadModel` ends in "Model" too): checked first.
_GENERATING_CLASSES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ChatModel")


def runner_of(requested: str, model_path: str, arch: ModelArchConfig) -> str:
    """Which runner (vLLM's --runner) the model gets: "generate" or "pooling". Auto picks
    pooling for a model that cannot generate: a checkpoint without a language-model head (a
    base model's, a classifier's), or a config.json naming base model classes only
    (`Qwen3Model`, not `GPT2LMHeadModel`). Asking a headless one to generate is refused, and
    so is a classifier of an architecture zllm's code has no score head for."""
    if arch.num_labels and not family_of(arch).supports(Feature.CLASSIFIER_HEAD):
        raise ValueError(
            f"{model_path}: a sequence-classification {arch.architecture} model: zllm runs "
            f"classifier heads on {classifier_families_text()}"
        )
    config = _read_json(Path(model_path) / "config.json") if Path(model_path).is_dir() else {}
    names = [str(a) for a in config.get("architectures") or []]
    generating = any(a.endswith(_GENERATING_CLASSES) for a in names)
    base_only = bool(names) and not generating and all(a.endswith("Model") for a in names)
    if requested == "generate" and not arch.lm_head:
        kind = "a classifier's score head" if arch.num_labels else "a base model's checkpoint"
        raise ValueError(
            f"--runner generate: {model_path} has no language-model head ({kind}): it runs "
            f"as a pooling model"
        )
    if requested == "generate" and arch.classifier_tokens is not None:
        raise ValueError("--runner generate: --hf-overrides made the model a classifier")
    if requested != "auto":
        return requested
    embedder = gguf_pooling(model_path) is not None  # (converted from an embedding model)
    return "pooling" if base_only or embedder or not arch.lm_head or arch.num_labels else "generate"


def check_encoder(config: EngineConfig) -> None:
    """An encoder model (its family's ENCODER trait) computes each prompt in one step: the step's
    token budget must hold the longest prompt; and it only pools."""
    if not family_of(config.arch).has(Trait.ENCODER):
        return
    budget, longest = config.scheduler.max_num_batched_tokens, config.scheduler.max_model_len
    if budget < longest:
        raise ValueError(
            f"--max-num-batched-tokens {budget}: an encoder model ({config.arch.architecture}) "
            f"computes each prompt in one step, up to --max-model-len {longest} tokens"
        )
    if config.runner != "pooling":
        raise ValueError(f"--runner {config.runner}: an encoder model only pools")


def context_length(model_path: str, arch: ModelArchConfig) -> int:
    """The default --max-model-len: the model's context, or for a sentence-transformers
    model the longest input sentence-transformers gives it (its max_seq_length, as vLLM
    reads it): sentence_bert_config.json's `max_seq_length` (sentence-transformers 5 and
    before), else tokenizer_config.json's `model_max_length` (where sentence-transformers 6
    keeps it), never past the model's context. all-MiniLM-L6-v2 reads 256 of its 512."""
    longest = arch.max_position_embeddings
    folder = Path(model_path)
    if not (folder / "modules.json").is_file():
        return longest
    for name, field in (("sentence_bert_config.json", "max_seq_length"),
                        ("tokenizer_config.json", "model_max_length")):  # fmt: skip
        value = _read_json(folder / name).get(field)
        if isinstance(value, int) and value > 1:
            return min(value, longest)
    return longest


def _sentence_transformers(folder: Path) -> PoolerConfig | None:
    """The pooling sentence-transformers' files describe (None: the model has none);
    ValueError naming a module or mode zllm does not run."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    pooling, normalize = None, False
    for module in _read_json(modules_file):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_MODULES:
            raise ValueError(
                f"{modules_file}: sentence-transformers module {kind} ({module.get('path')}): "
                f"zllm runs Transformer, Pooling and Normalize modules only"
            )
        if kind == "Pooling":
            pooling = _st_pooling(folder / str(module.get("path", "")) / "config.json")
        normalize |= kind == "Normalize"
    if pooling is None:
        raise ValueError(f"{modules_file}: no Pooling module (which tokens make the vector?)")
    modalities = _read_json(folder / "sentence_bert_config.json").get("modality_config") or {}
    if "message" in modalities:
        raise ValueError(
            f"{folder / 'sentence_bert_config.json'}: sentence-transformers 6 renders this "
            f"model's text inputs through its chat template (modality_config 'message'); zllm "
            f"embeds text as text, as the files sentence-transformers 5 and before wrote"
        )
    st_config = _read_json(folder / "config_sentence_transformers.json")
    prompt_name = st_config.get("default_prompt_name")
    prompt = (st_config.get("prompts") or {}).get(prompt_name, "") if prompt_name else ""
    return PoolerConfig(pooling, normalize, prompt, source="sentence-transformers")


def gguf_pooling(model_path: str) -> PoolerConfig | None:
    """A GGUF's pooling: llama.cpp's converter writes `<arch>.pooling_type` from an embedding
    model's sentence-transformers Pooling module (llama.h's llama_pooling_type: 1 mean, 2 cls,
    3 last). Normalised, as llama-server's embeddings are by default. None: not a GGUF, or
    one without the field (a generating model's)."""
    if not model_path.endswith(".gguf") or not Path(model_path).is_file():
        return None
    metadata = read_gguf(model_path).metadata
    key = f"{metadata.get('general.architecture')}.pooling_type"
    value = metadata.get(key)
    if value is None or value == 0:  # (0: none, the tokens' own states)
        return None
    if value not in _GGUF_POOLING:
        kind = " (rank: a reranker's head, which zllm reads from HF checkpoints only)" if value == 4 else ""  # fmt: skip
        raise ValueError(
            f"{model_path}: {key} {value}{kind}: zllm pools a GGUF by mean (1), cls (2) or last (3)"
        )
    return PoolerConfig(_GGUF_POOLING[value], True, source=key)


def _st_pooling(path: Path) -> str:
    """1_Pooling/config.json's mode as POOLING_TYPES: `pooling_mode` (sentence-transformers
    5+) or the `pooling_mode_<mode>` booleans before it."""
    config = _read_json(path)
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_") and v]  # fmt: skip
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{path}: pooling {modes}: zllm pools by one of cls, mean or lasttoken")
    pooling = _ST_MODES[modes[0]]
    if pooling == "mean" and config.get("include_prompt") is False:
        raise ValueError(
            f"{path}: mean pooling without the prompt's tokens (include_prompt false) is not "
            f"run by zllm"
        )
    return pooling


def _with_flag(found: PoolerConfig, flag: str | dict | None) -> PoolerConfig:
    """--pooler-config (a JSON object, vLLM's field names) over what the model says."""
    if flag is None:
        return found
    try:
        fields: Any = json.loads(flag) if isinstance(flag, str) else dict(flag)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--pooler-config: not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ValueError('--pooler-config: a JSON object, e.g. \'{"pooling_type": "LAST"}\'')
    unknown = sorted(set(fields) - set(_FLAG_FIELDS))
    if unknown:
        raise ValueError(
            f"--pooler-config: {', '.join(unknown)} not read (zllm reads {', '.join(_FLAG_FIELDS)})"
        )
    pooling = str(fields.get("pooling_type", found.pooling)).lower()
    if pooling not in POOLING_TYPES:
        raise ValueError(
            f"--pooler-config: pooling_type {fields['pooling_type']!r} is not one of "
            f"{', '.join(t.upper() for t in POOLING_TYPES)}"
        )
    normalize = fields.get("normalize", found.normalize)
    if not isinstance(normalize, bool):
        raise ValueError(f"--pooler-config: normalize must be true or false, got {normalize!r}")
    return PoolerConfig(pooling, normalize, found.prompt, found.matryoshka, "--pooler-config")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
