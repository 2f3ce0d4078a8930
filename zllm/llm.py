"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM.

Runs the same pieces as the server, in this process: the `EngineCore` (scheduler, block
manager and the step loop, `EngineCore.step`), an in-process executor in place of the
executor process (executor/offline.py: a `ModelRunner` here, and with several ranks the
processes of the others), and a `Detokenizer` in place of the detokenizer workers. Thousands
of prompts stream through continuous batching (requests join and leave the batch every
step), not padded batches.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from zllm.config.engine import check_cache_salt, check_priority, sleep_refusal
from zllm.config.engine_args import EngineArgs
from zllm.core.engine_core import EngineCore
from zllm.detokenizer_proc.detokenizer import Detokenizer
from zllm.errors import ParamError
from zllm.kv.cache_control import MAX_PIN_TTL_S
from zllm.kv.state_layout import num_state_slots
from zllm.llm_pooling import PoolingCalls
from zllm.lora import LoRARequest, read_adapter, with_digest
from zllm.media import offline as offline_media
from zllm.media.placeholders import model_placeholders
from zllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)
from zllm.protocol import (
    NO_OPTIONS,
    CachePin,
    DetokenizerBatch,
    EngineCoreRequest,
    LogprobsLists,
    RequestOptions,
    RequestOutputDelta,
    TokenizeRequest,
)
from zllm.sampling_params import BeamSearchParams, SamplingParams
from zllm.text.template_kwargs import merge_template_kwargs
from zllm.text.tokenizer import Tokenizer, load_tokenizer
from zllm.tokenizer_proc.request_tokenizer import RequestTokenizer

PromptType = str | dict[str, Any]


