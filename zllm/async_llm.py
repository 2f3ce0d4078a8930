"""Embed zllm in an asyncio application, without HTTP.

    llm = await AsyncLLM.start("smollm2")
    async for delta in llm.generate("Hello", SamplingParams(max_tokens=16)):
        print(delta.text, end="")
    await llm.shutdown()

The engine processes (tokenizers, core, executor, detokenizers) run in the background under
a supervisor thread, exactly as under `zllm serve`; this object plays the frontend's part
with the same `EngineClient` the HTTP server uses.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator

from zllm.config.engine_args import EngineArgs
from zllm.config.serve import ServeConfig, ServerArgs
from zllm.errors import RequestError
from zllm.media import offline as offline_media
from zllm.protocol import DEFAULT_TENANT, RequestOptions, RequestOutputDelta, TokenizeRequest
from zllm.runtime.engine_client import EngineClient
from zllm.runtime.launch import serve_config_from
from zllm.runtime.supervisor import Supervisor
from zllm.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "RequestError"]


class AsyncLLM:
    def __init__(self, client: EngineClient, supervisor: Supervisor) -> None:
        self.client = client
        self._supervisor = supervisor
        self._watcher: threading.Thread | None = None

    @classmethod
    async def start(
        cls,
        model: str | None = None,
        *,
        tokenizer_workers: int = 1,
        detokenizer_workers: int = 1,
        **engine_kwargs,
    ) -> AsyncLLM:
        engine = EngineArgs(model=model, **engine_kwargs).create_engine_config()
        server = ServerArgs(
            tokenizer_workers=tokenizer_workers, detokenizer_workers=detokenizer_workers
        )
        return await cls.start_with(serve_config_from(engine, server))

    @classmethod
    async def start_with(cls, config: ServeConfig) -> AsyncLLM:
        """The engine processes of `config` (what `zllm serve` would run, less the HTTP
        frontend), e.g. for `zllm run-batch`, which answers through the frontend's app."""
        client = EngineClient(config)
        await client.start()  # bind first: the workers connect to us
        supervisor = Supervisor(config, with_frontend=False)
        await asyncio.to_thread(supervisor.start)
        client.mark_ready()
        llm = cls(client, supervisor)
        llm._watcher = threading.Thread(target=supervisor.run, name="zllm-supervisor", daemon=True)
        llm._watcher.start()
        return llm

    async def generate(
        self,
        prompt: str | list[int] | list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> AsyncIterator[RequestOutputDelta]:
        """Yield output deltas (text and token ids per sample) until the request finishes.

        `prompt`: text, token ids, or chat messages (the model's chat template is applied).
        `request_id`: any string unique among this client's requests in flight (default: a
        random one). `tenant`: whom it is for (fair share, per-tenant metrics; see
        zllm/config/tenants.py). Raises RequestError when the engine refuses or loses the request.
        """
        req = TokenizeRequest(
            req_id=request_id or uuid.uuid4().hex,
            sampling_params=sampling_params or SamplingParams(),
            arrival_time=time.time(),
            options=RequestOptions(tenant=tenant),
        )
        if isinstance(prompt, str):
            req.prompt = prompt
        elif prompt and isinstance(prompt[0], dict):
            engine = self._supervisor.config.engine  # images as LLM.chat takes them
            messages, images = offline_media.chat_images(prompt, engine.media)  # type: ignore[arg-type]
            offline_media.require_vision_for(images, engine.arch.vision, engine.model, "messages")
            req.messages, req.images = messages, images or None
        else:
            req.prompt_token_ids = list(prompt)  # type: ignore[arg-type]
        async for delta in self.client.generate(req):
            yield delta

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    async def shutdown(self) -> None:
        self._supervisor.request_stop()
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.join, 60)
        await self.client.close()
