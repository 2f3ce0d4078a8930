"""The BERT-style encoders on the transformers backend (BERT, RoBERTa, XLM-R, ModernBERT):
every token attends to its whole prompt, so a prompt is computed in one step and pools
(embeddings, classifiers, cross-encoders); they never decode. RoBERTa's positions start past
its padding index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import transformers_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Trait


def position_offset(model_type: str, pad_token_id: int | None) -> int:
    """The positions the embedding reserves before the first token: RoBERTa's and XLM-R's
    learned positions start past the padding index."""
    return (pad_token_id or 0) + 1 if model_type in ("roberta", "xlm-roberta") else 0


def has_segments(model_type: str, type_vocab_size: int) -> bool:
    """Whether a pair's second text is segment 1 (BERT's token types; RoBERTa's tokenizers
    give no segment ids: transformers runs it on zeros)."""
    return model_type == "bert" and type_vocab_size >= 2


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    transformers_config.refuse_unservable(cfg, str(where))
    offset = position_offset(cfg["model_type"], cfg.get("pad_token_id"))
    return transformers_config.read_hf(
        cfg, where, FAMILY.name, encoder=True, position_offset=offset
    )


FAMILY = Family(
    name="bert",
    title="BERT-style encoder",
    model_types=("bert", "roberta", "xlm-roberta", "modernbert"),
    read_hf=read_hf,
    model_class="zllm.executor.models.transformers.backend:TransformersForCausalLM",
    code="transformers",
    traits=frozenset({Trait.ENCODER}),
    lacks=transformers_config.TRANSFORMERS_LACKS,
)
