"""The recurrent-state cache of a hybrid model, in numbers (no torch: the core counts slots,
the executor allocates them, the log and the docs quote the bytes).

A state layer (Gated DeltaNet's linear attention) keeps, per sequence, a fixed-size state in
place of K and V: its conv window and its recurrent matrices (arch.state). The executor holds
them in *slots*: one slot is one sequence's state in every state layer of the model::

    slot s   layer 0: conv [conv_dim, kernel - 1]   recurrent [heads, key_dim, value_dim]
             layer 1: ...                            (fp32 whatever the model's dtype)

A sequence takes a slot when it is admitted and gives it back when it finishes or is
preempted (core/kv/state_slots.py); a step that starts a sequence at position 0 starts its
slot from zeros, so a slot needs no clearing between owners. The pool has one slot per seat
of the batch (max_num_seqs): the seat count already bounds the sequences running at once.
With prefix caching it has as many snapshots: the state after a cached prefix, copied into a
new sequence's slot when its prompt starts with that prefix.
"""

from __future__ import annotations

from zllm.errors import ParamError
from zllm.model.arch_config import ModelArchConfig, StateConfig
from zllm.sampling_params import SamplingParams

# The state is kept in fp32: it is a running sum over the whole sequence, and transformers'
# reference (and vLLM's default mamba_ssm_cache_dtype for these layers) keeps it so.
STATE_ELEMENT_BYTES = 4


def layer_state_bytes(state: StateConfig) -> int:
    """One sequence's state in one state layer: its conv window and recurrent state."""
    return (state.conv_elems + state.recurrent_elems) * STATE_ELEMENT_BYTES


def state_bytes_per_sequence(arch: ModelArchConfig) -> int:
    """One slot's bytes: every state layer's (0 for a model without state layers)."""
    if arch.state is None:
        return 0
    return len(arch.state_layers) * layer_state_bytes(arch.state)


def num_state_slots(arch: ModelArchConfig, max_num_seqs: int) -> int:
    """Slots in the pool: one per sequence the batch seats (0 without state layers)."""
    return max_num_seqs if arch.state is not None else 0


def check_sequences_fit(params: SamplingParams, num_slots: int) -> None:
    """A request whose samples (or beams) outnumber the state slots cannot run at once on a
    hybrid model (elsewhere one wider than the batch runs alone): ParamError naming the
    field."""
    if params.use_beam_search:
        width, field, what = params.num_beams, "beam_width" if params.beam_width else "n", "beams"
    else:
        width, field, what = params.n, "n", "samples"
    if width > num_slots:
        raise ParamError(
            f"{field}={width}: this hybrid model keeps a recurrent state per sequence in "
            f"{num_slots} slots (one per seat, --max-num-seqs), fewer than the request's "
            f"{width} {what}",
            field,
        )


def seats_for_state(
    arch: ModelArchConfig, max_num_seqs: int, budget: int | None, snapshots: bool
) -> tuple[int, str | None]:
    """(--max-num-seqs as the state lets it be, why it was lowered or None). A hybrid's state
    slots, and with prefix caching as many snapshots (`snapshots`), come out of the KV
    cache's budget (`budget` bytes; None: not known before the executor measures a GPU): at
    most half of it goes to them, so a model whose sequences each keep megabytes of state
    runs fewer at once instead of failing to start."""
    per_sequence = state_bytes_per_sequence(arch) * (2 if snapshots else 1)
    if not per_sequence or budget is None or per_sequence * max_num_seqs <= budget // 2:
        return max_num_seqs, None
    fits = budget // 2 // per_sequence
    if fits < 1:
        raise ValueError(
            f"{arch.architecture} keeps {per_sequence} bytes of recurrent state per sequence, "
            f"more than half of the KV cache's {budget} bytes: raise --kv-cache-memory-bytes"
        )
    why = (
        f"--max-num-seqs {max_num_seqs} lowered to {fits}: each sequence of "
        f"{arch.architecture} keeps {per_sequence} bytes of recurrent state (its slot and, "
        f"with prefix caching, a snapshot), and half of the "
        f"KV cache's {budget} bytes holds {fits} of them (raise --kv-cache-memory-bytes for more)"
    )
    return fits, why
