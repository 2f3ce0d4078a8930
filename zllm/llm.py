"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM.

Runs the engine core and the executor in this process; thousands of prompts stream through
continuous batching (requests join and leave the batch every step), not padded batches.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from zllm.core.engine_core import EngineCore
from zllm.detokenizer_proc.incremental import IncrementalDetokenizer
from zllm.engine_args import EngineArgs
from zllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from zllm.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from zllm.sampling_params import SamplingParams
from zllm.tokenizer_proc.tokenizer import Tokenizer, load_tokenizer

PromptType = str | dict[str, Any]


class LLM:
    """An LLM engine in this process.

    `model`: a short name (`smollm2`, the default), a `.gguf` file, or a Hugging Face-layout
    directory (config.json + *.safetensors + tokenizer.json). Other keywords follow vLLM's
    engine arguments (`max_model_len`, `max_num_seqs`, `max_num_batched_tokens`,
    `block_size`, `kv_cache_memory_bytes`, `enable_prefix_caching`, `seed`, `dtype`, ...).
    """

    def __init__(self, model: str | None = None, *, chat_template: str | None = None, **kwargs):
        args = EngineArgs(model=model, **kwargs)
        self.config = args.create_engine_config()
        self.tokenizer: Tokenizer = load_tokenizer(self.config.model_path, chat_template)
        from zllm.executor.model_runner import ModelRunner  # torch lives behind this import

        self.model_runner = ModelRunner(self.config)
        self.engine = EngineCore(self.config, self.model_runner)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # ---- public API ------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} sampling params for {len(prompts)} prompts."
                )
        # Check every prompt before queueing any, so a bad one leaves nothing half-done.
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
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
        return self.generate(token_prompts, sampling_params, use_tqdm)

    # ---- internals -------------------------------------------------------------------------
    def _make_request(self, prompt: PromptType, params: SamplingParams) -> _Tracker:
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
        if not token_ids:
            raise ValueError("The prompt is empty; it must contain at least one token.")
        vocab = self.config.arch.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary range [0, {vocab}).")
        max_len = self.engine.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt has {len(token_ids)} tokens, leaving no room for output."
            )
        req_id = str(next(self._ids))
        return _Tracker(req_id, text, token_ids, params, self.tokenizer)

    def _run(self, trackers: list[_Tracker], use_tqdm: bool) -> list[RequestOutput]:
        by_id = {t.req_id: t for t in trackers}
        eos = self.tokenizer.eos_token_id
        for t in trackers:
            self.engine.add_request(
                EngineCoreRequest(
                    req_id=t.req_id,
                    prompt_token_ids=t.prompt_token_ids,
                    sampling_params=t.params,
                    arrival_time=time.time(),
                    eos_token_id=eos,
                )
            )
        bar = _progress_bar(len(trackers)) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    tracker = by_id.get(out.req_id)
                    if tracker is None:
                        continue
                    stop_str = tracker.add(out)
                    if stop_str is not None:
                        self.engine.finish_sequence(out.req_id, out.sample_index, FinishReason.STOP)
                    if tracker.finished and bar is not None:
                        bar.update(1)
        except BaseException:
            # Leave the engine clean for the next call (KeyboardInterrupt included).
            self.engine.abort_requests(list(by_id))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [t.to_output() for t in trackers]


class _Tracker:
    """Collects one request's outputs as they come out of the engine."""

    def __init__(self, req_id, prompt, prompt_token_ids, params: SamplingParams, tokenizer):
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.token_ids: list[list[int]] = [[] for _ in range(params.n)]
        self.logprobs: list[list[PositionLogprobs]] = [[] for _ in range(params.n)]
        self.cumulative: list[float] = [0.0] * params.n
        self.finish: list[tuple[str, int | str | None] | None] = [None] * params.n
        self.detok = [
            IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
            for _ in range(params.n)
        ]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(f is not None for f in self.finish)

    def add(self, out: EngineCoreOutput) -> str | None:
        """Take one output; returns a stop string if one ended this sample."""
        i = out.sample_index
        if self.finish[i] is not None:
            return None  # a token computed after a stop string: drop it
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.num_cached_tokens = out.num_cached_tokens
        self.token_ids[i].extend(out.new_token_ids)
        if out.new_logprobs is not None:
            positions = self._convert(out.new_logprobs)
            self.logprobs[i].extend(positions)
            self.cumulative[i] += sum(
                lp.logprob for pos in positions for lp in list(pos.values())[:1]
            )
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None, *self._convert(out.new_prompt_logprobs)]
        stop_str = self.detok[i].update(out.new_token_ids)
        if stop_str is not None:
            self.finish[i] = ("stop", stop_str)
            return stop_str
        if out.finish_reason is not None:
            self.finish[i] = (str(out.finish_reason), out.stop_reason)
        return None

    def _convert(self, lists: LogprobsLists) -> list[PositionLogprobs]:
        decode = self.tokenizer.decode
        result = []
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=False):
            pos: PositionLogprobs = {
                ids[0]: Logprob(lps[0], rank, decode([ids[0]], skip_special_tokens=False))
            }
            for k, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=False), start=1):
                pos.setdefault(tid, Logprob(lp, k, decode([tid], skip_special_tokens=False)))
            result.append(pos)
        return result

    def to_output(self) -> RequestOutput:
        outputs = []
        for i in range(self.params.n):
            reason, stop_reason = self.finish[i] or (None, None)
            want_lp = self.params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=self.detok[i].output_text,
                    token_ids=list(self.token_ids[i]),
                    cumulative_logprob=self.cumulative[i] if want_lp else None,
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
