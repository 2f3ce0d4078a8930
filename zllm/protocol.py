"""Every message that crosses a process boundary, as msgspec Structs, in one module.

Hot-path structs are `array_like` (encoded as msgpack arrays, not maps), `omit_defaults`, and
`gc=False` (they hold no reference cycles, so the garbage collector need not track them).
Only token ids reach the core, never text.

Token ids travel as msgpack arrays of ints, which are already compact: ids below 65,536 take
3 bytes each, ids below 128 one byte. Measured on an 8,192-token prompt from a 49,152-token
vocabulary: 24.5 KB and 0.31 ms to encode and decode back to a list, against 32.8 KB and
0.38 ms for raw int32 bytes (`np.frombuffer(...).tolist()`), so raw arrays would cost more
here: every consumer (scheduler, block hashing, executor state) wants Python ints.

Block hashes (the keys of KV blocks) travel as 16-byte `bytes`: they are 128-bit digests
(zllm/kv/block_hash.py), and msgpack's ints stop at 64 bits.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from zllm.errors import ContextOverflow, ParamError
from zllm.sampling_params import SamplingParams

# The tenant of a request that names none (zllm/config/tenants.py decides who a request is for).
DEFAULT_TENANT = "default"


class FinishReason(str, enum.Enum):
    """Why a sample ended. A str enum, so it also equals the OpenAI spelling ("stop")."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client or the operator
    ERROR = "error"  # the request failed (the engine went away, a bad request found late)

    def __str__(self) -> str:
        return self.value


class ProcessRole(str, enum.Enum):
    """The kinds of child process `zllm serve` runs (and their titles: `zllm: <role> [i]`)."""

    EXECUTOR = "executor"
    CORE = "core"
    TOKENIZER = "tokenizer"
    DETOKENIZER = "detokenizer"
    FRONTEND = "frontend"

    def __str__(self) -> str:
        return self.value

    @property
    def is_engine(self) -> bool:
        """Core and executor live and die together: one engine."""
        return self in (ProcessRole.CORE, ProcessRole.EXECUTOR)


class EngineState(enum.IntEnum):
    """Where the engine (core + executor) is in its life, as the supervisor sees it."""

    STARTING = 0
    READY = 1
    DEAD = 2  # failed; restarting (or the server is exiting)

    def __str__(self) -> str:
        return self.name.lower()


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs for a run of positions; row i: the chosen token first, then the top-k.

    `token_ids[i][0]` is the sampled (or, for prompt logprobs, the actual next) token and
    `ranks[i]` its rank among all tokens (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def extend(self, other: LogprobsLists) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)


class LoRARequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An adapter a request runs with, as vLLM names it: `LoRARequest(name, id, path)`
    (users import it from `zllm` or `zllm.lora`, where its files are checked).

    `lora_int_id` (> 0) names the adapter inside one engine: its weights in the executor
    are keyed by it. The server assigns ids; offline, the caller does (one id per adapter).
    Its KV blocks are salted with `lora_digest`, what its files hash to (`adapter_digest`,
    filled in when the adapter is checked): the same on every server that loads the same
    files whatever id each gives it, so a disaggregated pair and the disk tier across
    restarts agree on an adapter's blocks, and two adapters never share one.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    lora_digest: bytes = b""  # empty: not computed yet (the id stands in)

    @property
    def identity(self) -> tuple[str, int, str]:
        """What the caller named: equal for the same adapter with or without its digest."""
        return (self.lora_name, self.lora_int_id, self.lora_path)


