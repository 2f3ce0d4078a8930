"""The engine core: the scheduler and block manager driving an executor step by step.

The executor is anything with `execute_model(SchedulerOutput) -> ModelRunnerOutput`: the
in-process `ModelRunner` for the offline `LLM`, or a client of the executor process when
serving. This module never imports torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from zllm.config import EngineConfig
from zllm.core.block_manager import BlockManager
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_blocks: int
    num_free_blocks: int
    # Allocated-but-unused KV slots over all steps so far, as a share of allocated slots.
    kv_waste_fraction: float


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        assert config.cache.num_blocks, "the executor sizes the KV pool before the core starts"
        self.config = config
        self.executor = executor
        self.block_manager = BlockManager(
            config.cache.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self._allocated_slots = 0
        self._used_slots = 0

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                req_id=request.req_id,
                prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time or time.time(),
            )
        )

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        return self.scheduler.abort_requests(req_ids)

    def finish_sequence(self, req_id: str, sample_index: int, reason: FinishReason) -> bool:
        return self.scheduler.finish_sequence(req_id, sample_index, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute and collect one step."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        allocated, used = self.scheduler.kv_slot_usage()
        self._allocated_slots += allocated
        self._used_slots += used
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=bm.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_waste_fraction=1.0 - self._used_slots / max(1, self._allocated_slots),
        )