@dataclass(frozen=True, slots=True)
class _ChatPrompt:
    """One conversation of `LLM.chat`: rendered and checked as the server does a chat
    request (so its errors name the messages, as the server's do)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any] | None


_Prompt = PromptType | _ChatPrompt


class LLM(PoolingCalls):
    """An LLM engine in this process.

    `model`: a short name (`smollm2`, the default), a `.gguf` file, a Hugging Face-layout
    directory (config.json + *.safetensors + tokenizer.json), or a Hugging Face Hub id
    (`org/name`, `org/name:Q4_K_M`, `org/name/file.gguf`; with `revision=` and
    `download_dir=`). Other keywords follow vLLM's engine arguments (`tokenizer`,
    `max_model_len`, `max_num_seqs`, `max_num_batched_tokens`, `block_size`,
    `kv_cache_memory_bytes`, `enable_prefix_caching`, `seed`, `dtype`, `generation_config`,
    `speculative_config`, ...).
    """

    def __init__(self, model: str | None = None, *, chat_template: str | None = None, **kwargs):
        args = EngineArgs(model=model, **kwargs)
        self.config = args.create_engine_config()
        if self.config.kv_transfer is not None:
            raise ValueError(
                "kv_transfer_config is for served engines (zllm serve with "
                "--kv-transfer-config, behind zllm proxy), not the offline LLM"
            )
        if self.config.distributed_executor_backend != "mp":
            raise ValueError(
                "the offline LLM starts its ranks as processes (distributed_executor_backend "
                "mp); Ray actors serve through zllm serve --distributed-executor-backend ray"
            )
        self.tokenizer: Tokenizer = load_tokenizer(self.config.tokenizer_path, chat_template)
        from zllm.executor.offline import start_offline_executor  # torch lives behind this

        # With N ranks (tensor x pipeline parallel): rank 0 here, ranks 1..N-1 in processes
        # it feeds (stopped when this LLM is collected, or at exit).
        self.executor = start_offline_executor(self.config)
        self.engine = EngineCore(self.config)
        # The tokenizer worker's own code builds and checks each prompt, so a bad one gets
        # the served message. No max_new_tokens: here the model's max_tokens default comes
        # with get_default_sampling_params (as vLLM's LLM), and max_tokens=None means "as
        # many as fit".
        self.request_tokenizer = RequestTokenizer(
            self.tokenizer,
            self.engine.max_model_len,
            self.config.arch.vocab_size,
            self.config.arch.eos_token_ids,
            placeholders=model_placeholders(
                self.config.model_path, self.config.arch.vision, self.tokenizer.token_text
            ),
            embed_prompt=self.config.pooler.prompt,
            pooling_only=self.config.runner == "pooling",
            state_slots=num_state_slots(self.config.arch, self.config.scheduler.max_num_seqs),
        )
        # What the tokenizer worker adds to a served request: the ids that end generation.
        self.eos_token_ids = self.request_tokenizer.eos_token_ids
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()
        self._adapters: dict[int, LoRARequest] = {}  # LoRA: each id's adapter, checked

    @property
    def model_runner(self):
        """Rank 0's ModelRunner (in this process)."""
        return self.executor.runner

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: zllm's defaults
        under the model's generation_config.json (unless `generation_config="vllm"`)."""
        return SamplingParams(**self.config.generation_config.defaults.overrides())

    # ---- public API ------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        pin_prefix_s: float | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the adapter all prompts run with, or one per prompt (None: the
        base model); needs `LLM(..., enable_lora=True)`. `priority`: one per prompt, lower
        first; needs `LLM(..., scheduling_policy="priority")`. `pin_prefix_s`: keep each
        prompt's KV blocks cached for this many seconds after it is computed (prefix
        pinning, within `max_pinned_bytes`), as a served request's `cache_control` does."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        return self._generate(
            prompts, sampling_params, use_tqdm, lora_request, priority, pin_prefix_s
        )

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """`chat_template_kwargs`: extra template variables, as vLLM's (e.g.
        {"enable_thinking": False}); the names the template already gets are refused.
        `continue_final_message`: the last message is left open for the model to go on
        with (needs add_generation_prompt=False), as vLLM's."""
        conversations: list[Any] = list(messages)
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        kwargs = merge_template_kwargs(None, chat_template_kwargs) or None
        prompts: list[_Prompt] = [
            _ChatPrompt(conv, add_generation_prompt, continue_final_message, kwargs)
            for conv in conversations
        ]
        return self._generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (core/beam_search.py): per prompt, the `beam_width` best hypotheses,
        best first, each with its prompt + output tokens, their text and its cumulative
        logprob. The best equals transformers' generate(num_beams=..., do_sample=False).
        `lora_request`: as `generate`'s (every beam of a prompt runs its adapter)."""
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm, lora_request)
        results = []
        for out in outputs:
            sequences = []
            for c in out.outputs:
                tokens = [*out.prompt_token_ids, *c.token_ids]
                sequences.append(
                    BeamSearchSequence(
                        tokens=tokens,
                        text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                        cum_logprob=c.cumulative_logprob or 0.0,
                        finish_reason=c.finish_reason,
                    )
                )
            results.append(BeamSearchOutput(sequences))
        return results

    def sleep(self, level: int = 1) -> None:
        """Release memory while idle (vLLM's sleep mode). Level 1 releases the KV pool and
        keeps the weights in host memory (on a GPU they move there; on CPU they are there, so
        only the pool is freed); level 2 releases the weights too, and waking reads the model
        file. The prefix cache starts empty (with KV offload tiers, its blocks are stored to
        them and load back after waking)."""
        refusal = sleep_refusal(self.config, offline=True)
        if refusal is not None:
            raise RuntimeError(refusal)
        if self.engine.has_unfinished_requests():
            raise RuntimeError("sleep needs an idle engine")
        self.engine.sleep(self.executor, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep released: `tags` names the parts ("weights", "kv_cache"; None:
        both), as vLLM's; the LLM generates again once both are back."""
        self.engine.wake_up(self.executor, tags)

    def is_sleeping(self) -> bool:
        return self.engine.asleep

    def reset_prefix_cache(self, tiers: bool = False) -> bool:
        """Forget every cached prefix (vLLM's; pins are released), and with `tiers` the KV
        offload tiers' blocks too (their disk files are deleted). True, as vLLM answers a
        reset that happened (the engine is idle between calls, so none is refused)."""
        _, batches = self.engine.reset_prefix_cache(self.executor, tiers)
        assert not batches, "no step is in flight between calls"
        return True

    # ---- internals -------------------------------------------------------------------------
    def _generate(
        self,
        prompts: list[_Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
        priority: Sequence[int] | None = None,
        pin_prefix_s: float | None = None,
    ) -> list[RequestOutput]:
        """`generate` and `chat`: every prompt checked before any is queued, so a bad one
        leaves nothing half-done; then all run to their ends."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        count = len(prompts)
        params_list = _one_each(
            sampling_params, SamplingParams, count, "sampling_params", "sampling params"
        )
        loras = _one_each(lora_request, LoRARequest, count, "lora_request", "LoRA requests")
        for lora in dict.fromkeys(loras):
            if lora is not None:
                self._check_adapter(lora)
        # As checked: with the digest of its files (the salt of its KV blocks).
        loras = [None if x is None else self._adapters[x.lora_int_id] for x in loras]
        priorities = list(priority) if priority is not None else [0] * count
        if len(priorities) != count:
            raise ParamError(f"Got {len(priorities)} priorities for {count} prompts.", "priority")
        for value in priorities:
            check_priority(value, self.config.scheduler)
        pin = None
        if pin_prefix_s is not None:
            if not 0 < pin_prefix_s <= MAX_PIN_TTL_S:
                raise ParamError(
                    f"pin_prefix_s must be in (0, {MAX_PIN_TTL_S:g}] seconds", "pin_prefix_s"
                )
            pin = CachePin(ttl_s=float(pin_prefix_s))
        trackers = [
            self._make_tracker(p, sp, RequestOptions(lora=lora, priority=int(v), cache_pin=pin))
            for p, sp, lora, v in zip(prompts, params_list, loras, priorities, strict=True)
        ]
        return self._run(trackers, use_tqdm)

    def _check_adapter(self, lora: LoRARequest) -> None:
        """An adapter's files, checked against the model once per (id, path); one id names
        one adapter for the life of this LLM (its prefix-cache entries are keyed by it)."""
        if self.config.lora is None:
            raise ParamError("lora_request needs LLM(..., enable_lora=True)", "lora_request")
        if lora.lora_int_id < 1:
            raise ParamError("lora_int_id must be positive", "lora_request")
        known = self._adapters.get(lora.lora_int_id)
        if known is None:
            read_adapter(lora.lora_path, self.config.arch, self.config.lora.max_lora_rank)
            self._adapters[lora.lora_int_id] = with_digest(lora)
        elif known.identity != lora.identity:
            raise ParamError(
                f"lora_int_id {lora.lora_int_id} already names {known.lora_name!r} at "
                f"{known.lora_path!r}; give each adapter its own id",
                "lora_request",
            )

    def _make_tracker(
        self, prompt: _Prompt, params: SamplingParams, options: RequestOptions = NO_OPTIONS
    ) -> _Tracker:
        """The prompt built and checked by the tokenizer worker's code (ParamError, with the
        server's message, if it cannot run), ready to queue."""
        req = self._tokenize_request(prompt, params, options)
        text, ids = self.request_tokenizer.prompt_of(req)
        request = self.request_tokenizer.check(req, ids)
        request = msgspec.structs.replace(request, req_id=str(next(self._ids)))
        return _Tracker(request, text, self.tokenizer)

    def _tokenize_request(
        self, prompt: _Prompt, params: SamplingParams, options: RequestOptions
    ) -> TokenizeRequest:
        """The request a frontend would send the tokenizer workers for `prompt` (its id is
        given once it passes its checks); its images read and checked (zllm/media/)."""
        media, vision, model = self.config.media, self.config.arch.vision, self.config.model
        if isinstance(prompt, _ChatPrompt):
            messages, images = offline_media.chat_images(prompt.messages, media)
            offline_media.require_vision_for(images, vision, model, "messages")
            return TokenizeRequest(
                "",
                params,
                messages=messages,
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                chat_template_kwargs=prompt.chat_template_kwargs,
                options=options,
                images=images or None,
            )
        if isinstance(prompt, str):
            return TokenizeRequest("", params, prompt=prompt, options=options)
        if not isinstance(prompt, dict) or not ("prompt_token_ids" in prompt or "prompt" in prompt):
            raise TypeError(
                "A prompt must be a string or a dict with 'prompt' or 'prompt_token_ids'."
            )
        # vLLM's prompt dicts carry a `cache_salt` too, and images in `multi_modal_data`.
        check_cache_salt(prompt.get("cache_salt"))
        options = msgspec.structs.replace(options, cache_salt=prompt.get("cache_salt"))
        images = offline_media.prompt_images(prompt, media)
        offline_media.require_vision_for(images, vision, model, "multi_modal_data")
        if "prompt_token_ids" not in prompt:
            return TokenizeRequest(
                "", params, prompt=prompt["prompt"], options=options, images=images or None
            )
        ids = [int(t) for t in prompt["prompt_token_ids"]]
        return TokenizeRequest(
            "",
            params,
            prompt=prompt.get("prompt"),
            prompt_token_ids=ids,
            options=options,
            images=images or None,
        )

    def _run(self, trackers: list[_Tracker], use_tqdm: bool) -> list[RequestOutput]:
        if self.engine.asleep:
            raise RuntimeError("the LLM is asleep: call wake_up() first")
        by_id = {t.req_id: t for t in trackers}
        now = time.time()
        for t in trackers:
            request = msgspec.structs.replace(t.request, arrival_time=now)
            rejected = self.engine.add_request(request)
            assert rejected is None, rejected  # the same checks passed in _make_tracker
        bar = _progress_bar(len(trackers)) if use_tqdm else None
        try:
            # (Steps still in flight when the last request has finished carry only finished
            # requests; they are collected too, so the next call starts with none out.)
            while self.engine.has_unfinished_requests() or self.engine.num_steps_in_flight:
                for delta in self._step():
                    tracker = by_id[delta.req_id]
                    tracker.add(delta)
                    if tracker.finished and bar is not None:
                        bar.update(1)
        except BaseException:
            # Leave the engine clean for the next call (KeyboardInterrupt included).
            self._detokenize(self.engine.abort(list(by_id)))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [t.to_output() for t in trackers]

    def _step(self) -> list[RequestOutputDelta]:
        """One turn of the engine's step loop, run to its output, detokenized."""
        batches = self.engine.step(self.executor)
        if batches is None:
            raise RuntimeError("the scheduler made no progress with requests waiting")
        return self._detokenize(batches)

    def _detokenize(self, batches: dict[int, DetokenizerBatch]) -> list[RequestOutputDelta]:
        deltas: list[RequestOutputDelta] = []
        for batch in batches.values():
            new, stops = self.detokenizer.process(batch)
            deltas += new
            for stop in stops:  # a stop string ended that sample
                self.engine.finish_sample(stop.req_id, stop.sample_index)
        return deltas


class _Tracker:
    """Collects one request's output deltas as they come out of the engine."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Tokenizer):
        self.request = request  # as queued (its options: adapter, priority, pin, salt)
        self.req_id = request.req_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = params = request.sampling_params
        self.tokenizer = tokenizer
        n = params.n
        self.texts = [""] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[PositionLogprobs]] = [[] for _ in range(n)]
        self.cumulative: list[float] = [0.0] * n
        self.finish: list[tuple[str, int | str | None] | None] = [None] * n
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_cached_tokens = 0
        self.embedding: list[float] | None = None
        self.beam_logprobs: list[float | None] = [None] * n

    @property
    def finished(self) -> bool:
        return all(f is not None for f in self.finish)

    def add(self, delta: RequestOutputDelta) -> None:
        i = delta.index
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.embedding is not None:
            self.embedding = delta.embedding
        self.texts[i] += delta.text
        self.token_ids[i].extend(delta.token_ids)
        if delta.logprobs is not None:
            positions = self._convert(delta.logprobs, delta.logprob_tokens)
            self.logprobs[i].extend(positions)
            self.cumulative[i] += sum(next(iter(pos.values())).logprob for pos in positions)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None, *self._convert(delta.prompt_logprobs, None)]
        if delta.cumulative_logprob is not None:  # a beam-search hypothesis' score
            self.beam_logprobs[i] = delta.cumulative_logprob
        if delta.finish_reason is not None:
            self.finish[i] = (str(delta.finish_reason), delta.stop_reason)

    def _convert(
        self, lists: LogprobsLists, texts: list[list[str]] | None
    ) -> list[PositionLogprobs]:
        """Per position: token id -> Logprob, the chosen token first (with its rank), then the
        top-k by rank. `texts` are the tokens' texts when the detokenizer already made them."""
        result = []
        for row, (ids, lps, rank) in enumerate(
            zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True)
        ):
            names = texts[row] if texts is not None else [self._text(t) for t in ids]
            pos: PositionLogprobs = {ids[0]: Logprob(lps[0], rank, names[0])}
            for k in range(1, len(ids)):
                pos.setdefault(ids[k], Logprob(lps[k], k, names[k]))
            result.append(pos)
        return result

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def to_output(self) -> RequestOutput:
        want_lp = self.params.logprobs is not None
        outputs = []
        for i in range(self.params.n):
            reason, stop_reason = self.finish[i] or (None, None)
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=self.texts[i],
                    token_ids=list(self.token_ids[i]),
                    cumulative_logprob=(self.cumulative[i] if want_lp else self.beam_logprobs[i]),
                    logprobs=self.logprobs[i] if want_lp else None,
                    finish_reason=reason,
                    stop_reason=stop_reason,
                )
            )
        return RequestOutput(
            request_id=self.req_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )


def _one_each(given: Any, single: type, count: int, param: str, what: str) -> list[Any]:
    """`given` (the argument `param`) for each of `count` prompts: one (or None) for all, or
    a sequence of one each."""
    if given is None or isinstance(given, single):
        return [given] * count
    values = list(given)
    if len(values) != count:
        raise ParamError(f"Got {len(values)} {what} for {count} prompts.", param)
    return values


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
