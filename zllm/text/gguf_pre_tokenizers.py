r"""How a byte-level BPE GGUF file's text is cut into words before BPE, by its
`tokenizer.ggml.pre` name, as llama.cpp's vocabulary loader cuts it: each name's split patterns
(llama.cpp's for it, as llama.cpp runs them, which is not always as the model's own
tokenizer.json reads: its `\p{Lu}` is any letter, some patterns run with std::regex's ASCII
`\d`), applied one after the other, each to the pieces the last one left; then the bytes as
GPT-2's byte-level alphabet. Names llama.cpp reads the same way
share a row. A name not listed is refused by the caller, naming it: a guessed split gives
plausible but different ids. tests/text/test_gguf_vocabularies.py holds each row to llama.cpp's
own expected ids: its vocabulary test files, and for names it ships none for, the ids its
tokenizer gives on llama-bpe's vocabulary read with that name (recorded by
tests/text/write_pre_tokenizer_ids.py; gpt-4o's split also against tiktoken's o200k pattern).
Kimi K2's (kimi-k2) llama.cpp cuts by hand-written code rather than a pattern; its row is that
code's rules written as one pattern. A few names run BPE over raw UTF-8 instead (Gemma 4's
vocabulary, Sarvam's: RAW_UTF8_ROWS; their ids held to Gemma 4's test file and to llama.cpp's
ids on it read with each name). A name llama.cpp knows that zllm does not read is listed with
the reason (NOT_READ). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenizers import Regex, pre_tokenizers

_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# o200k's (and tekken's) cased words: capitals (and caseless letters, marks) then lower case.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
# What llama.cpp counts as Han (unicode.cpp unicode_cpt_is_han): the CJK ideograph blocks.
_HAN = (
    "\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f"
    "\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\U0002ceb0-\U0002ebef\uf900-\ufaff"
    "\U0002f800-\U0002fa1f"
)
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
    # llama.cpp adds a BOS for this name where the file does not say
    # (tokenizer.ggml.add_bos_token absent).
    add_bos: bool = False


_LLAMA3 = PreTokenizer((_llama3_like(r"\p{N}{1,3}"),), ignore_merges=True, add_bos=True)
# GLM-4's (from GLM-4.5 on): Llama 3's split, words whole, no BOS unless the file says.
_GLM4 = replace(_LLAMA3, add_bos=False)
# The same split, BPE merging every word (DBRX's, Smaug's, ChatGLM's files).
_LLAMA3_MERGED = PreTokenizer((_llama3_like(r"\p{N}{1,3}"),))
_QWEN2 = PreTokenizer((_llama3_like(r"\p{N}"),))
_GPT2_ROW = PreTokenizer((_GPT2,))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))

# Llama 3's split without contractions or digit runs (every digit alone).
_WORDS_DIGITS = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# BLOOM's (and Poro's, GPT-3-Finnish's, Viking's first): runs of anything but whitespace
# and some punctuation ("(", "|" and ")" inside the class are literal, as llama.cpp reads it).
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_DEEPSEEK_V3 = PreTokenizer(
    (
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    )
)

# The names llama.cpp reads alike, beside the rows below that take them.
_LLAMA3_NAMES = (
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "minicpm5",
)  # fmt: skip
_QWEN2_NAMES = (
    "qwen2", "deepseek-r1-qwen", "stablelm2", "kormo", "f2llmv2", "megrez", "hunyuan",
    "solar-open", "grok-2",
)  # fmt: skip
_GPT2_ROW_NAMES = (
    "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "jina-es",
    "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code", "gigachat", "a.x-4.0",
    "mellum", "modern-bert", "roberta-bpe", "exaone4",
)  # fmt: skip
_DIGITS_THEN_GPT2_NAMES = (
    "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
    "mellum2",
)  # fmt: skip

ROWS: dict[str, PreTokenizer] = {
    **dict.fromkeys(_LLAMA3_NAMES, _LLAMA3),
    **dict.fromkeys(_QWEN2_NAMES, _QWEN2),
    "seed-coder": PreTokenizer(
        (
            rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}\r\n]+"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    **dict.fromkeys(
        ("bailingmoe", "bailingmoe2", "llada-moe"),
        PreTokenizer(
            (
                r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
            )
        ),
    ),
    "ufakzeka": PreTokenizer((_WORDS_DIGITS,)),
    # llama.cpp's fallback for a name it knows without patterns of its own ("default").
    "default": PreTokenizer(
        (
            r"[\p{P}\$\+<=>\^~\|]+",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            r"\p{N}+",
            "[0-9][0-9][0-9]",
        )
    ),
    # Laguna's: lines apart from their newlines first, then Qwen 2's.
    "laguna": PreTokenizer(("[^\n]+|[\n]+", _llama3_like(r"\p{N}"))),
    # EXAONE MoE's: a word runs on across single spaces between letters.
    "exaone-moe": PreTokenizer(
        (
            rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?(?:\p{{L}}\p{{M}}*(?: \p{{L}}\p{{M}}*)*)+|\p{{N}}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    # Granite's multilingual embedders: MiniMax-M2's cased words, marks counted as letters
    # (llama.cpp's own pattern: a capital is a letter or mark that is not a-z), words whole.
    "granite-embed-multi-97m": PreTokenizer(
        (
            r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
            rf"{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}\p{{M}}])([^a-z]))+"
            rf"((?=[\p{{L}}\p{{M}}])([^A-Z]))*{_CONTRACTIONS}?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
    # Youtu's: Hangul, CJK punctuation, Bopomofo, then Han and kana runs; then o200k's pattern
    # as llama.cpp reads it (its \p{Lu}, \p{Ll} ... are any letter), every digit alone.
    "youtu": PreTokenizer(
        (
            "[\uac00-\ud7a3\u3131-\u318e]+"
            "|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
            "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
            rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+{_CONTRACTIONS}?"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
    # Spark 2.5's: DeepSeek-V3's with newlines alone and every digit alone after the threes.
    # AFMoE's: digit runs cut into threes from the right (llama.cpp's own code), runs of the
    # ranges its pattern lists (as written there: e.g. Thai from U+0E40, 豈 (U+8C48) to U+FAFF),
    # then DeepSeek-V3's words.
    "afmoe": PreTokenizer(
        (
            r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
            "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff"
            "\uff65-\uff9f\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff"
            "\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    # SuperBPE's: digit runs apart, then cut before each group of three ASCII digits from the
    # right (an empty match: llama.cpp cuts there too, its \d being ASCII); nothing else cut.
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))")),
    "spark2_5": PreTokenizer(
        (
            r"\p{N}{1,3}",
            "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
            r"\p{N}",
        )
    ),
    # Jais 2's: Llama 3's, with runs of whitespace cut into powers of two.
    "jais-2": PreTokenizer(
        (
            rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*"
            r"|\s*[\r\n]+|"
            + "|".join(rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
            + r"|\s{1,2}(?!\S)|\s",
        )
    ),
    # Tiny Aya's (and Cohere's MoE): digits grouped in threes from the right (ASCII and
    # full-width digits, ASCII word boundaries: as std::regex runs it in llama.cpp, measured
    # on its tokenizer), then o200k's pattern as llama.cpp
    # reads it: its \p{Lu}, \p{Ll} ... are any letter, so words are not cut by case.
    **dict.fromkeys(
        ("tiny_aya", "cohere2moe"),
        PreTokenizer(
            (
                r"[0-9\uff10-\uff19]{1,3}(?=(?:[0-9\uff10-\uff19]{3})*(?![0-9A-Za-z_\uff10-\uff19]))",
                rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+{_CONTRACTIONS}?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            )
        ),
    ),
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), PreTokenizer((_BLOOM,))),
    "viking": PreTokenizer((_BLOOM, r"\p{N}")),
    # Qwen3.5's: marks join their letters.
    "qwen35": PreTokenizer(
        (
            rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}"
            r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    **dict.fromkeys(_GPT2_ROW_NAMES, _GPT2_ROW),
    # Every digit alone, then GPT-2's (SmolLM's, StarCoder's, Command R's).
    **dict.fromkeys(_DIGITS_THEN_GPT2_NAMES, _DIGITS_THEN_GPT2),
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
        ("gpt-4o", "llama4", "minimax-m2", "kanana2", "talkie"),
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
        add_bos=True,
    ),
    # GLM-4's: Llama 3's split (its files from GLM-4.5 on take words whole, as Llama 3's).
    **dict.fromkeys(("chatglm-bpe", "dbrx", "smaug-bpe"), _LLAMA3_MERGED),
    **dict.fromkeys(("glm4", "glm5"), _GLM4),
    # DeepSeek-V3's (and Kimi-less DeepSeek-R1's; Hunyuan's dense models', JoyAI's, HY V4's):
    # digits in threes, CJK runs, then words.
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK_V3),
    # Kimi K2's, as llama.cpp's code cuts it (unicode.cpp, not the model's own tiktoken
    # pattern): runs of Han characters (llama.cpp's ranges, _HAN), words of any other letters
    # whatever their case (marks are not letters there), contractions in either case, digits
    # in threes, then Llama 3's punctuation and whitespace rules.
    "kimi-k2": PreTokenizer(
        (
            rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+"
            r"(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    # Chameleon's: its special tokens' shapes, tabs, newlines and runs of spaces, digits
    # alone, punctuation alone, then GPT-2's split; a BOS unless the file says not.
    "chameleon": PreTokenizer(
        (
            "<sentinel:[0-9]+>",
            "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            "([\\t\\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            _GPT2,
        ),
        add_bos=True,
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


@dataclass(frozen=True, slots=True)
class RawUtf8Row:
    """A name whose BPE llama.cpp runs over raw UTF-8 rather than GPT-2's byte alphabet (a
    SentencePiece-style vocabulary in a BPE file): spaces written '▁' first, the text cut only
    between newline runs and the rest, a byte the vocabulary lacks as its <0xNN> token."""

    # A BOS even where the file says not (llama.cpp's rule for Gemma 4's vocabulary).
    always_bos: bool = False


RAW_UTF8_SPLIT = "[^\n]+|[\n]+"
RAW_UTF8_ROWS = {
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m"), RawUtf8Row(always_bos=True)),
    "sarvam-moe": RawUtf8Row(),
}

# Names llama.cpp knows that zllm refuses, and why (the refusal says it).
NOT_READ = {
    "whitespace": "llama.cpp reads it only with the tokenizer model 'whitespace' (as the "
    "converter writes it); under 'gpt2' its BPE stops at the first space",
}


def byte_level_pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, PreTokenizer]:
    """(the pre-tokenizer of a `tokenizer.ggml.pre` name, its row's flags)."""
    row = ROWS.get(pre)
    if row is None:
        why = f": {NOT_READ[pre]}" if pre in NOT_READ else ""
        names = ", ".join(sorted([*ROWS, *RAW_UTF8_ROWS]))
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre{why}; zllm reads "
            f"{names}): pass the model's Hugging Face tokenizer with --tokenizer"
        )
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in row.patterns]
    steps = [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps), row