# ---- core -> executor --------------------------------------------------------------------


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the executor has not seen (or is seeing again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Output tokens generated before a preemption (recomputed as part of the context).
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # One block table per KV cache group (zllm/kv/cache_groups.py); -1 marks a block a
    # sliding-window group released.
    block_ids: list[list[int]]
    num_computed_tokens: int
    # Every id that ends the request (min_tokens bans them); see EngineCoreRequest.
    eos_token_ids: list[int] = []
    # For a child of an `n > 1` request: which sample it is (seeds its generator).
    sample_index: int = 0
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    images: list[PlacedImage] = []  # the vision encoder's inputs (EngineCoreRequest.images)
    # A hybrid model's recurrent-state slot (zllm/kv/state_layout.py); -1: no state layers.
    state_slot: int = -1


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A running request the executor already holds: only what changed."""

    req_id: str
    num_computed_tokens: int
    # Every group's whole block table when one changed this step (new blocks, a copy-on-write,
    # a release), else None.
    block_ids: list[list[int]] | None = None
    # Back after a preemption: its blocks past num_computed_tokens hold nothing of it.
    resumed: bool = False
    # Pipeline parallel: the tokens it got since it was last sent (sampled by the last
    # stage, which holds them already; the earlier stages append them).
    new_token_ids: list[int] = []
    # With block_ids: its recurrent-state slot (a hybrid model's, taken again after a
    # preemption); -1: unchanged, or no state layers.
    state_slot: int = -1


class ForkedRequestData(msgspec.Struct, array_like=True, gc=False):
    """A child sequence of an `n > 1` request: a copy of its parent's state (blocks shared)
    with `first_token_id` as its first output. Applied before anything else in a step."""

    req_id: str
    parent_req_id: str
    sample_index: int
    first_token_id: int
    # The parent's output tokens the child keeps before first_token_id: 0 for an n > 1
    # sample (forked at its first token), the beam's length for a beam-search fork.
    num_parent_outputs: int = 0
    # A hybrid model's: the child's recurrent-state slot, into which the executor copies the
    # parent's state as of the fork (-1: no state layers).
    state_slot: int = -1


class KVTransfers(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's traffic between the KV pool and the tiers below it (KV offload: core/kv/
    connector.py decides, executor/kv/connector.py moves the bytes). Tiers are numbered as
    zllm/kv/tiers.py names them. The executor does them before the step's forward, in this
    order: drops (room), stores (a pool block's bytes out, before anything overwrites it),
    loads (tier bytes into newly allocated pool blocks, some of which the stores just read).
    The core never drops a hash it loads in the same step."""

    drops: list[tuple[int, bytes]] = []  # (tier, block hash): forget it
    stores: list[tuple[int, bytes, int]] = []  # (tier, block hash, pool block id)
    loads: list[tuple[int, bytes, int]] = []  # (tier, block hash, pool block id)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    # Tokens to compute this step per scheduled request, in batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that draw several samples from this step's logits: an `n > 1` request
    # sampling its first token, which the core then forks into its samples. The scheduler
    # decides; the executor draws `num_samples[req_id]` tokens instead of one.
    num_samples: dict[str, int] = {}
    forked_requests: list[ForkedRequestData] = []
    # Speculative decoding: the proposed tokens each request verifies this step (they follow
    # its last known token in num_scheduled_tokens), and whether the executor makes new
    # proposals for the requests that sample (off past disable_by_batch_size).
    spec_token_ids: dict[str, list[int]] = {}
    speculate: bool = False
    # Beam search: the token the core chose to extend each running beam with (the executor
    # appends it; a beam's sampled token is only a candidate). Applied after the forks.
    beam_tokens: dict[str, int] = {}
    # (src, dst) block copies to do before the forward (copy-on-write).
    blocks_to_copy: list[tuple[int, int]] = []
    # A hybrid model's prefix cache (core/kv/state_slots.py StateSnapshots): (snapshot, state
    # slot) copies before the forward, for sequences admitted on a prefix hit; and
    # (req_id, position, snapshot) saves of a sequence's state after `position` tokens,
    # made during the forward.
    state_restores: list[tuple[int, int]] = []
    state_saves: list[tuple[str, int, int]] = []
    # Requests that finished or were aborted since the last step: the executor drops them.
    # (Preempted requests stay known to the executor, keeping their seeded generators.)
    finished_req_ids: list[str] = []
    # The first step after the engine had no request at all: the executor's wait before it
    # was for work, not for the core, and is not counted as idle.
    after_no_work: bool = False
    # Sleep mode (core/engine_core.py): a step with no tokens after which the executor
    # releases its KV pool (sleep_level 1: the weights stay in host memory) or its weights too
    # (2), or before which it restores the parts named (wake_up: SLEEP_TAGS).
    sleep_level: int = 0
    wake_up: list[str] = []
    kv_transfers: KVTransfers | None = None  # KV offload work before the forward
    # Prefill/decode disaggregation, a producer: (block hash, block id) of the prompt blocks
    # this step completes, to send to the consumer once the forward has written them.
    kv_sends: list[tuple[bytes, int]] = []
    # The consumer's data-parallel engine each of kv_sends goes to ([]: a consumer of one
    # engine, all to engine 0).
    kv_send_engines: list[int] = []


# ---- executor -> core --------------------------------------------------------------------


class CacheSize(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One cache that is meant to grow (issue 56): the process holding it, its name, the
    entries it holds now and its bound (None: it has none). /metrics shows them as
    zllm:cache_entries / zllm:cache_capacity (docs/observability.md lists each cache and
    where its bound is set)."""

    process: str
    cache: str
    entries: int = 0
    capacity: int | None = None


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    # Requests that sampled this step, and their new tokens (n tokens for a request forking).
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per sampled request (same order), when it asked for logprobs; None elsewhere. A request
    # that verified proposals gets the accepted ones and one more token, a row each.
    logprobs: list[LogprobsLists | None] = []
    # Speculative decoding, per sampled request (same order): tokens proposed for its next
    # step; empty when none (or when the step did not speculate).
    draft_token_ids: list[list[int]] = []
    # Embeddings requests whose prompt this step finished: their pooled vectors (no token).
    pooled: dict[str, list[float]] = {}
    # Requests the executor could not run (a LoRA adapter whose files went away since it was
    # checked), with why: the core fails them (finish "error"); the others go on.
    failed: dict[str, str] = {}
    prompt_logprobs: dict[str, LogprobsLists] = {}
    # KV offload: (tier, block hash) of loads that failed (a missing or corrupt disk block);
    # the executor recomputed those blocks in the step instead (or no request read them: a
    # prefetch), the core forgets them. With pipeline stages: every stage's, the union.
    kv_load_failed: list[tuple[int, bytes]] = []
    # Where the step's time went: input and attention metadata preparation, the model forward,
    # logits + sampling + output (ModelRunner); the time the step alone held the executor
    # (launch to finish, less what overlapped the step before: executor/async_steps.py) and,
    # in the executor process, the wait for it before.
    prepare_time_s: float = 0.0
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0
    exec_time_s: float = 0.0
    idle_time_s: float = 0.0
    # The asynchronous executor launched this step before the one ahead of it had finished.
    overlapped: bool = False
    # On a GPU: how long it idled between the previous step's last kernel and this step's
    # first (CUDA events), the executor's own Python between steps included.
    gpu_idle_time_s: float = 0.0
    # Pipeline parallel, per stage: seconds it waited (for the step, and for the stage before)
    # and worked on this step (empty on one stage).
    stage_idle_s: list[float] = []
    stage_busy_s: list[float] = []
    # The executor's bounded caches (compiled grammars, loaded LoRA adapters), only when their
    # sizes changed since the output before (None: unchanged); the core's heartbeat carries
    # the latest to /metrics (EngineStats.caches).
    cache_sizes: list[CacheSize] | None = None


# ---- core -> the rest ----------------------------------------------------------------------


class RequestTiming(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """When a traced request (--otlp-traces-endpoint) passed each stage, stamped by the process
    that saw it, as wall-clock seconds (`time.time()`: the processes share the host's clock;
    0.0: not reached). Only a traced request carries one (the frontend creates it empty), so
    an untraced request costs nothing. It travels with the request: TokenizeRequest ->
    EngineCoreRequest -> the core's first output of sample 0 -> the detokenizer, which sends
    it with the request's final delta; the frontend turns it into spans
    (frontend/observability/tracing.py)."""

    tokenize_start: float = 0.0  # the tokenizer took the request
    tokenize_end: float = 0.0  # ... and sent it to the core
    core_arrival: float = 0.0  # the core took it (its queue begins)
    scheduled: float = 0.0  # first scheduled (its prefill begins)
    first_token: float = 0.0  # the core built its first output (the prefill's end)
    detokenize_start: float = 0.0  # the detokenizer took its first output
    last_output: float = 0.0  # ... took its last one (the decode's end)
    detokenize_end: float = 0.0  # ... sent its final delta


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str  # the client's request id
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time_s: float = 0.0  # arrival to first scheduled, on a request's first output
    embedding: list[float] | None = None  # an embeddings request's answer
    cumulative_logprob: float | None = None  # a beam-search hypothesis' (all its tokens)
    timing: RequestTiming | None = None  # a traced request's, on sample 0's first output


class CachePin(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Prefix pinning (a request's `cache_control`): keep the KV blocks of the prompt's first
    `num_tokens` tokens in the pool for `ttl_s` seconds after the request computes them, so a
    long system prompt survives eviction. The frontend says how much of the prompt (all of
    it, or the first `num_messages` chat messages: Anthropic's last cache_control block);
    the tokenizer resolves that to `num_tokens` (-1: not resolved yet, the whole prompt)."""

    ttl_s: float
    num_tokens: int = -1
    num_messages: int = -1  # chat: the prefix ends after this many messages (-1: all)


class KVTransferParams(msgspec.Struct, omit_defaults=True, gc=False):
    """A request's part in prefill/decode disaggregation (vLLM's `kv_transfer_params`, set by
    `zllm proxy`; zllm/config/kv_transfer.py): a producer sends the KV of a request marked
    do_remote_decode; a consumer waits for the KV of one marked do_remote_prefill."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False


class RequestOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """A request's own engine options: decided once where it enters (a frontend route and
    the gate, LLM.generate, AsyncLLM.generate), carried whole to the core's `Request`, read
    only where each is used; the core checks them in one place (`check_request_options`).
    A new per-request option is a field here, the API field that sets it, and its reader."""

    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    priority: int = 0  # --scheduling-policy priority: lower first
    tenant: str = DEFAULT_TENANT  # who it is for (zllm/config/tenants.py): fair share, metrics
    # Keep its prompt's prefix cached for a while (the tokenizer resolves num_tokens).
    cache_pin: CachePin | None = None
    kv_transfer: KVTransferParams | None = None  # prefill/decode disaggregation
    # vLLM's `cache_salt`: its KV blocks are shared only with requests of the same salt
    # (zllm/kv/block_hash.py cache_salt).
    cache_salt: str | None = None
    # --prefix-cache-isolation tenant: its blocks are salted by its tenant too, so they are
    # shared only within the tenant (and no tenant sees another's prefixes through TTFT).
    isolate_tenant_cache: bool = False


NO_OPTIONS = RequestOptions()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=1):
    """A tokenized request, as it enters the core."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    # Every id that ends generation unless ignore_eos (finish "stop", stop_reason None): the
    # tokenizer's EOS first, then the rest the model declares (ModelArchConfig.eos_token_ids).
    eos_token_ids: list[int] = []
    # Which client (a frontend process, or an AsyncLLM) sent it: when that client dies,
    # the core aborts its requests (`ClientGone`).
    client_id: int = 0
    options: RequestOptions = NO_OPTIONS
    timing: RequestTiming | None = None  # traced: the tokenizer's stamps so far
    images: list[PlacedImage] = []  # its images, where their tokens sit in the prompt


# ==== the serving processes ==================================================================
#
#   frontend ──TokenizeRequest──► tokenizer ×N ──EngineCoreRequest──► core ◄──► executor
#      ▲  │                            │                               │
#      │  └──AbortRequests─────────────┼──────────────────────────────►│
#      │◄────────RequestRejected───────┘                               │ DetokenizerBatch
#      │◄──FrontendBatch── detokenizer ×M ◄────────────────────────────┘ (crc32(req_id) % M)
#      │                        └──FinishSequence (stop string)──► core
#      │◄──EngineStats (heartbeat thread of the core; to the supervisor too)
#      │◄──ProcessEvent, EngineLifecycle (supervisor)     supervisor ──ClientGone──► core
#
# With --data-parallel-size N there are N cores (each with its executor): the tokenizer picks
# one per request and tells the frontend (RequestRouted); each core publishes its heartbeat
# and KVCacheEvents to the tokenizers (PUB/SUB), which route by them.
#
# Sockets that carry several kinds decode a tagged union (the tag is the first array item).


class ImageData(msgspec.Struct, array_like=True, gc=False):
    """An image a request brings, checked in the frontend (zllm/media/images.py): its encoded
    bytes as sent (PNG, JPEG, ...), its size, and its identity for caches (a hash of its
    decoded pixels)."""

    data: bytes
    width: int
    height: int
    digest: str


class PlacedImage(msgspec.Struct, array_like=True, gc=False):
    """An image and the run of placeholder tokens its features replace in the prompt (where
    the model's image tokens attend to each other both ways, Gemma 3's, all `length` of them
    are computed in one step: core/request.py chunk_end)."""

    image: ImageData
    offset: int  # its first token's position in the prompt
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class TokenizeRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Frontend -> tokenizer: a request as the client sent it (text, chat or token ids)."""

    req_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # Chat messages as the template sees them (an assistant turn may carry tool_calls).
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # the request's tools, for the chat template
    add_generation_prompt: bool = True
    chat_template: str | None = None
    add_special_tokens: bool = True
    arrival_time: float = 0.0
    client_id: int = 0  # the sending client's process id (see EngineCoreRequest)
    options: RequestOptions = NO_OPTIONS
    # Extra template variables (zllm/text/template_kwargs.py), the server's defaults merged.
    chat_template_kwargs: dict[str, Any] | None = None
    # The last message left open for the model to continue (zllm/text/continue_final.py).
    continue_final_message: bool = False
    timing: RequestTiming | None = None  # set (empty) when the request is traced
    images: list[ImageData] | None = None  # in the order the prompt holds them


class AbortRequests(msgspec.Struct, array_like=True, gc=False, tag=2):
    """Anyone -> core: drop these client requests (idempotent)."""

    req_ids: list[str]


class FinishSequence(msgspec.Struct, array_like=True, gc=False, tag=3):
    """Detokenizer -> core: a stop string ended one sample; free its blocks."""

    req_id: str
    sample_index: int


class ClientGone(msgspec.Struct, array_like=True, gc=False, tag=10):
    """Supervisor -> core: a frontend died; abort every request it sent (nobody reads them)."""

    client_id: int


# What sleep mode releases and wake_up restores, by the names vLLM's /wake_up?tags= takes.
SLEEP_TAGS = ("weights", "kv_cache")


class SleepControl(msgspec.Struct, array_like=True, gc=False, tag=12):
    """Frontend -> core: POST /sleep or /wake_up (sleep mode); answered by a SleepReply
    naming the same `reply_to`."""

    command: str  # "sleep" or "wake_up"
    reply_to: int
    level: int = 1  # sleep: 1 releases the KV pool, 2 the weights too
    tags: list[str] = []  # wake_up: the parts to restore (SLEEP_TAGS); none: all


class SleepReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=13):
    """Core -> frontend: whether the SleepControl was carried out, and the engine's state."""

    reply_to: int
    ok: bool
    asleep: bool
    message: str = ""


class ResetPrefixCache(msgspec.Struct, array_like=True, gc=False, tag=17):
    """Frontend -> core: POST /reset_prefix_cache; answered by a PrefixCacheReset naming the
    same `reply_to`. `tiers`: the KV offload tiers (cpu, disk) are emptied too."""

    reply_to: int
    tiers: bool = False


class PrefixCacheReset(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=18):
    """Core -> frontend: what a ResetPrefixCache dropped. `blocks_dropped`: cached pool blocks
    no running request held (pinned ones included: a reset releases pins);
    `tier_blocks_dropped`: per tier (cpu, disk, remote: zllm/kv/tiers.py), the blocks it held."""

    reply_to: int
    blocks_dropped: int = 0
    tier_blocks_dropped: list[int] = []


class KVBlocksHeader(msgspec.Struct, omit_defaults=True, gc=False):
    """Producer executor -> consumer executor (prefill/decode disaggregation): the first frame
    of a message of KV blocks. Their bytes, [len(hashes), *block_shape] of `dtype`, follow as
    the second frame, or (transport "shm") are in /dev/shm/<shm_file>, which the consumer
    deletes. `layout` names the model and KV layout (executor/kv/transfer.py)."""

    hashes: list[bytes]
    layout: str
    dtype: str
    block_shape: list[int]
    shm_file: str = ""


class KVRejection(enum.IntEnum):
    """Why a consumer refused blocks a producer sent (the `reason` label of
    zllm:kv_transfer_rejected_blocks_total; the index into KVTransferStats.rejected_blocks)."""

    LAYOUT = 0  # another model, other weights or another KV layout: the pair is misconfigured
    INVALID = 1  # a malformed message, or a shared-memory file it may not or cannot read

    def __str__(self) -> str:
        return self.name.lower()


class KVBlocksReceived(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=16):
    """Executor -> core (prefill/decode disaggregation, a consumer): block hashes whose KV
    arrived from a producer into the executor's buffer, and those it dropped to make room.
    `rank`: the executor rank (stage x tensor-parallel size + tensor-parallel rank) whose
    buffer (its part of each block) this is; the core holds a block once every rank of
    every stage has its part. `rejected`: blocks of a message it refused, for `rejection`
    (counted only: the core never hears of their hashes)."""

    stored: list[bytes] = []
    removed: list[bytes] = []
    rank: int = 0  # (last, with a default: a message of one rank decodes as before)
    rejected: int = 0
    rejection: KVRejection = KVRejection.LAYOUT


CoreInput = (
    EngineCoreRequest
    | AbortRequests
    | FinishSequence
    | ClientGone
    | SleepControl
    | KVBlocksReceived
    | ResetPrefixCache
)


# Prompt tokens an incremental detokenizer is primed with, so the first output token decodes
# with the right leading space (the core sends this many; the detokenizer uses them).
PROMPT_TAIL_TOKENS = 6


class DetokRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What a detokenizer needs to know of a request, sent once before its first tokens."""

    req_id: str
    prompt_tail: list[int]  # the last PROMPT_TAIL_TOKENS prompt tokens
    n: int = 1
    stop: list[str] = []
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    want_logprobs: bool = False


class DetokenizerBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=4):
    """Core -> one detokenizer worker: one step's outputs for the requests it owns.

    Applied in field order: `reset`, then `new_requests`, `outputs`, and `aborted`."""

    new_requests: list[DetokRequest] = []
    outputs: list[EngineCoreOutput] = []
    # Requests aborted in the core after their first output: drop their state.
    aborted: list[str] = []
    # The engine restarted: forget every request it sent (they were failed upstream).
    reset: bool = False
    # The data-parallel replica (engine index) that sent it: a reset forgets only that
    # replica's requests, and stop strings found go back to its core.
    engine: int = 0


class RequestOutputDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Detokenizer -> frontend: what one sample of a request produced since last time."""

    req_id: str
    index: int
    text: str
    token_ids: list[int]
    # Chosen token first then the top-k, with each token's text.
    logprobs: LogprobsLists | None = None
    logprob_tokens: list[list[str]] | None = None
    prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time_s: float = 0.0
    embedding: list[float] | None = None
    cumulative_logprob: float | None = None
    timing: RequestTiming | None = None  # a traced request's, on its final delta


class FrontendBatch(msgspec.Struct, array_like=True, gc=False, tag=5):
    outputs: list[RequestOutputDelta]


class RequestRejected(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=6):
    """Tokenizer or core -> frontend: this request cannot run; an HTTP status and a message."""

    req_id: str
    message: str
    status: int = 400
    param: str | None = None
    # A ContextOverflow's (input tokens, max_tokens, context length): zllm/errors.py.
    context_overflow: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, req_id: str, error: ParamError) -> RequestRejected:
        """A 400 for `error`, its context numbers carried when it is a ContextOverflow."""
        numbers = error.numbers if isinstance(error, ContextOverflow) else None
        return cls(req_id, str(error), 400, error.param, numbers)


