"""Any Hugging Face causal LM under zllm's engine: transformers' modeling code, our paged KV cache.

transformers sends every attention layer through a registry of attention functions
(`AttentionInterface`). We register ours as "zllm" and load the model with
`attn_implementation="zllm"`; the model then runs over zllm's flat batch, [1, T] tokens from
many sequences with per-token positions. Embeddings, projections, rotary embeddings, norms,
MLPs and mixture-of-experts routing stay transformers' own; only the attention call reaches us:

    TransformersForCausalLM.forward(input_ids [T], positions [T], kv_caches, metadata)
        base_model(input_ids [1, T], position_ids [1, T], zllm_step=_Step)
            layer i:  q, k, v (rotated)  ->  zllm_attention(module, q, k, v, mask, **kwargs)
                      kwargs["zllm_step"]: layer i's KV cache, metadata and PagedAttention
                      -> write K/V at the step's slots, attend through the block tables

The KV cache layout (layers, KV heads, head size, sliding windows) comes from config.json
(zllm.model.files, which cannot import transformers' torch); `probe` runs one short forward at
load and refuses the model if what its layers actually do differs from that layout.

Over tensor-parallel ranks transformers' modules are cut by its plan (tp.py);
over pipeline stages each stage runs the forward over its own layers (pp.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.attention.backend import (
    AttentionBackend,
    AttentionLayer,
    StepAttentionMetadata,
    metadata_per_layer,
)
from zllm.executor.models.transformers.pp import StageEnds, cut_to_stage
from zllm.executor.models.transformers.quant import TransformersQuantization
from zllm.executor.models.transformers.tp import cut_by_plan, usable_plan
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import local_arch
from zllm.executor.weights.gguf_reading import gguf_parsed_once
from zllm.model.arch_config import ModelArchConfig
from zllm.model.families import bert
from zllm.model.family import Trait
from zllm.model.registry import family_for_config, family_of

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "zllm"  # our name in transformers' attention-interface registry
_STEP_KWARG = "zllm_step"  # the forward keyword that carries the step to every layer


@dataclass(slots=True)
class LayerRecord:
    """What one attention layer did during `probe`."""

    num_kv_heads: int
    head_dim: int
    value_dim: int
    sliding_window: int | None
    problems: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Step:
    """One forward's view of the cache, handed to every layer through the model's kwargs."""

    kv_caches: Sequence[torch.Tensor]
    metas: Sequence[StepAttentionMetadata]
    model: TransformersForCausalLM
    # Set during `probe`: each layer records itself here and attends without the cache.
    records: dict[int, LayerRecord] | None = None
    # An encoder's step: each prompt's [start, end) rows, attending within them both ways
    # (the prompt is whole in the step; no cache is read or written).
    prompts: list[tuple[int, int]] | None = None


def zllm_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, heads, T, D], key and value
    [1, kv_heads, T, D] (rotated, this step's tokens only) -> ([1, T, heads, D], no weights)."""
    step = kwargs.get(_STEP_KWARG)
    if step is None:
        raise RuntimeError(
            f"{type(module).__name__} called the zllm attention function without the step; "
            f"it does not pass its forward's keyword arguments through to attention"
        )
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx; cannot find its KV cache")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    # ModernBERT's local layers: keys within sliding_window - 1 of the query (transformers
    # passes flash attention's inclusive bound).
    window = kwargs.get("sliding_window")
    if step.records is not None:
        encoder = step.model.encoder
        step.records[layer] = _record(module, q, k, v, attention_mask, kwargs, encoder)
        if encoder:
            whole = [(0, q.shape[0])]
            return _encoder_attention(q, k, v, whole, scaling, window).unsqueeze(0), None
        return _causal_attention(q, k, v, scaling).unsqueeze(0), None
    if step.prompts is not None:
        return _encoder_attention(q, k, v, step.prompts, scaling, window).unsqueeze(0), None
    attn = step.model.attention_layer(layer, q.shape[1], k.shape[1], q.shape[2], scaling)
    # A pipeline stage holds its layers' caches in order, from its first layer's.
    local = layer - step.model.layer_indices.start
    sinks = kwargs.get("s_aux")  # gpt-oss: a sink logit per head, which our layers take
    sinks = None if sinks is None else sinks.float()
    out = attn(q, k, v, step.kv_caches[local], step.metas[local], sinks=sinks)
    return out.unsqueeze(0), None


