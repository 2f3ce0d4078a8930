"""The core's record of one sequence being generated."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

import msgspec

from zllm.kv.block_hash import with_image_words
from zllm.lora import LoRARequest
from zllm.protocol import (
    NO_OPTIONS,
    CachePin,
    FinishReason,
    KVTransferParams,
    LogprobsLists,
    PlacedImage,
    RequestOptions,
    RequestTiming,
)
from zllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class _RequestFields:
    """`Request`'s fields and constructor, in a class of their own: the constructor takes
    the per-request options under the names `Request` reads them back by (`lora`,
    `priority`, ...), and a dataclass keeps an InitVar's default as a class attribute, which
    would hide a property of that name written in the same class."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)  # EngineCoreRequest.eos_token_ids
    arrival_time: float = 0.0
    client_req_id: str = ""
    sample_index: int = 0
    client_id: int = 0  # the process that sent it (EngineCoreRequest.client_id)
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt + output, kept as one list so block hashing needs no concatenation.
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens the executor is sampling in steps already sent but not yet returned. With the
    # core scheduling step N+1 while the executor runs step N, a request can be scheduled
    # to compute a token whose id the core does not know yet; the executor has it.
    num_pending_tokens: int = 0
    # Steps sent with this request that have not returned yet (pipeline parallel holds a
    # request until none is out), and the id of the step being built when it was last
    # preempted (what a step scheduled before that returns for it is stale).
    num_steps_in_flight: int = 0
    preempted_at_step: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache (-1: not yet looked)
    first_scheduled_time: float | None = None  # wall clock, like arrival_time
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Whether the executor holds this request's state (cleared on preemption).
    known_to_executor: bool = False
    # Pipeline parallel: how many of its tokens the executor's earlier stages hold (the last
    # stage samples them; the others get them with the request's next step).
    num_tokens_sent: int = 0
    # Speculative decoding: tokens the executor proposed after this request's last step,
    # to be verified in its next one (dropped if that step cannot take them).
    spec_token_ids: list[int] = field(default_factory=list)
    # A step verifying proposals of this request is in flight: it is not scheduled again
    # until that step says how many were accepted.
    verifying: bool = False
    # Prompt logprobs gathered over the prefill chunks, sent when the prompt is done.
    prompt_logprobs: LogprobsLists | None = None
    # Its own options, as the client gave them (read as .lora, .priority, .tenant,
    # .cache_pin with num_tokens resolved, .kv_transfer: Request's properties).
    options: RequestOptions = NO_OPTIONS
    # A traced request's stage times (--otlp-traces-endpoint), sent on its first output; a
    # fork (another sample) has none.
    timing: RequestTiming | None = None
    # Prefix pinning: whether its blocks were pinned already.
    pinned: bool = False
    # Prefill/decode disaggregation (zllm/config/kv_transfer.py): whether its prompt's
    # blocks were sent (a producer), and until when it waits for them (a consumer;
    # time.monotonic()).
    kv_sent: bool = False
    remote_kv_deadline: float | None = None
    # False when the executor never computed its blocks (it could not run it): freeing it
    # then drops its blocks' prefix-cache hashes instead of keeping them for later hits.
    computed: bool = True
    # The hash chain of its prompt's full blocks (those a prefix hit can take), kept while
    # a disaggregation consumer's request waits for them so it is hashed once, not per step.
    prompt_block_hashes: list[bytes] | None = None
    # Several KV cache groups: the tokens of the blocks it took from a tier whose loads can
    # fail (disk, remote) in a step ahead of its own (core/kv/prefetch.py) that loaded
    # well; None while it never did (it does at most once: later lookups skip those tiers).
    num_prefetched_tokens: int | None = None
    # Its images and where their tokens sit (EngineCoreRequest.images): their tokens hash as
    # their image (`block_token_ids`) and, where they attend to each other both ways
    # (`whole_images`: the model's family's BIDIRECTIONAL_IMAGES trait), each image's are
    # computed in one step (`chunk_end`).
    images: list[PlacedImage] = field(default_factory=list)
    whole_images: bool = False
    # An encoder's prompt (its family's ENCODER trait): its tokens attend to each other both
    # ways, so the whole prompt is computed in one step (`chunk_end`).
    whole_prompt: bool = False
    _image_words: list[int] | None = field(default=None, repr=False)
    # Shorthands that build `options` where the core makes a Request itself (a fork, tests).
    lora: InitVar[LoRARequest | None] = None
    priority: InitVar[int | None] = None
    tenant: InitVar[str | None] = None
    cache_pin: InitVar[CachePin | None] = None
    kv_transfer: InitVar[KVTransferParams | None] = None

    def __post_init__(
        self,
        lora: LoRARequest | None,
        priority: int | None,
        tenant: str | None,
        cache_pin: CachePin | None,
        kv_transfer: KVTransferParams | None,
    ) -> None:
        given = dict(
            lora=lora,
            priority=priority,
            tenant=tenant,
            cache_pin=cache_pin,
            kv_transfer=kv_transfer,
        )
        given = {name: value for name, value in given.items() if value is not None}
        if given:
            self.options = msgspec.structs.replace(self.options, **given)
        if not self.client_req_id:
            self.client_req_id = self.req_id
        if not self.all_token_ids:
            self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        if self.images:
            self._image_words = with_image_words(self.all_token_ids, self.images)