# The most cells KVPoolStats.block_states folds the KV pool into (the dashboard's grid).
MAX_BLOCK_CELLS = 4096


class TenantStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One tenant's share of the engine (EngineStats.tenants): its sequences running and
    waiting now, and since the engine started the requests it sent, the tokens the engine
    computed for it (prompt chunks and decodes: what fair share weighs), the tokens it
    generated, and its sequences preempted."""

    name: str
    weight: float = 1.0
    num_running: int = 0
    num_waiting: int = 0
    num_requests: int = 0
    num_computed_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0


class SpecDecodeStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Speculative decoding (vLLM's vllm:spec_decode_*): request steps that verified
    proposals, proposed and accepted tokens, and accepted tokens by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []


class LoRAStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """LoRA (vLLM's vllm:lora_requests_info): the adapters running and waiting requests
    use, and --max-loras."""

    running_adapters: list[str] = []
    waiting_adapters: list[str] = []
    max_lora: int = 0


class KVTierStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """KV offload, one entry per tier in zllm/kv/tiers.py's order: prompt tokens loaded
    from it, blocks stored into it, loads that failed (recomputed), blocks it holds now and
    its capacity in blocks (0: the tier is off)."""

    hits: list[int] = []
    stores: list[int] = []
    load_failures: list[int] = []
    blocks: list[int] = []
    capacity: list[int] = []


class KVTransferStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Prefill/decode disaggregation (--kv-transfer-config): this engine's role, prompt
    blocks a producer had its executor send, requests a consumer admitted without all
    of their blocks (wait_timeout_s passed: it computed the rest), and blocks it refused."""

    role: str = ""
    sent_blocks: int = 0
    wait_timeouts: int = 0
    # Blocks a consumer's executor ranks refused, by KVRejection (each rank's part counts).
    rejected_blocks: list[int] = []


class PinStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Prefix pinning: blocks pinned now, and the most that may be (--max-pinned-bytes)."""

    pinned_blocks: int = 0
    max_pinned_blocks: int = 0


class StageStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Pipeline parallel: ModelRunnerOutput.stage_idle_s / stage_busy_s, summed per stage."""

    idle_s: list[float] = []
    busy_s: list[float] = []


class EngineStatus(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Which engine sent the heartbeat, when, and whether it sleeps."""

    engine_index: int = 0  # the data-parallel replica whose core sent it
    time: float = 0.0  # wall clock when sent
    asleep: bool = False  # sleep mode: weights and KV pool released


class SchedulerLoad(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The scheduler's queues now, and the requests it preempted since the engine started."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0


class TokenCounts(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Tokens since the engine started: of the prompts it admitted, and generated."""

    prompt: int = 0
    generated: int = 0


class PrefixCacheStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Prompt tokens looked up in the prefix cache since the engine started, and found."""

    queries: int = 0
    hits: int = 0


class StepTimings(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The steps since the engine started and where their time went, summed."""

    count: int = 0
    overlapped: int = 0  # steps launched before the one ahead had finished
    executor_busy_s: float = 0.0
    executor_idle_s: float = 0.0
    executor_prepare_s: float = 0.0
    executor_forward_s: float = 0.0
    executor_sample_s: float = 0.0
    gpu_idle_s: float = 0.0  # ModelRunnerOutput.gpu_idle_time_s, summed (0 on CPU)
    core_schedule_s: float = 0.0  # in Scheduler.schedule
    core_output_s: float = 0.0  # applying a step's output: stops, publishing, freeing


class KVPoolStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The KV pool: its size, what is free and in use now, and a picture of it."""

    num_blocks: int = 0
    num_free_blocks: int = 0
    usage: float = 0.0  # the share of blocks held by requests (1 = full)
    block_bytes: int = 0  # the bytes of one block (all its layers)
    # KV slots held by running requests and those holding computed tokens, summed over
    # steps (their ratio is the share of allocated KV memory that sat unused).
    slots_allocated: int = 0
    slots_used: int = 0
    # For the dashboard, one byte per cell: 0 free, 1 in use, 2 cached prefix (free but
    # holding a reusable prefix). Large pools are folded into MAX_BLOCK_CELLS cells, each
    # showing the busiest state among its blocks; `blocks_per_cell` says how many.
    block_states: bytes = b""
    blocks_per_cell: int = 1


class EngineStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=7):
    """The engine's live statistics: `EngineCore` keeps one and updates it in place; the core
    process's heartbeat thread sends it every 0.5 s, whatever a step costs, to the frontend
    (metrics, dashboard, /health) and the supervisor (hang detection). Every field is a
    section: the engine-wide ones always there, a feature's None while the feature is off;
    each is filled by its owner and merged across engines by its own rule
    (zllm/runtime/engine_stats.py)."""

    # ---- engine-wide sections -------------------------------------------------------------
    status: EngineStatus = msgspec.field(default_factory=EngineStatus)
    load: SchedulerLoad = msgspec.field(default_factory=SchedulerLoad)
    tokens: TokenCounts = msgspec.field(default_factory=TokenCounts)
    prefix_cache: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    steps: StepTimings = msgspec.field(default_factory=StepTimings)
    kv_pool: KVPoolStats = msgspec.field(default_factory=KVPoolStats)
    # ---- sections, one per feature --------------------------------------------------------
    pins: PinStats = msgspec.field(default_factory=PinStats)
    # Per tenant (zllm/config/tenants.py), every tenant the core remembers (core/fair_share.py).
    tenants: list[TenantStats] = []
    spec: SpecDecodeStats | None = None
    lora: LoRAStats | None = None
    kv_tiers: KVTierStats | None = None
    kv_transfer: KVTransferStats | None = None
    stages: StageStats | None = None
    # Every bounded cache of the core and its executor (the executor's once it ran a step).
    caches: list[CacheSize] = []


class ProcessEvent(msgspec.Struct, array_like=True, gc=False, tag=8):
    """Supervisor -> frontend: a child process came up or went down."""

    role: ProcessRole
    index: int
    alive: bool
    pid: int = 0
    engine: int = 0  # a core's or executor rank's data-parallel replica


class EngineLifecycle(msgspec.Struct, array_like=True, gc=False, tag=9):
    """Supervisor -> frontend: an engine (one data-parallel replica: a core and its executor
    ranks) became ready, or died (with why)."""

    state: EngineState
    message: str = ""
    engine: int = 0


class RequestRouted(msgspec.Struct, array_like=True, gc=False, tag=14):
    """Tokenizer -> frontend, with several data-parallel replicas: the replica a request was
    sent to (if that replica dies, the frontend fails the request with a 503)."""

    req_id: str
    engine: int


FrontendInput = (
    FrontendBatch
    | RequestRejected
    | EngineStats
    | ProcessEvent
    | EngineLifecycle
    | SleepReply
    | RequestRouted
    | PrefixCacheReset
)


class KVCacheEvents(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=15):
    """Core -> tokenizer workers (PUB/SUB), with several data-parallel replicas: the block
    hashes the replica's prefix cache gained and lost since its last message, so the
    tokenizers can route a prompt to the replica that holds its prefix. A SUB socket may
    drop messages: the view they build is a routing hint, never a correctness input."""

    engine: int
    stored: list[bytes] = []
    removed: list[bytes] = []
    cleared: bool = False  # applied first: the replica's cache was emptied (a restart)


# What a tokenizer worker subscribes to from every core: its heartbeat and its KV events.
RouterInput = EngineStats | KVCacheEvents


class ProcessReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=11):
    """Child -> supervisor: started and ready (the executor also reports the KV pool size)."""

    role: ProcessRole
    index: int
    pid: int
    num_blocks: int = 0
    engine: int = 0  # a core's or executor rank's data-parallel replica


SupervisorInput = ProcessReady | EngineStats