def _record(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    encoder: bool = False,
) -> LayerRecord:
    window = None if encoder else kwargs.get("sliding_window") or None  # (an encoder: no cache)
    record = LayerRecord(k.shape[1], k.shape[2], v.shape[2], window)
    if q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2]:
        record.problems.append(
            f"query/key/value head sizes {q.shape[2]}/{k.shape[2]}/{v.shape[2]} differ "
            f"(the paged cache holds one head size for K and V)"
        )
    if q.shape[1] % k.shape[1]:
        record.problems.append(f"{q.shape[1]} query heads over {k.shape[1]} KV heads")
    if attention_mask is not None and not encoder:  # (an encoder's: made again, per prompt)
        record.problems.append("the model builds its own attention mask")
    if not getattr(module, "is_causal", True) and not encoder:
        record.problems.append("non-causal attention")
    for name in ("softcap", "sinks"):
        if kwargs.get(name) is not None:
            record.problems.append(f"attention {name!r} (not in zllm's attention kernels)")
    return record


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Plain causal attention over one sequence ([T, heads, D]); only `probe` uses it."""
    group = q.shape[1] // max(k.shape[1], 1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


def _encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prompts: list[tuple[int, int]],
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """An encoder's attention over the flat batch ([T, heads, D]): each prompt's tokens
    attend to all of that prompt's (within `window` - 1 of themselves where a local layer
    has one), none of another's. Prompts lie back to back in the step, so a run of them of
    one length is a view of the batch, [n, length, heads, D], and goes through one SDPA
    call as it lies: no gather and no scatter (a copy of q, k, v and the output, a tenth of
    a MiniLM's forward)."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for start, count, length in _equal_length_runs(prompts):
        rows = slice(start, start + count * length)
        qs, ks, vs = (t[rows].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v))
        if group > 1:
            ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        mask = None
        if window is not None:
            index = torch.arange(length, device=q.device)
            mask = (index[:, None] - index[None, :]).abs() < window
        attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        outs.append(attended.transpose(1, 2).flatten(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _equal_length_runs(prompts: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first row, prompts, length) of each run of consecutive prompts of one length, in
    order; the prompts are back to back from row 0."""
    runs: list[tuple[int, int, int]] = []
    for start, end in prompts:
        if runs and runs[-1][2] == end - start:
            first, count, length = runs[-1]
            runs[-1] = (first, count + 1, length)
        else:
            runs.append((start, 1, end - start))
    return runs


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, zllm_attention)


# ---------------------------------------------------------------------------------------------
# What the registry cannot serve


def causal_lm_class(config: Any) -> type:
    """The transformers causal-LM class of `config`, or ValueError saying why it cannot run here."""
    from transformers import AutoModelForCausalLM

    name = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{name}: an encoder-decoder model; the transformers backend runs decoder-only "
            f"causal LMs"
        )
    mapping = AutoModelForCausalLM._model_mapping
    family = family_for_config({"model_type": config.model_type})
    if family is not None and family.has(Trait.ENCODER):  # it pools: the base model or a classifier
        from transformers import AutoModel, AutoModelForSequenceClassification

        classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])  # fmt: skip
        mapping = (AutoModelForSequenceClassification if classifier else AutoModel)._model_mapping
    elif hasattr(config, "vision_config"):  # a vision-language model (zllm/model/impl.py)
        from transformers import AutoModelForImageTextToText

        mapping = AutoModelForImageTextToText._model_mapping
    try:
        cls = mapping[type(config)]
    except KeyError:
        raise ValueError(f"{name}: transformers has no causal-LM class for this model") from None
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(
            f"{name}: transformers' {cls.__name__} does not route attention through the "
            f"attention-interface registry (_supports_attention_backend is False), so zllm "
            f"cannot give it the paged KV cache"
        )
    return cls


# ---------------------------------------------------------------------------------------------
# The model


def _config(directory: str, gguf_file: str | None, arch: ModelArchConfig) -> Any:
    """transformers' config of the model, mended where its GGUF reader leaves it wrong."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory, gguf_file=gguf_file)
    if gguf_file is None:
        return config
    if getattr(config, "head_dim", arch.head_dim) != arch.head_dim:
        # It skips `attention.key_length` (Qwen3's heads are 128 wide at hidden 2048 / 16
        # heads): the width zllm read from the file wins.
        config.head_dim = arch.head_dim
    if not 0 <= (config.pad_token_id or 0) < config.vocab_size:
        # The config class's default (Phi-3's 32000) past a smaller file's vocabulary, which
        # nn.Embedding refuses; padding plays no part in inference.
        config.pad_token_id = None
    return config


def _sep_token_id(directory: str, config: Any) -> int | None:
    """A BERT's [SEP] (tokenizer_config.json's sep_token), which ends a pair's first text;
    None for any other model (RoBERTa's tokenizers give no segment ids: transformers runs it
    on zeros)."""
    import json

    from tokenizers import Tokenizer

    if not bert.has_segments(config.model_type, getattr(config, "type_vocab_size", 1)):
        return None
    folder = Path(directory)
    config = folder / "tokenizer_config.json"
    sep = json.loads(config.read_text()).get("sep_token", "[SEP]") if config.is_file() else "[SEP]"
    sep = sep.get("content") if isinstance(sep, dict) else sep
    if not (folder / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(sep)


def _attn_implementation(arch: ModelArchConfig) -> str | dict[str, str]:
    """Ours for the model's attention; a vision-language model's vision tower keeps torch's
    SDPA (it attends within each image, outside any KV cache)."""
    if not arch.vision:
        return ATTN_IMPLEMENTATION
    return {"": "sdpa", "text_config": ATTN_IMPLEMENTATION, "vision_config": "sdpa"}


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM behind the interface of zllm's own models (forward over the
    flat batch -> hidden states, compute_logits), attending through `attention`'s layers."""

    def __init__(
        self,
        hf_model: nn.Module,
        arch: ModelArchConfig,
        attention: AttentionBackend,
        stage: StageEnds | None = None,
        layers: range | None = None,
    ):
        """`arch`: this rank's (executor/parallel/shards.py local_arch), what its layers attend with.
        On a pipeline stage (pp.py): `stage`, its ends in the forward, and
        `layers`, the whole model's indices of the decoder layers it kept."""
        super().__init__()
        self.hf = hf_model
        self.arch = arch
        # Every token attends to its whole prompt (the BERT family's): a step's rows are whole
        # prompts, each from position 0.
        self.encoder = family_of(arch).has(Trait.ENCODER)
        self.attention = attention
        self.stage = stage
        # As zllm's models name them (the LoRA manager maps adapter layers by them too).
        self.layer_indices = range(arch.num_layers) if layers is None else layers
        self.base = hf_model.base_model  # the decoder stack, its final norm included
        self.lm_head = hf_model.get_output_embeddings()
        config = hf_model.config
        # What some CausalLM classes do to logits after lm_head (their forward, not a module):
        # Granite divides by logits_scaling, Cohere multiplies by logit_scale, Gemma 2/3 cap.
        self.logits_divisor = float(getattr(config, "logits_scaling", None) or 1.0)
        self.logits_multiplier = float(getattr(config, "logit_scale", None) or 1.0)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.position_offset = bert.position_offset(
            config.model_type, getattr(config, "pad_token_id", None)
        )
        # An encoder with segment embeddings (BERT's): a pair's second text, after the first
        # [SEP], is segment 1 (set by load from the tokenizer; None: one segment).
        self.sep_token_id: int | None = None
        self._layers: dict[int, AttentionLayer] = {}
        self.requires_grad_(False)

    @classmethod
    @gguf_parsed_once()  # (a GGUF file's readers and gguf-py's name map, once for the load)
    def load(
        cls,
        model_path: str,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionBackend,
        dummy: bool = False,
        tp: TensorParallel = SINGLE,
        pp: PipelineParallel = WHOLE,
        quantization: str = "none",
    ) -> TransformersForCausalLM:
        """transformers' from_pretrained: the model is built on the meta device and each
        safetensors tensor is read straight into its parameter (a GGUF file is dequantized
        by transformers' reader first). `dummy`: built from the config alone, with
        transformers' own random initialization (--load-format dummy). `arch`: the whole
        model's; `tp`: this rank's place, whose part it keeps (tp.py: every rank
        loads the whole model, then cuts it by the architecture's tensor-parallel plan);
        `pp`: its pipeline stage, whose layers it keeps (pp.py: likewise loaded
        whole, then cut, before the tensor-parallel cut so that cuts only the stage's).
        `quantization`: the method (executor/weights/quantization.py, or its 16-bit rows) whose
        modules replace transformers' matmuls after loading and both cuts, each reading its
        rank's part of the blocks (quant.py)."""

        _register()
        directory, gguf_file = model_path, None
        if model_path.endswith(".gguf"):
            directory, gguf_file = os.path.dirname(model_path) or ".", os.path.basename(model_path)
        config = _config(directory, gguf_file, arch)
        model_cls, attn_implementation = causal_lm_class(config), _attn_implementation(arch)
        # Refused before any weight is read: an architecture without a plan zllm can cut.
        plan = usable_plan(config) if tp.enabled else None
        if dummy:
            hf_model = model_cls._from_config(
                config, attn_implementation=attn_implementation, dtype=dtype
            ).to(device)
        else:
            hf_model = model_cls.from_pretrained(
                directory,
                gguf_file=gguf_file,
                config=config,
                attn_implementation=attn_implementation,
                dtype=dtype,
                device_map={"": device} if device.type != "cpu" else None,
            )
        stage = cut_to_stage(hf_model, arch, pp) if pp.enabled else None
        quantized = TransformersQuantization(hf_model, model_path, quantization)  # before the cut
        if plan is not None:
            cut = cut_by_plan(hf_model.base_model, plan, arch, tp)
            logger.info("Tensor parallel: %d matmuls cut by transformers' plan", cut)
        quantized.apply(hf_model)
        layers = pp.layer_range(arch.num_layers)
        model = cls(hf_model.eval(), local_arch(arch, tp), attention, stage, layers)
        model.sep_token_id = _sep_token_id(directory, config)
        model.check_layout(model.probe_cut(device, tp))
        logger.info(
            "Model code: transformers' %s, attention through zllm's paged KV cache",
            model_cls.__name__,
        )
        return model

    def attention_layer(
        self, layer: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None
    ) -> AttentionLayer:
        """Layer `layer`'s attention, made on its first call (the model passes the scale)."""
        attn = self._layers.get(layer)
        if attn is None:
            attn = self._layers[layer] = self.attention.make_layer(
                num_heads, num_kv_heads, head_dim, scale
            )
        return attn

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: StepAttentionMetadata | Sequence[StepAttentionMetadata],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, one row per new token."""
        step = _Step(kv_caches, metadata_per_layer(attn_metadata, len(kv_caches)), self)
        segments = None
        if self.encoder:  # whole prompts (core/request.py chunk_end): each from 0
            starts = (positions == 0).nonzero().flatten().tolist() + [positions.shape[0]]
            step.prompts = list(zip(starts[:-1], starts[1:], strict=True))
            positions = positions + self.position_offset
            segments = self._segments(input_ids, step.prompts)
        return self._run(input_ids, positions, step, segments)

    def _segments(
        self, input_ids: torch.Tensor, prompts: list[tuple[int, int]]
    ) -> torch.Tensor | None:
        """BERT's token_type_ids [1, T]: 1 after each prompt's first [SEP] but its last (a
        pair's second text, as BERT's tokenizer template marks it), else 0."""
        if self.sep_token_id is None:
            return None
        segments = torch.zeros_like(input_ids)
        seps = (input_ids == self.sep_token_id).nonzero().flatten().tolist()
        for start, end in prompts:
            first = next((i for i in seps if start <= i < end - 1), None)
            if first is not None:
                segments[first + 1 : end] = 1
        return segments[None]

    def classify(self, vector: torch.Tensor) -> torch.Tensor:
        """An encoder classifier's logits from its [CLS] state: the model's own head (BERT's
        pooler then classifier; RoBERTa's classification head)."""
        x = vector.to(self.hf.dtype)[None, None]  # [1, 1, hidden], as the heads read [:, 0]
        pooler = getattr(self.base, "pooler", None)
        if pooler is not None:
            x = pooler(x)
        return self.hf.classifier(x)[0].float()

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: _Step,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        extra = {} if segments is None else {"token_type_ids": segments}
        out = self.base(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            **extra,
            **{_STEP_KWARG: step},
        )
        return out.last_hidden_state[0]

    # ---- a pipeline stage (the model runner's interface to zllm's models' stages) -------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's stream in: the input embedding's lookup, which the forward then
        treats as its own (pp.py)."""
        return self.hf.get_input_embeddings()(input_ids)

    def forward_layers(
        self,
        stream: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: StepAttentionMetadata | Sequence[StepAttentionMetadata],
    ) -> tuple[torch.Tensor, None]:
        """This stage's layers over the stream entering them: the stream leaving them, or on
        the last stage the final hidden states (transformers' forward applies the norm; no
        residual is kept apart, so `final_norm` passes them through). Without stages: the
        whole model over the embeddings given (a vision model's step with image rows)."""
        step = _Step(kv_caches, metadata_per_layer(attn_metadata, len(kv_caches)), self)
        if self.stage is None:  # the whole model over embeddings made apart (an image's rows)
            out = self.base(
                inputs_embeds=stream[None],
                position_ids=positions[None],
                use_cache=False,
                **{_STEP_KWARG: step},
            )
            return out.last_hidden_state[0], None
        return self._run_stage(stream, positions, step), None

    def final_norm(self, x: torch.Tensor, residual: None) -> torch.Tensor:
        return x  # applied inside the last stage's forward_layers

    def _run_stage(
        self, stream: torch.Tensor, positions: torch.Tensor, step: _Step
    ) -> torch.Tensor:
        assert self.stage is not None, "forward_layers is a pipeline stage's"
        kwargs = {_STEP_KWARG: step}
        return self.stage.run(
            self.base, stream, position_ids=positions[None], use_cache=False, **kwargs
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits, as the CausalLM class computes them."""
        logits = self.lm_head(hidden_states)
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        if self.logits_multiplier != 1.0:
            logits = logits * self.logits_multiplier
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    # ---- load-time check ------------------------------------------------------------------
    @torch.inference_mode()
    def probe(self, device: torch.device) -> dict[int, LayerRecord]:
        """One 4-token forward with recording attention: what each layer really attends with."""
        records: dict[int, LayerRecord] = {}
        step = _Step([], [], self, records)
        ids = torch.arange(4, device=device) % max(self.arch.vocab_size, 1)
        positions = torch.arange(4, device=device)
        if self.stage is None:
            self._run(ids, positions, step)
        elif self.stage.first:
            self._run_stage(self.embed(ids), positions, step)
        else:  # (its embedding table is released) a stream as the stage before would send
            stream = torch.randn(4, self.arch.hidden_size, generator=torch.Generator())
            self._run_stage(stream.to(device, self.hf.dtype), positions, step)
        return records

    def probe_cut(self, device: torch.device, tp: TensorParallel) -> dict[int, LayerRecord]:
        """`probe`; on a cut model, a module that kept a whole-model shape fails here, the
        same way on every rank: refused, naming it."""
        if not tp.enabled:
            return self.probe(device)
        try:
            return self.probe(device)
        except RuntimeError as exc:
            raise ValueError(
                f"{self.arch.architecture}: transformers' modeling code does not run cut over "
                f"{tp.size} tensor-parallel ranks (a module keeps a whole-model size): {exc}"
            ) from exc

    def check_layout(self, records: dict[int, LayerRecord]) -> None:
        """ValueError unless every layer attends as the KV cache layout from config.json has it."""
        arch, name = self.arch, self.arch.architecture
        layers = self.layer_indices
        if sorted(records) != list(layers):
            held = f" (this stage holds {layers.start} to {layers.stop - 1})" if self.stage else ""
            raise ValueError(
                f"{name}: attention ran in layers {sorted(records)}, but config.json has "
                f"{arch.num_layers} layers{held}"
            )
        for i, rec in sorted(records.items()):
            problems = list(rec.problems)
            if (rec.num_kv_heads, rec.head_dim) != (arch.num_kv_heads, arch.head_dim):
                problems.append(
                    f"{rec.num_kv_heads} KV heads of size {rec.head_dim}, but config.json reads "
                    f"as {arch.num_kv_heads} of size {arch.head_dim}"
                )
            window = rec.sliding_window
            if window is not None and window >= arch.max_position_embeddings:
                window = None  # never drops a key
            expected = arch.sliding_window if arch.is_sliding(i) else None
            if window != expected:
                problems.append(f"sliding window {window}, but config.json reads as {expected}")
            if problems:
                raise ValueError(
                    f"{name} cannot run on the transformers backend: layer {i}: "
                    + "; ".join(problems)
                )