class Request(_RequestFields):
    """One sequence. An `n > 1` request starts as one and forks into `n` after its prompt.

    `req_id` is unique inside the core; `client_req_id` and `sample_index` say which
    completion of which client request it produces.
    """

    __slots__ = ()

    # Its options, read as its own attributes: the scheduler, fair share, the block manager
    # and the KV connector read `request.tenant`, `request.lora`, ...
    @property
    def lora(self) -> LoRARequest | None:
        return self.options.lora

    @property
    def priority(self) -> int:
        return self.options.priority

    @property
    def tenant(self) -> str:
        return self.options.tenant

    @property
    def cache_pin(self) -> CachePin | None:
        return self.options.cache_pin

    @property
    def kv_transfer(self) -> KVTransferParams | None:
        return self.options.kv_transfer

    @property
    def block_token_ids(self) -> list[int]:
        """The tokens as the prefix cache names its blocks by them: all_token_ids, with an
        image's tokens as words of its pixel digest (zllm/kv/block_hash.py)."""
        return self.all_token_ids if self._image_words is None else self._image_words

    @property
    def priority_key(self) -> tuple[int, float]:
        """The priority policy's order: priority, then arrival (earlier first)."""
        return (self.priority, self.arrival_time)

    @property
    def lora_int_id(self) -> int | None:
        return None if self.lora is None else self.lora.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def waits_to_fork(self) -> bool:
        """An `n > 1` request that has not yet sampled its first tokens (beam search forks
        its own way)."""
        params = self.sampling_params
        return (
            params.n > 1
            and not params.use_beam_search
            and self.sample_index == 0
            and not self.output_token_ids
        )

    @property
    def num_seqs_to_run(self) -> int:
        """The sequences of the batch (max_num_seqs) this request holds once it runs: an
        `n > 1` request forks its samples right after its prompt, a beam search's first beam
        forks into `beam_width` beams after its first step; anything else is one. Admission
        counts them all, as vLLM counts a sequence group's."""
        params = self.sampling_params
        if self.waits_to_fork:
            return params.n
        if params.use_beam_search and self.sample_index == 0 and not self.output_token_ids:
            return params.num_beams
        return 1

    def fork(
        self,
        req_id: str,
        *,
        sample_index: int,
        output_token_ids: list[int],
        num_computed_tokens: int,
        status: RequestStatus,
    ) -> Request:
        """Another sequence of the same client request (an `n > 1` sample, a beam): the
        prompt, who asked and its per-request options are copied here, in one place; its
        progress is the caller's. The pin and the KV transfer stay with the parent (done
        once per prompt)."""
        return Request(
            req_id=req_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=self.arrival_time,
            client_req_id=self.client_req_id,
            sample_index=sample_index,
            client_id=self.client_id,
            output_token_ids=output_token_ids,
            options=msgspec.structs.replace(self.options, cache_pin=None, kv_transfer=None),
            images=self.images,
            whole_images=self.whole_images,
            num_computed_tokens=num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            status=status,
        )

    def chunk_end(
        self, start: int, num_new: int, encoder_budget: int | None = None, fresh: bool = True
    ) -> int:
        """How many of `num_new` tokens from `start` one step may compute: all, unless that
        would end an encoder's prompt before its end (`whole_prompt`: 0), or the chunk inside
        an image whose tokens attend to each other both ways
        (`whole_images`: then up to the image's start; 0 when the chunk starts inside the
        image and cannot reach its end), or would start images whose encoder tokens pass
        `encoder_budget` (what the step's encoder may still take; None: no limit): then up
        to the first image that does not fit. The first image of a step whose encoder has
        started nothing yet (`fresh`) always fits, however large, so no image waits forever."""
        end = start + num_new
        if self.whole_prompt and end < len(self.prompt_token_ids):
            return 0  # (a step with room for all of it takes it)
        spent = 0
        for image in self.images:
            if image.offset >= end:
                break
            if self.whole_images and image.offset < end < image.end:
                return max(0, image.offset - start)
            if image.offset >= start and encoder_budget is not None:
                alone = fresh and spent == 0
                if spent + image.length > encoder_budget and not alone:
                    return image.offset - start
                spent += image.length
        return num_new

    def encoder_tokens(self, start: int, num_new: int) -> int:
        """The encoder tokens of the images a chunk of `num_new` tokens from `start` starts
        (an image the chunk resumes inside its tokens reads the encoder's cache, which holds
        at least a step's worth of images: executor/models/vision/features.py)."""
        end = start + num_new
        return sum(i.length for i in self.images if start <= i.offset < end)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self._image_words is not None:
            self._image_words.append(token_id)


def child_request_id(parent_req_id: str, sample_index: int, is_taken: Callable[[str], bool]) -> str:
    """The id of sample `sample_index` (>= 1) of an `n > 1` request; sample 0 is the request
    itself. `<parent>#<index>`, made longer until no request or sample here holds it: client
    ids are free-form, so "a" forking must not collide with a client request named "a#1"."""
    req_id = f"{parent_req_id}#{sample_index}"
    while is_taken(req_id):
        req_id += "#"
    return req_id
