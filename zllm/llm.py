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
from typing import Any

from zllm.config.engine import check_cache_salt, check_priority
from zllm.config.engine_args import EngineArgs
from zllm.config.generation import merge_eos_token_ids
from zllm.core.engine_core import EngineCore
from zllm.detokenizer_proc.detokenizer import Detokenizer
from zllm.errors import ParamError
from zllm.inputs import check_prompt, check_token_params, truncate_prompt
from zllm.kv.cache_control import MAX_PIN_TTL_S
from zllm.lora import LoRARequest, read_adapter, with_digest
from zllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)
from zllm.protocol import (
    CachePin,
    DetokenizerBatch,
    EngineCoreRequest,
    LogprobsLists,
    RequestOptions,
    RequestOutputDelta,
)
from zllm.sampling_params import BeamSearchParams, SamplingParams
from zllm.text.bad_words import with_bad_words_ids
from zllm.text.structured_outputs import check_structured_outputs
from zllm.text.template_kwargs import merge_template_kwargs
from zllm.text.tokenizer import Tokenizer, load_tokenizer

PromptType = str | dict[str, Any]


class LLM:
    """An LLM engine in this process.

    `model`: a short name (`smollm2`, the default), a `.gguf` file, or a Hugging Face-layout
    directory (config.json + *.safetensors + tokenizer.json). Other keywords follow vLLM's
    engine arguments (`max_model_len`, `max_num_seqs`, `max_num_batched_tokens`,
    `block_size`, `kv_cache_memory_bytes`, `enable_prefix_caching`, `seed`, `dtype`,
    `generation_config`, `speculative_config`, ...).
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
        self.tokenizer: Tokenizer = load_tokenizer(self.config.model_path, chat_template)
        # What the tokenizer worker adds to a served request: the ids that end generation.
        self.eos_token_ids = merge_eos_token_ids(
            [self.tokenizer.eos_token_id], self.config.arch.eos_token_ids
        )
        from zllm.executor.offline import start_offline_executor  # torch lives behind this

        # With N ranks (tensor x pipeline parallel): rank 0 here, ranks 1..N-1 in processes
        # it feeds (stopped when this LLM is collected, or at exit).
        self.executor = start_offline_executor(self.config)
        self.engine = EngineCore(self.config)
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
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ParamError(
                    f"Got {len(params_list)} sampling params for {len(prompts)} prompts.",
                    "sampling_params",
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ParamError(
                    f"Got {len(loras)} LoRA requests for {len(prompts)} prompts.", "lora_request"
                )
        for lora in dict.fromkeys(loras):
            if lora is not None:
                self._check_adapter(lora)
        # As checked: with the digest of its files (the salt of its KV blocks).
        loras = [None if x is None else self._adapters[x.lora_int_id] for x in loras]
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ParamError(
                f"Got {len(priorities)} priorities for {len(prompts)} prompts.", "priority"
            )
        for value in priorities:
            check_priority(value, self.config.scheduler)
        # Check every prompt before queueing any, so a bad one leaves nothing half-done.
        trackers = [
            self._make_tracker(p, sp, lora)
            for p, sp, lora in zip(prompts, params_list, loras, strict=True)
        ]
        for tracker, value in zip(trackers, priorities, strict=True):
            tracker.priority = int(value)
        if pin_prefix_s is not None:
            if not 0 < pin_prefix_s <= MAX_PIN_TTL_S:
                raise ParamError(
                    f"pin_prefix_s must be in (0, {MAX_PIN_TTL_S:g}] seconds", "pin_prefix_s"
                )
            for tracker in trackers:
                tracker.cache_pin = CachePin(ttl_s=float(pin_prefix_s))
        return self._run(trackers, use_tqdm)

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
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = merge_template_kwargs(None, chat_template_kwargs)
        prompts = [
            self.tokenizer.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
            for conv in conversations  # type: ignore[union-attr]
        ]
        # The template already holds the special tokens: don't add a second BOS.
        token_prompts = [
            {
                "prompt": text,
                "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
            }
            for text in prompts
        ]
        return self.generate(token_prompts, sampling_params, use_tqdm, lora_request)

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

    def embed(
        self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt: its final hidden states pooled (`pooling`, mean by default)
        and L2-normalized, as `/v1/embeddings` returns them."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = SamplingParams(max_tokens=1, temperature=0.0, embed=True)
        trackers = [self._make_tracker(p, params) for p in prompts]
        self._run(trackers, use_tqdm)
        return [
            EmbeddingRequestOutput(
                t.req_id, list(t.prompt_token_ids), EmbeddingOutput(t.embedding or [])
            )
            for t in trackers
        ]

    def sleep(self, level: int = 1) -> None:
        """Release memory while idle (vLLM's sleep mode). Level 1 releases the KV pool and
        keeps the weights in host memory (on a GPU they move there; on CPU they are there, so
        only the pool is freed); level 2 releases the weights too, and waking reads the model
        file. The prefix cache starts empty (with KV offload tiers, its blocks are stored to
        them and load back after waking)."""
        if not self.config.enable_sleep_mode:
            raise RuntimeError("sleep needs LLM(..., enable_sleep_mode=True)")
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
        self, prompt: PromptType, params: SamplingParams, lora: LoRARequest | None = None
    ) -> _Tracker:
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            token_ids = [int(t) for t in prompt["prompt_token_ids"]]
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            token_ids = self.tokenizer.encode(text)
        else:
            raise TypeError(
                "A prompt must be a string or a dict with 'prompt' or 'prompt_token_ids'."
            )
        params = with_bad_words_ids(params, self.tokenizer)
        token_ids = truncate_prompt(
            token_ids, params.truncate_prompt_tokens, self.engine.max_model_len
        )
        check_prompt(
            token_ids,
            max_tokens=params.max_tokens,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.config.arch.vocab_size,
        )
        check_token_params(params, self.config.arch.vocab_size)
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
        tracker = _Tracker(str(next(self._ids)), text, token_ids, params, self.tokenizer)
        tracker.lora = lora
        if isinstance(prompt, dict):  # vLLM's prompt dicts carry a `cache_salt` too
            tracker.cache_salt = prompt.get("cache_salt")
            check_cache_salt(tracker.cache_salt)
        return tracker

    def _run(self, trackers: list[_Tracker], use_tqdm: bool) -> list[RequestOutput]:
        if self.engine.asleep:
            raise RuntimeError("the LLM is asleep: call wake_up() first")
        by_id = {t.req_id: t for t in trackers}
        eos = self.eos_token_ids
        now = time.time()
        for t in trackers:
            request = EngineCoreRequest(
                t.req_id,
                t.prompt_token_ids,
                t.params,
                now,
                eos,
                options=RequestOptions(
                    lora=t.lora, priority=t.priority, cache_pin=t.cache_pin, cache_salt=t.cache_salt
                ),
            )
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

    def __init__(self, req_id, prompt, prompt_token_ids, params: SamplingParams, tokenizer):
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
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
        self.lora: LoRARequest | None = None
        self.priority = 0
        self.cache_pin: CachePin | None = None
        self.cache_salt: str | None = None

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


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
