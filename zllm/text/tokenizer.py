"""Text <-> token ids and chat templates, on the `tokenizers` library alone.

A GGUF file carries no tokenizer.json, only the vocabulary, merges and flags as metadata, so
for GGUF models the `tokenizers.Tokenizer` is assembled here from those pieces. Hugging Face
directories already have a tokenizer.json and are loaded as-is.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from zllm.model.files import registry_entry_of
from zllm.model.gguf import read_gguf
from zllm.text.continue_final import leave_final_message_open
from zllm.text.gguf_pre_tokenizers import (
    RAW_UTF8_ROWS,
    RAW_UTF8_SPLIT,
    byte_level_pre_tokenizer,
)


class Tokenizer:
    """A tokenizers.Tokenizer plus what serving needs beside it: BOS/EOS and the chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """A text pair as one sequence, the tokenizer's pair template around it (BERT's
        [CLS] a [SEP] b [SEP]; a decoder's tokenizer, the two one after the other): what a
        cross-encoder scores."""
        return self.backend.encode(first, second, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render the model's (or the given) chat template; `extra` (tools, documents, ...)
        reaches it as-is. `continue_final_message`: the last message is left open for the
        model to continue (zllm/text/continue_final.py); no generation prompt then."""
        template = chat_template or self._chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass one with chat_template=")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true."
            )
        rendered = render_chat_template(
            template,
            messages,
            add_generation_prompt,
            bos_token=self._token_text(self._bos_token_id),
            eos_token=self._token_text(self._eos_token_id),
            **extra,
        )
        if continue_final_message:
            return leave_final_message_open(rendered, messages)
        return rendered

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_text(self, token_id: int) -> str | None:
        """The token's text (its vocabulary entry), None for an id the vocabulary lacks."""
        return self.backend.id_to_token(token_id)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def load_tokenizer(model_path: str, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a .gguf file or HF directory; `chat_template` replaces the model's."""
    if os.path.isdir(model_path):
        tokenizer = _from_hf_dir(Path(model_path))
    else:
        tokenizer = _from_gguf(model_path)
        entry = registry_entry_of(model_path)
        if tokenizer.chat_template is None and entry is not None:
            tokenizer._chat_template = entry.chat_template  # e.g. Gemma 3 270M's
    if chat_template is not None:
        tokenizer._chat_template = chat_template
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; chat templates expect neither.
    # (GLM's and MiniMax's templates pass ensure_ascii themselves.)
    kwargs.setdefault("ensure_ascii", False)
    return json.dumps(value, indent=indent, **kwargs)


@lru_cache(maxsize=16)
def _compile(source: str) -> Template:
    # Sandboxed because templates come with downloaded models. trim/lstrip match what
    # Hugging Face renders with, which is what template authors test against.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat_template(
    template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any
) -> str:
    """A chat template's text for `messages`; `extra` (bos_token, tools, ...) reaches it
    as-is."""
    return _compile(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **extra
    )


def compiled_templates() -> tuple[int, int]:
    """This process's compiled chat templates kept, and how many may be (for /metrics)."""
    info = _compile.cache_info()
    return info.currsize, info.maxsize or 0


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def _from_hf_dir(directory: Path) -> Tokenizer:
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ValueError(f"{directory} has no tokenizer.json (slow tokenizers are not supported)")
    backend = BackendTokenizer.from_file(str(tokenizer_json))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}

    def token_id(key: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # a serialized AddedToken
            token = token.get("content")
        return backend.token_to_id(token) if isinstance(token, str) else None

    # The separate .jinja file is the newer home of the template and wins when both exist.
    template_file = directory / "chat_template.jinja"
    template = config.get("chat_template")
    if template_file.is_file():
        template = template_file.read_text()
    elif isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return Tokenizer(backend, token_id("bos_token"), token_id("eos_token"), template)


# ---------------------------------------------------------------------------------------------
# GGUF

# llama.cpp's token_type values.
_CONTROL, _USER_DEFINED = 3, 4


def _from_gguf(path: str) -> Tokenizer:
    md = read_gguf(path).metadata
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{path} has no tokenizer (tokenizer.ggml.tokens is missing)")
    pre = md.get("tokenizer.ggml.pre") or "gpt-2"  # (no name: GPT-2's, as llama.cpp reads it)
    if kind == "gemma4" or (kind == "gpt2" and pre in RAW_UTF8_ROWS):
        # (Gemma 4's tokenizer model is its pre-tokenizer, whatever the file names)
        backend, add_bos = _raw_utf8_bpe(md, tokens, "gemma4" if kind == "gemma4" else pre)
    elif kind == "gpt2":
        backend, add_bos = _byte_level_bpe(md, tokens, pre)
    elif kind == "whitespace":
        backend, add_bos = _whitespace_bpe(md, tokens), _add_bos(md, default=False)
    elif kind == "llama":
        backend, add_bos = _sentencepiece_bpe(md, tokens), _add_bos(md, default=True)
    else:
        raise ValueError(
            f"{path}: unsupported tokenizer model {kind!r} (zllm reads gpt2, llama, gemma4, "
            "whitespace)"
        )
    _add_special_tokens(backend, tokens, _per_token(md, "tokenizer.ggml.token_type", tokens, 1))
    bos, eos = _token_id(md, "bos", tokens), _token_id(md, "eos", tokens)
    add_bos = add_bos and bos is not None
    add_eos = md.get("tokenizer.ggml.add_eos_token", False) and eos is not None
    backend.post_processor = _template_processor(
        (tokens[bos], bos) if add_bos else None, (tokens[eos], eos) if add_eos else None
    )
    return Tokenizer(backend, bos, eos, md.get("tokenizer.chat_template"))


def _per_token(md: dict[str, Any], key: str, tokens: list[str], default: Any) -> list[Any]:
    values = md.get(key)
    if values is None:
        return [default] * len(tokens)
    if len(values) != len(tokens):
        raise ValueError(f"GGUF {key} has {len(values)} entries for {len(tokens)} tokens")
    return values


def _token_id(md: dict[str, Any], name: str, tokens: list[str]) -> int | None:
    token_id = md.get(f"tokenizer.ggml.{name}_token_id")
    if token_id is not None and not 0 <= token_id < len(tokens):
        raise ValueError(
            f"GGUF {name} token id {token_id} is outside the {len(tokens)}-token vocab"
        )
    return token_id


def _add_bos(md: dict[str, Any], default: bool) -> bool:
    """Whether a BOS starts the text: the file's flag, else what llama.cpp does for its kind."""
    return bool(md.get("tokenizer.ggml.add_bos_token", default))


def _merges(md: dict[str, Any]) -> list[tuple[str, str]]:
    """'left right' entries cut at the first space after the first character, as llama.cpp
    cuts them (a left piece may be a space itself)."""
    pairs = []
    for merge in md.get("tokenizer.ggml.merges") or []:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ValueError("GGUF tokenizer.ggml.merges has an entry that is not 'left right'")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def _bpe(md: dict[str, Any], tokens: list[str], **options: bool) -> BackendTokenizer:
    """A BPE model over the file's vocabulary and merges (`options`: models.BPE's flags)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    return BackendTokenizer(models.BPE(vocab, _merges(md), **options))


def _byte_level_bpe(
    md: dict[str, Any], tokens: list[str], pre: str
) -> tuple[BackendTokenizer, bool]:
    pre_tokenizer, row = byte_level_pre_tokenizer(pre)
    backend = _bpe(md, tokens, ignore_merges=row.ignore_merges)
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend, _add_bos(md, default=row.add_bos)


def _raw_utf8_bpe(md: dict[str, Any], tokens: list[str], pre: str) -> tuple[BackendTokenizer, bool]:
    """BPE over raw UTF-8 (Gemma 4's vocabulary, Sarvam's): spaces as '▁', the text cut only
    between newline runs and the rest, <0xNN> tokens for bytes missing from the vocabulary.
    (llama.cpp takes a run of newlines whole where Gemma 4's vocabulary has it; that
    vocabulary's merges build those runs first, so BPE gives the same token.)"""
    backend = _bpe(md, tokens, byte_fallback=True)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(RAW_UTF8_SPLIT), behavior="isolated")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps)
    return backend, RAW_UTF8_ROWS[pre].always_bos or _add_bos(md, default=False)


