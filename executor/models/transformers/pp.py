"""Pipeline stages for the transformers backend: transformers' own base-model forward, run over
one stage's consecutive decoder layers (zllm/config/parallel.py `stage_layers`).

transformers' base model runs the embedding, every decoder layer and the final norm in one
forward. A stage keeps that forward and changes what it iterates over and its two ends:

    layers      the base model's `layers` ModuleList keeps only the stage's layers. Each keeps
                its `layer_idx` (the whole model's index), which the zllm attention function
                maps to this stage's KV cache tensors (index - the stage's first layer), as
                zllm's own models hold a stage's caches in order (executor/models/llama.py).
    entering    a stage that does not start the pipeline passes the received stream as
                `inputs_embeds` (its embedding table is not used, so it is released), and a
                forward pre-hook on its first layer replaces whatever the forward made of
                it with the received stream: a model that scales or drops out its embeddings
                inside the forward cannot touch it. The first stage passes the lookup of its
                input embedding as `inputs_embeds`, which the forward treats as it treats
                its own lookup of `input_ids` (Gemma's scaling lives in the embedding module).
    leaving     a stage that does not end the pipeline takes the stream leaving its last
                layer (a forward hook); what the forward does after it, the final norm, is
                discarded. The last stage keeps the forward's output, the norm applied.

What the forward reads of the config: it loops `layers[: num_hidden_layers]` (the whole
count: the slice keeps every local layer, so it stays), and models with per-layer attention
types (Gemma 2/3, Qwen2, ...) pick layer i's mask and rotary table from `layer_types[i]`
with i counted over the layers it iterates: the base model gets a copy of the config whose
`layer_types` are the stage's. The layers keep the whole model's config (their attention
type and window were set from it, by layer_idx, when they were built). Rotary embeddings are
computed from the positions alone, the same on every stage.

Every stage loads the whole model (transformers' from_pretrained has no simple way to read
only some layers), then drops the other stages' layers and the embedding / logits weights it
does not use; the weights then hand their memory back (release_freed_memory).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from zllm.executor.parallel.groups import PipelineParallel
from zllm.executor.parallel.shards import release_weight
from zllm.model.arch_config import ModelArchConfig

_FLAG = "--pipeline-parallel-size with --model-impl transformers"


def stage_layers_of(base: nn.Module, arch: ModelArchConfig) -> nn.ModuleList:
    """The base model's decoder layers, or ValueError when it does not keep them as a
    `layers` ModuleList of config.json's length (GPT-2's `h`, OPT's `decoder.layers`): the
    stage cut replaces exactly that list, and a differently built forward could iterate
    something else."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != arch.num_layers:
        found = type(layers).__name__ if layers is not None else "none"
        raise ValueError(
            f"{_FLAG}: {arch.architecture}'s base model ({type(base).__name__}) does not keep "
            f"its {arch.num_layers} decoder layers as a `layers` ModuleList (found {found}), "
            f"so zllm cannot cut its forward into stages; run it on one stage"
        )
    return layers


def cut_to_stage(hf_model: nn.Module, arch: ModelArchConfig, pp: PipelineParallel) -> StageEnds:
    """Cut the loaded causal LM to stage `pp`'s part, in place: its layers, the config its
    base model's forward reads, the ends it does not use released. Returns the stage's ends."""
    base = hf_model.base_model
    held = pp.layer_range(arch.num_layers)
    kept = nn.ModuleList(stage_layers_of(base, arch)[i] for i in held)
    base.layers = kept  # the other stages' layers: no reference left, freed
    _localize_layer_types(base, held)
    _release_unused_ends(hf_model, pp)
    return StageEnds(kept, first=pp.is_first, last=pp.is_last)


def _localize_layer_types(base: nn.Module, held: range) -> None:
    """`layer_types` as the forward indexes it (by position in the layers it iterates)."""
    config = base.config
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == config.num_hidden_layers:
        # A copy: the layers (and the causal-LM wrapper) read the whole model's.
        base.config = copy.copy(config)
        base.config.layer_types = [types[i] for i in held]


def _release_unused_ends(hf_model: nn.Module, pp: PipelineParallel) -> None:
    """Only the first stage embeds tokens and only the last computes logits; a tied table
    is one parameter, kept where either end uses it."""
    embedding = hf_model.get_input_embeddings().weight
    head = hf_model.get_output_embeddings()
    ends = [(embedding, pp.is_first)]
    if head is not None:
        ends.append((head.weight, pp.is_last))
    used = {id(p) for p, needed in ends if needed}
    for param, _ in ends:
        if id(param) not in used and param.numel():
            release_weight(param)


class StageEnds:
    """A stage's two ends inside transformers' forward: the received stream entering its first
    layer (a stage after the first), the stream leaving its last one (a stage before the
    last). `run` calls the forward with them in place."""

    def __init__(self, layers: nn.ModuleList, first: bool, last: bool) -> None:
        self.first, self.last = first, last
        self._stream_in: torch.Tensor | None = None
        self._stream_out: torch.Tensor | None = None
        if not first:
            layers[0].register_forward_pre_hook(self._enter, with_kwargs=True)
        if not last:
            layers[-1].register_forward_hook(self._leave)

    def run(self, forward: Any, stream: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`forward` (the base model) over `stream` [T, hidden]: on the first stage its
        embedding, else the received stream. Returns [T, hidden]: the stream leaving the last
        layer, or on the last stage the forward's output (the final norm applied)."""
        self._stream_in, self._stream_out = stream[None], None
        try:
            out = forward(inputs_embeds=stream[None], **kwargs).last_hidden_state
        finally:
            self._stream_in = None
        if not self.last:
            out, self._stream_out = self._stream_out, None
            if out is None:
                raise RuntimeError("the stage's last decoder layer did not run in the forward")
        return out[0]

    def _enter(
        self, module: nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]]:
        """Pre-hook: the received stream replaces the layer's hidden states (its first
        argument, positional in transformers' decoder loops, or the keyword)."""
        stream = self._stream_in
        if stream is None:
            return args, kwargs
        _check_stream(args[0] if args else kwargs.get("hidden_states"), stream, "enter")
        if args:
            return (stream, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": stream}

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        # Decoder layers return the hidden states, or (older code) a tuple starting with them.
        out = output[0] if isinstance(output, tuple) else output
        if self._stream_in is not None:  # (a call outside `run` passes through)
            _check_stream(out, self._stream_in, "leave")
            self._stream_out = out


def _check_stream(hidden: Any, stream: torch.Tensor, end: str) -> None:
    """A stage passes on one [1, T, hidden] stream: a model whose layers carry something else
    between them (Gemma 3n's four AltUp streams) cannot be cut there."""
    shape = getattr(hidden, "shape", None)
    if shape != stream.shape:
        raise ValueError(
            f"{_FLAG}: the hidden states that {end} a decoder layer are "
            f"{tuple(shape) if shape is not None else type(hidden).__name__}, not the "
            f"{tuple(stream.shape)} residual stream a stage receives and sends on"
        )
