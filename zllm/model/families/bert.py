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

_PADDED_POSITIONS = ("roberta", "xlm-roberta")


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    transformers_config.refuse_unservable(cfg, str(where))
    offset = int(cfg.get("pad_token_id") or 0) + 1 if cfg["model_type"] in _PADDED_POSITIONS else 0
    return transformers_config.read_hf(
        cfg, where, FAMILY.name, encoder=True, position_offset=offset
    )


FAMILY = Family(
    name="bert",
    title="BERT-style encoder",
    model_types=("bert", "roberta", "xlm-roberta", "modernbert"),
    read_hf=read_hf,
    model_class="zllm.executor.models.transformers_backend:TransformersForCausalLM",
    code="transformers",
    traits=frozenset({Trait.ENCODER}),
    lacks=transformers_config.TRANSFORMERS_LACKS,
)