def _whitespace_bpe(md: dict[str, Any], tokens: list[str]) -> BackendTokenizer:
    """llama.cpp's `whitespace` tokenizer model (Jina's Chinese embedders): the words between
    whitespace (dropped), lower-cased where the file says, BPE over raw UTF-8 in each."""
    backend = _bpe(md, tokens, byte_fallback=True)
    if md.get("tokenizer.ggml.normalizer.lowercase", False):
        backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return backend


def _sentencepiece_bpe(md: dict[str, Any], tokens: list[str]) -> BackendTokenizer:
    """SentencePiece BPE: '▁' for spaces, <0xNN> tokens for bytes missing from the vocabulary."""
    vocab = {token: i for i, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in md:
        merges = _merges(md)
    else:
        merges = _merges_from_scores(tokens, _per_token(md, "tokenizer.ggml.scores", tokens, 0.0))
    unk_id = _token_id(md, "unknown", tokens) or 0
    model = models.BPE(vocab, merges, unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True)
    backend = BackendTokenizer(model)
    prefix = md.get("tokenizer.ggml.add_space_prefix", True)
    # Spaces as '▁', and (as llama.cpp) one '▁' before every piece of text between special
    # tokens, even one that starts with a space: " Hello" is "▁▁Hello" (Metaspace's prepend
    # skips text already starting with '▁').
    steps = [normalizers.Prepend("▁")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges the pair whose result scores highest; BPE wants a ranked list.

    Every way to cut a token into two vocabulary entries is a merge producing it, ranked by the
    token's score (best first); ties go to the longer left piece, then the lower ids.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (<|im_start|>) and user-defined ones (<think>) match whole in text;
    only control tokens are special, i.e. dropped by decode(skip_special_tokens=True)."""
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _template_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    def sequence(piece: str, type_id: int) -> list[str]:
        head = [f"{bos[0]}:{type_id}"] if bos else []
        tail = [f"{eos[0]}:{type_id}"] if eos else []
        return [*head, f"{piece}:{type_id}", *tail]

    return processors.TemplateProcessing(
        single=sequence("$A", 0),
        pair=sequence("$A", 0) + sequence("$B", 1),
        special_tokens=[t for t in (bos, eos) if t],
    )
