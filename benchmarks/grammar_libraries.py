"""Grammar libraries for structured outputs, measured on SmolLM2's tokenizer (issue 15).

    PYTHONPATH=<dir with xgrammar, apache-tvm-ffi, outlines-core installed --no-deps> \
        python benchmarks/grammar_libraries.py

For llguidance (zllm's choice), xgrammar and outlines-core: the import (and whether it
brings torch), building the tokenizer view, compiling a nested JSON schema and a regex, and
the time of one next-token mask while walking a valid answer token by token. Prints one
markdown table row per library and grammar; BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 30},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "owner": {
            "type": "object",
            "properties": {"email": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["email"],
        },
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["id", "name", "tags", "owner"],
}
ANSWER = json.dumps(
    {
        "id": 42,
        "name": "Ada Lovelace",
        "tags": ["a", "c"],
        "owner": {"email": "ada@x.org"},
        "score": 0.5,
    },
    separators=(",", ":"),
)
REGEX = r"[a-z]{3,10}@[a-z]{2,8}\.(com|org|net)"
REGEX_ANSWER = "lovelace@analytic.org"


def tokenizer_json() -> tuple[str, int, int]:
    from zllm.model.files import resolve_model
    from zllm.text.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("smollm2"))
    return tok.backend.to_str(), tok.vocab_size, tok.eos_token_id


def import_cost(module: str) -> tuple[float, bool]:
    code = (
        f"import sys,time; t=time.perf_counter(); import {module}; "
        "print(time.perf_counter()-t, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, torch = out.stdout.split()
    return float(seconds), torch == "True"


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1000


def walk(mask, advance, tokens) -> float:
    """Median microseconds of one next-token mask along `tokens`."""
    times = []
    for t in tokens:
        start = time.perf_counter()
        mask()
        times.append((time.perf_counter() - start) * 1e6)
        advance(t)
    return statistics.median(times)


def llguidance_rows(spec: str, vocab: int, eos: int, encode) -> list[tuple]:
    import numpy as np
    from llguidance import LLMatcher, LLTokenizer

    tok, t_tok = timed(lambda: LLTokenizer(spec, n_vocab=vocab, eos_token=eos))
    rows = []
    for label, grammar, answer in (
        ("JSON schema", LLMatcher.grammar_from_json_schema(SCHEMA), ANSWER),
        ("regex", LLMatcher.grammar_from_regex(REGEX), REGEX_ANSWER),
    ):
        m, t_compile = timed(lambda g=grammar: LLMatcher(tok, g, log_level=0))
        row = np.zeros((vocab + 31) // 32, dtype=np.int32)
        us = walk(
            lambda m=m, row=row: m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes),
            m.consume_token,
            encode(answer),
        )
        rows.append(("llguidance", label, t_tok, t_compile, us))
    return rows


def xgrammar_rows(spec: str, vocab: int, eos: int, encode) -> list[tuple]:
    import xgrammar as xgr
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec))
    info, t_tok = timed(
        lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    rows = []
    for label, compile_, answer in (
        ("JSON schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA)), ANSWER),
        ("regex", lambda: compiler.compile_regex(REGEX), REGEX_ANSWER),
    ):
        compiled, t_compile = timed(compile_)
        m = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        us = walk(
            lambda m=m, b=bitmask: m.fill_next_token_bitmask(b), m.accept_token, encode(answer)
        )
        rows.append(("xgrammar", label, t_tok, t_compile, us))
    return rows


def outlines_rows(spec: str, vocab: int, eos: int, encode) -> list[tuple]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import Tokenizer

    tk = Tokenizer.from_str(spec)

    def build_vocab():
        ids: dict[str, list[int]] = {}
        for i in range(tk.get_vocab_size()):
            if i == eos:
                continue
            text = tk.decode([i])
            if text:
                ids.setdefault(text, []).append(i)
        return Vocabulary(eos, ids)

    vocabulary, t_tok = timed(build_vocab)
    rows = []
    for label, regex, answer in (
        ("JSON schema", build_regex_from_schema(json.dumps(SCHEMA)), ANSWER),
        ("regex", REGEX, REGEX_ANSWER),
    ):
        index, t_compile = timed(lambda r=regex: Index(r, vocabulary))
        guide = Guide(index)
        us = walk(guide.get_tokens, guide.advance, encode(answer))
        rows.append(("outlines-core", label, t_tok, t_compile, us))
    return rows


def main() -> None:
    spec, vocab, eos = tokenizer_json()
    from tokenizers import Tokenizer

    tk = Tokenizer.from_str(spec)

    def encode(text: str) -> list[int]:
        return tk.encode(text, add_special_tokens=False).ids

    print("| library | import s | imports torch |")
    print("|---|---|---|")
    for module, name in (
        ("llguidance", "llguidance"),
        ("xgrammar", "xgrammar"),
        ("outlines_core", "outlines-core"),
    ):
        try:
            seconds, torch = import_cost(module)
            print(f"| {name} | {seconds:.2f} | {torch} |")
        except subprocess.CalledProcessError as e:
            print(f"| {name} | import failed: {e.stderr.strip().splitlines()[-1]} | |")
    print()
    print("| library | grammar | tokenizer view ms | compile ms | mask us (median) |")
    print("|---|---|---|---|---|")
    for rows_of in (llguidance_rows, xgrammar_rows, outlines_rows):
        try:
            rows = rows_of(spec, vocab, eos, encode)
        except Exception as e:  # noqa: BLE001 - a library that fails is reported, not fatal
            print(f"| {rows_of.__name__[:-5]} | failed: {e!r} | | | |")
            continue
        for lib, label, t_tok, t_compile, us in rows:
            print(f"| {lib} | {label} | {t_tok:.0f} | {t_compile:.1f} | {us:.1f} |")


if __name__ == "__main__":
    main()
