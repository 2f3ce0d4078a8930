"""The engine's control routes: LoRA adapters loaded and unloaded at run time, sleep mode
(POST /sleep, /wake_up; GET /is_sleeping) and POST /reset_prefix_cache, as vLLM names them.
Each checks its query or body here and asks the engine client; the cores apply it."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from zllm.config.engine import sleep_refusal
from zllm.config.serve import ServeConfig
from zllm.errors import RequestError
from zllm.frontend.lora_adapters import LoRAAdapters
from zllm.frontend.openai.protocol import LoadLoRAAdapterBody, UnloadLoRAAdapterBody
from zllm.frontend.replies import json_response
from zllm.kv.tiers import TIER_NAMES, TIER_REMOTE
from zllm.protocol import SLEEP_TAGS
from zllm.runtime.engine_client import EngineClient

logger = logging.getLogger(__name__)


class ControlRoutes:
    """The handlers of the routes that change what the engine holds rather than generate."""

    def __init__(self, config: ServeConfig, client: EngineClient, adapters: LoRAAdapters) -> None:
        self.config = config
        self.client = client
        self.adapters = adapters

    # ---- LoRA adapters ---------------------------------------------------------------------
    async def load_lora_adapter(self, request: Request, body: LoadLoRAAdapterBody) -> Response:
        lora = await self.adapters.load(body.lora_name, body.lora_path)
        logger.info(
            "LoRA adapter %s (id %d) loaded from %s",
            lora.lora_name,
            lora.lora_int_id,
            lora.lora_path,
        )
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request, body: UnloadLoRAAdapterBody) -> Response:
        lora = self.adapters.unload(body.lora_name)
        logger.info("LoRA adapter %s (id %d) unloaded", lora.lora_name, lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    # ---- sleep mode ------------------------------------------------------------------------
    async def sleep(self, request: Request) -> Response:
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            raise RequestError("level must be 1 or 2", param="level") from None
        if level not in (1, 2):
            raise RequestError("level must be 1 or 2", param="level")
        return await self._sleep_control("sleep", level)

    async def wake_up(self, request: Request) -> Response:
        tags = request.query_params.getlist("tags")  # vLLM's: ?tags=weights&tags=kv_cache
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise RequestError(f"unknown tags {unknown}: use {list(SLEEP_TAGS)}", param="tags")
        return await self._sleep_control("wake_up", 1, tuple(tags))

    async def _sleep_control(
        self, command: str, level: int, tags: tuple[str, ...] = ()
    ) -> Response:
        refusal = sleep_refusal(self.config.engine)
        if refusal is not None:
            raise RequestError(refusal)
        reply = await self.client.sleep_control(command, level, tags)
        if not reply.ok:
            raise RequestError(reply.message, 400)
        return Response(status_code=200)

    async def is_sleeping(self, request: Request) -> Response:
        return json_response({"is_sleeping": self.client.is_sleeping})

    # ---- prefix cache ----------------------------------------------------------------------
    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's route, answered with what was dropped: every engine forgets the cached
        blocks no running request holds (pins released); `?tiers=1` (or vLLM's
        `?reset_external=true`) empties the cpu and disk KV tiers too."""
        tiers = _query_flag(request, "tiers") or _query_flag(request, "reset_external")
        reset = await self.client.reset_prefix_cache(tiers)
        dropped = reset.tier_blocks_dropped
        return json_response(
            {
                "reset": True,
                "blocks_dropped": reset.blocks_dropped,
                "tier_blocks_dropped": {
                    name: dropped[tier] if tier < len(dropped) else 0
                    for tier, name in enumerate(TIER_NAMES)
                    if tier != TIER_REMOTE
                },
            }
        )


def _query_flag(request: Request, name: str) -> bool:
    """A boolean query parameter: 1/true/yes or 0/false/no (absent: false); else a 400."""
    value = request.query_params.get(name, "0").strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no", ""):
        return False
    raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
