"""How a byte-level BPE GGUF file's text is cut into words before BPE, by its
`tokenizer.ggml.pre` name, as llama.cpp's vocabulary loader cuts it: each name's split patterns
(the models' own tokenizer.json patterns), applied one after the other, each to the pieces the
last one left; then the bytes as GPT-2's byte-level alphabet. Names llama.cpp reads the same way
share a row. A name not listed is refused by the caller, naming it: a guessed split gives
plausible but different ids. tests/text/test_gguf_vocabularies.py holds each row to llama.cpp's
own expected ids: its vocabulary test files, and for names it ships none for, the ids its
tokenizer gives on llama-bpe's vocabulary read with that name (recorded by
tests/text/write_pre_tokenizer_ids.py; gpt-4o's split also against tiktoken's o200k pattern).
Kimi K2's (kimi-k2) llama.cpp cuts by hand-written code, not patterns: refused. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# o200k's (and tekken's) cased words: capitals (and caseless letters, marks) then lower case.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def _llama3_like(digits: str) -> str:
    return (
        rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|{digits}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    patterns: tuple[str, ...]  # applied in order, each isolating its matches
    # BPE takes a word whole when the vocabulary has it (llama.cpp's ignore_merges).
    ignore_merges: bool = False


_LLAMA3 = PreTokenizer((_llama3_like(r"\p{N}{1,3}"),), ignore_merges=True)
_QWEN2 = PreTokenizer((_llama3_like(r"\p{N}"),))
_GPT2_ROW = PreTokenizer((_GPT2,))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))

ROWS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2),
    # Qwen3.5's: marks join their letters.
    "qwen35": PreTokenizer(
        (
            rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}"
            r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), _GPT2_ROW),
    # Every digit alone, then GPT-2's (SmolLM's, StarCoder's, Command R's).
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell"), _DIGITS_THEN_GPT2),
    "falcon": PreTokenizer(
        (
            r"[\p{P}\$\+<=>\^~\|`]+",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            "[0-9][0-9][0-9]",
        )
    ),
    # DeepSeek LLM's (code points escaped: a normalising editor would fold some into others).
    "deepseek-llm": PreTokenizer(
        (
            "[\r\n]",
            "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-"
            "\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-"
            "\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-"
            "\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
            "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-"
            "\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
            "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
            "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119"
            "-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145"
            "-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
            "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-"
            "\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-"
            "\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
            "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            "\\s+$",
            "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            "\\p{N}+",
        )
    ),
    # o200k's (GPT-4o's, tiktoken's pattern): cased words with their contractions, digits in
    # threes; Llama 4's and MiniMax-M2's files too.
    **dict.fromkeys(
        ("gpt-4o", "llama4", "minimax-m2"),
        PreTokenizer(
            (
                rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            )
        ),
    ),
    # Mistral's tekken: o200k's cased words without contractions, every digit alone.
    "tekken": PreTokenizer(
        (
            rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
    # GLM-4's: Llama 3's split (its files from GLM-4.5 on take words whole, as Llama 3's).
    "chatglm-bpe": PreTokenizer((_llama3_like(r"\p{N}{1,3}"),)),
    **dict.fromkeys(("glm4", "glm5"), _LLAMA3),
    # DeepSeek-V3's (and Kimi-less DeepSeek-R1's): digits in threes, CJK runs, then words.
    "deepseek-v3": PreTokenizer(
        (
            r"\p{N}{1,3}",
            "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    "deepseek-coder": PreTokenizer(
        (
            "[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            r"\p{N}",
        )
    ),
}


def byte_level_pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(the pre-tokenizer of a `tokenizer.ggml.pre` name, whether BPE ignores merges)."""
    row = ROWS.get(pre)
    if row is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre; zllm reads "
            f"{', '.join(sorted(ROWS))}): pass the model's Hugging Face tokenizer with --tokenizer"
        )
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in row.patterns]
    steps = [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps), row.ignore_merges
