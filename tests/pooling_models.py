"""Tiny random pooling models for the tests of issue 61: decoders saved with
sentence-transformers' modules (embedding models), and `*ForSequenceClassification`
checkpoints (classifiers, cross-encoders), with the tiny models' tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from tiny_models import write_tiny_model


def write_st_model(path: Path, arch: str, mode: str, normalize: bool, **extra) -> Path:
    """A tiny random `arch` decoder with sentence-transformers' modules: Pooling by `mode`
    (its 6.x name: lasttoken, mean, cls), Normalize when `normalize`; `extra`: prompts and
    default_prompt_name for the SentenceTransformer, matryoshka fields for config.json."""
    from sentence_transformers import SentenceTransformer, models

    base = write_tiny_model(path.parent / f"{path.name}-base", arch=arch)
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    tokenizer_config["pad_token"] = tokenizer_config["eos_token"]  # (batches are padded)
    (base / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    transformer = models.Transformer(str(base))
    modules = [transformer, models.Pooling(transformer.get_word_embedding_dimension(), mode)]
    if normalize:
        modules.append(models.Normalize())
    st_kwargs = {k: extra.pop(k) for k in ("prompts", "default_prompt_name") if k in extra}
    SentenceTransformer(modules=modules, **st_kwargs).save(str(path))
    # Text in as text, as the files of sentence-transformers 5 and before (the published
    # embedding checkpoints') say: version 6 would render it through the chat template.
    bert_config = json.loads((path / "sentence_bert_config.json").read_text())
    bert_config.get("modality_config", {}).pop("message", None)
    (path / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    if extra:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **extra}))
    return path


def assert_same_vectors(ours: list[list[float]], expected: np.ndarray) -> None:
    """zllm's vectors are sentence-transformers': cosine above 0.9999, norms within 1e-4."""
    ours_array = np.asarray(ours, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert ours_array.shape == expected.shape
    cosine = (ours_array * expected).sum(1) / (
        np.linalg.norm(ours_array, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cosine.min() > 0.9999, cosine
    assert np.allclose(
        np.linalg.norm(ours_array, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4
    )


def st_vectors(path: Path, texts: list[str], **kwargs) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, **kwargs)


def write_classifier(path: Path, arch: str, labels: list[str]) -> Path:
    """A tiny random `arch` ForSequenceClassification beside the tiny model's tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    base = write_tiny_model(path.parent / f"{path.name}-base", arch=arch)
    config = AutoConfig.from_pretrained(base)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    config.num_labels = len(labels)
    config.pad_token_id = config.eos_token_id
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # (so the labels differ visibly)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, path / name)
    return path


_BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_WORDS = "the a an of and to in is it for on with as was at by be this that fox dog quick brown lazy jumps over paged attention keys values blocks hello world def return film day".split()  # noqa: E501


def bert_tokenizer():
    """A WordPiece tokenizer as BERT's (lower-casing, [CLS] a [SEP] b [SEP] with segment ids),
    over a small vocabulary: words, letters and digits, and ## pieces of each."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,:;!?()'+-=_")
    vocab = [*_BERT_SPECIAL, *BERT_WORDS, *chars, *[f"##{c}" for c in chars]]
    tokenizer = Tokenizer(WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )  # fmt: skip
    return tokenizer


# The tiny BERT and RoBERTa models' shape (beside bert_tokenizer's vocabulary).
_TINY_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=130, pad_token_id=0)  # fmt: skip


def save_bert_tokenizer(path: Path, model_max_length: int = 128) -> None:
    """bert_tokenizer as tokenizer.json, and the tokenizer_config.json naming its special
    tokens, beside a model in `path`."""
    bert_tokenizer().save(str(path / "tokenizer.json"))
    config = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
              "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": model_max_length}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_tiny_bert(path: Path, arch: str = "bert", seed: int = 0) -> Path:
    """A tiny random BertModel (or RobertaModel) with bert_tokenizer, as an encoder base."""
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    tokenizer = bert_tokenizer()
    shape = dict(vocab_size=tokenizer.get_vocab_size(), **_TINY_BERT)
    torch.manual_seed(seed)
    if arch == "roberta":
        model = RobertaModel(RobertaConfig(**shape))
    else:
        model = BertModel(BertConfig(**shape))
    model.save_pretrained(path)
    save_bert_tokenizer(path)
    return path


def write_st_encoder(path: Path, arch: str, mode: str, normalize: bool) -> Path:
    """write_tiny_bert's encoder with sentence-transformers' Pooling (and Normalize)."""
    from sentence_transformers import SentenceTransformer, models

    base_path = path.parent / f"{path.name}-base"
    base = (
        write_tiny_modernbert(base_path)
        if arch == "modernbert"
        else write_tiny_bert(base_path, arch)
    )
    transformer = models.Transformer(str(base))
    modules = [transformer, models.Pooling(transformer.get_word_embedding_dimension(), mode)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules).save(str(path))
    return path


def write_encoder_classifier(path: Path, arch: str, labels: list[str], seed: int = 0) -> Path:
    """A tiny random BertForSequenceClassification (or RoBERTa's) with bert_tokenizer: a
    cross-encoder with one label, a classifier with more."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    tokenizer = bert_tokenizer()
    shape = dict(vocab_size=tokenizer.get_vocab_size(), **_TINY_BERT,
                 id2label=dict(enumerate(labels)),
                 label2id={label: i for i, label in enumerate(labels)})  # fmt: skip
    torch.manual_seed(seed)
    if arch == "roberta":
        model = RobertaForSequenceClassification(RobertaConfig(**shape))
    else:
        model = BertForSequenceClassification(BertConfig(**shape))
    model.save_pretrained(path)
    save_bert_tokenizer(path)
    return path


def write_tiny_modernbert(path: Path, seed: int = 0) -> Path:
    """A tiny random ModernBertModel (local layers of an 8-token window between global ones)
    with bert_tokenizer."""
    from transformers import ModernBertConfig, ModernBertModel

    tokenizer = bert_tokenizer()
    config = ModernBertConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
        local_attention=8, global_attn_every_n_layers=2, pad_token_id=0, cls_token_id=2,
        sep_token_id=3, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    torch.manual_seed(seed)
    ModernBertModel(config).save_pretrained(path)
    save_bert_tokenizer(path)
    return path
