"""Real scheduler parts at fake sizes (4-token blocks, no model), for the core's tests:
requests of counted tokens, and a scheduler that produces or consumes KV transfers."""

from __future__ import annotations

from zllm.config.engine import SchedulerConfig
from zllm.config.kv_transfer import KVTransferConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.kv.connector import TieredKVConnector
from zllm.core.request import Request
from zllm.core.scheduler import Scheduler
from zllm.protocol import KVTransferParams
from zllm.sampling_params import SamplingParams

BS = 4  # tokens a block holds


def make_request(req_id: str, prompt_len: int, max_tokens=8, start=0, **params) -> Request:
    """A request of the prompt start, start + 1, ... (`prompt_len` tokens)."""
    return Request(
        req_id=req_id,
        prompt_token_ids=list(range(start, start + prompt_len)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
    )


def disagg_scheduler(
    role: str, wait_timeout_s: float = 60.0, budget: int = 64
) -> tuple[Scheduler, TieredKVConnector | None]:
    """A scheduler of a kv_producer or kv_consumer (64 blocks; a consumer's remote index
    holds 64), and the consumer's connector."""
    transfer = KVTransferConfig(role=role, buffer_bytes=64, wait_timeout_s=wait_timeout_s)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256)
    bm = BlockManager(64, BS, record_evictions=True)
    kv = TieredKVConnector(None, block_bytes=1, remote_bytes=64) if transfer.consumes else None
    return Scheduler(config, bm, kv_connector=kv, kv_transfer=transfer), kv


def transfer_request(req_id: str, tokens: list[int], **flags) -> Request:
    """A one-token request marked for a transfer (`flags`: KVTransferParams' fields)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    return Request(req_id, tokens, params, kv_transfer=KVTransferParams(**flags))
