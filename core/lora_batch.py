"""--max-loras in the scheduler: at most that many distinct LoRA adapters in one step. A
waiting request whose adapter would be one more is passed over (as vLLM does: the requests
behind it of adapters already running go ahead)."""

from __future__ import annotations

from collections.abc import Iterable

from zllm.core.request import Request


def running_adapters(running: Iterable[Request]) -> set[int]:
    return {r.lora.lora_int_id for r in running if r.lora is not None}


def adapter_fits(req: Request, adapters: set[int], max_loras: int) -> bool:
    """Whether `req` can join a batch running `adapters` without more than `max_loras`."""
    if req.lora is None or req.lora.lora_int_id in adapters:
        return True
    return len(adapters) < max_loras


def adapter_names(reqs: Iterable[Request]) -> list[str]:
    """The adapters' names, each once, in first-seen order (vllm:lora_requests_info)."""
    return list({r.lora.lora_name: None for r in reqs if r.lora is not None})
