"""The LoRA adapters this server serves, by the model name requests use for them.

Adapters come from `--lora-modules` at start and from POST /v1/load_lora_adapter at run
time, and go with /v1/unload_lora_adapter. Loading checks the adapter against the base
model (zllm.lora.read_adapter: config, tensor names, shapes, rank, file integrity) before
it is registered, so a bad adapter is a 400 that changes nothing. A registered adapter gets
an id never used before in this server's life: its prefix-cache entries and its weights in
the executor are keyed by it, so an adapter reloaded under the same name from other files
shares nothing with its predecessor.

Unloading stops new requests from naming the adapter; requests already running with it
finish (they carry its LoRARequest, and the executor keeps its weights while they live).

The registry is written to the supervisor's run directory after every change, so a frontend
that crashed and was restarted serves the same adapters under the same ids.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from zllm.config.engine import EngineConfig
from zllm.errors import RequestError
from zllm.lora import LoRAError, LoRARequest, adapter_digest, read_adapter, with_digest

logger = logging.getLogger(__name__)

LORA_STATE_FILE = "lora_adapters.json"
# Adapters registered at once, at most: the registry (and the JSON file rewritten on every
# change) cannot grow without bound through POST /v1/load_lora_adapter (issue 56).
MAX_REGISTERED_ADAPTERS = 1024


class LoRAAdapters:
    def __init__(
        self,
        engine: EngineConfig,
        base_names: list[str],
        start: list[LoRARequest],
        state_file: str | None = None,
    ):
        """`start`: --lora-modules; `state_file`: where the registry outlives this process."""
        self.engine = engine
        self.base_names = base_names
        self.state_file = state_file
        self.by_name: dict[str, LoRARequest] = {lora.lora_name: lora for lora in start}
        self._next_id = max((lora.lora_int_id for lora in start), default=0) + 1
        self._restore()

    def _restore(self) -> None:
        """After a restart: the adapters the previous frontend served, with their ids."""
        if self.state_file is None or not os.path.exists(self.state_file):
            return
        with open(self.state_file, encoding="utf-8") as f:
            saved = [_with_digest_if_readable(LoRARequest(*entry)) for entry in json.load(f)]
        self.by_name = {lora.lora_name: lora for lora in saved}
        self._next_id = max(self._next_id, *(lora.lora_int_id + 1 for lora in saved), 1)
        logger.info("LoRA adapters restored: %s", ", ".join(self.by_name) or "none")

    def _save(self) -> None:
        if self.state_file is None:
            return
        entries = [[x.lora_name, x.lora_int_id, x.lora_path] for x in self.by_name.values()]
        tmp = self.state_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(entries, f)
        os.replace(tmp, self.state_file)

    @property
    def enabled(self) -> bool:
        return self.engine.lora is not None

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The model name a request answers with, and the adapter it names (if any); an
        unknown name is a 404 that lists the served ones."""
        if requested is None or requested in self.base_names:
            return requested or self.base_names[0], None
        lora = self.by_name.get(requested)
        if lora is not None:
            return requested, lora
        served = [*self.base_names, *self.by_name]
        raise RequestError(
            f"The model `{requested}` does not exist. Served models: {', '.join(served)}.",
            status=404,
            param="model",
            code="model_not_found",
        )

    async def load(self, name: str, path: str) -> LoRARequest:
        """Check and register an adapter; RequestError (400) says why not."""
        if self.engine.lora is None:
            raise RequestError("LoRA adapters are not enabled (start with --enable-lora).")
        if not name:
            raise RequestError("lora_name must not be empty.", param="lora_name")
        if name in self.by_name or name in self.base_names:
            raise RequestError(
                f"The model name {name!r} is already served; unload it first.", param="lora_name"
            )
        self._check_room()
        path = os.path.abspath(path)
        try:
            # Reads a JSON config and a safetensors header, then hashes the files (the
            # digest its KV blocks are salted with): off the event loop.
            await asyncio.to_thread(
                read_adapter, path, self.engine.arch, self.engine.lora.max_lora_rank
            )
            digest = await asyncio.to_thread(adapter_digest, path)
        except LoRAError as e:
            raise RequestError(str(e), param=e.param or "lora_path") from None
        except OSError as e:
            raise RequestError(f"LoRA adapter {path!r}: {e}", param="lora_path") from None
        if name in self.by_name:  # another load of this name won the race while we read
            raise RequestError(f"The model name {name!r} is already served.", param="lora_name")
        self._check_room()  # (others may have filled it while we read)
        lora = LoRARequest(name, self._next_id, path, digest)
        self._next_id += 1
        self.by_name[name] = lora
        self._save()
        return lora

    def _check_room(self) -> None:
        if len(self.by_name) >= MAX_REGISTERED_ADAPTERS:
            raise RequestError(
                f"{len(self.by_name)} LoRA adapters are registered, the most this server "
                "keeps; unload one first (/v1/unload_lora_adapter).",
                param="lora_name",
            )

    def unload(self, name: str) -> LoRARequest:
        if self.engine.lora is None:
            raise RequestError("LoRA adapters are not enabled (start with --enable-lora).")
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise RequestError(
                f"The LoRA adapter {name!r} is not loaded.",
                status=404,
                param="lora_name",
                code="model_not_found",
            )
        self._save()
        return lora


def _with_digest_if_readable(lora: LoRARequest) -> LoRARequest:
    """A restored adapter with its files' digest; one whose files are gone keeps none (its
    requests then fail in the executor, as before the restart they would have)."""
    try:
        return with_digest(lora)
    except OSError:
        logger.warning("LoRA adapter %s: %s is not readable", lora.lora_name, lora.lora_path)
        return lora
