"""`zllm proxy`'s check at start: the servers it fronts can pass KV blocks to each other.

A decode server refuses blocks whose layout is not its own (executor/kv/transfer.py), and the
layout names the model by its weights fingerprint (zllm/model/fingerprint.py: the weights'
contents, so two models with the same file name and size differ). A pair on other weights
would still answer, every prompt computed twice and every block refused; the proxy refuses
to start instead. It asks each server's GET /v1/models for its model's `kv_transfer` card
(frontend/handlers/server.py: the server's kv_role and weights fingerprint) and starts only
if every --prefill server is a kv_producer, every --decode server a kv_consumer, and all of
them run the same weights (one endpoint, one model). Servers still starting are waited for, up to
--startup-timeout seconds; with API keys on the servers, --api-key is what the proxy asks
with (clients' requests carry their own).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

logger = logging.getLogger("zllm.proxy")

# The kv_role each side of the pair must have.
ROLE_OF_SIDE = {"prefill": "kv_producer", "decode": "kv_consumer"}
_RETRY_S = 1.0


class PairingError(ValueError):
    """The servers cannot be a pair (the message names them), or one could not be asked."""


@dataclass(frozen=True, slots=True)
class ServerModel:
    """What one server's GET /v1/models says of its model."""

    url: str
    side: str  # "prefill" or "decode": the flag that named it
    model: str
    role: str | None  # its kv_role; None: it has no --kv-transfer-config
    weights_fingerprint: str | None

    def __str__(self) -> str:
        return f"{self.side} {self.url} ({self.model}, weights {self.weights_fingerprint})"


def check_servers(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    api_key: str | None = None,
    startup_timeout_s: float = 600.0,
) -> list[ServerModel]:
    """Every server's model, read (waiting for servers still starting) and checked as one
    pairing; PairingError otherwise."""
    deadline = time.monotonic() + startup_timeout_s
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    sides = [("prefill", u) for u in prefill_urls] + [("decode", u) for u in decode_urls]
    with httpx.Client(headers=headers, timeout=10.0) as client:
        servers = [
            read_server_model(client, url.rstrip("/"), side, deadline, startup_timeout_s)
            for side, url in sides
        ]
    check_pairing(servers)
    return servers


def read_server_model(
    client: httpx.Client, url: str, side: str, deadline: float, timeout_s: float
) -> ServerModel:
    """The server's base model card, asked again until `deadline` while it does not answer
    (or answers 5xx: still starting)."""
    waiting = False
    while True:
        try:
            r = client.get(url + "/v1/models")
        except httpx.HTTPError as e:
            why = f"not answering ({type(e).__name__})"
        else:
            if r.status_code == 200:
                return _server_model(url, side, r)
            if r.status_code in (401, 403):
                raise PairingError(
                    f"the {side} server at {url} wants an API key for GET /v1/models: give "
                    "zllm proxy --api-key (what it checks the servers with at start)"
                )
            if r.status_code < 500:
                raise PairingError(
                    f"the {side} server at {url} answered GET /v1/models with {r.status_code}"
                )
            why = f"status {r.status_code}"
        if time.monotonic() >= deadline:
            raise PairingError(
                f"the {side} server at {url} is {why} after --startup-timeout {timeout_s:g} s"
            )
        if not waiting:
            logger.info("waiting for the %s server at %s (%s)", side, url, why)
            waiting = True
        time.sleep(_RETRY_S)


def _server_model(url: str, side: str, r: httpx.Response) -> ServerModel:
    """The first card of a base model (not a LoRA adapter's) in a /v1/models answer."""
    try:
        card = next(c for c in r.json()["data"] if c.get("parent") is None)
        transfer = card.get("kv_transfer") or {}
        return ServerModel(
            url, side, str(card["id"]), transfer.get("role"), transfer.get("weights_fingerprint")
        )
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration):
        raise PairingError(
            f"the {side} server at {url} lists no model in zllm's shape at GET /v1/models "
            "(a zllm server as new as this proxy?)"
        ) from None


def check_pairing(servers: Sequence[ServerModel]) -> None:
    """PairingError unless each server has its side's role and all run the same weights."""
    wrong = [s for s in servers if s.role != ROLE_OF_SIDE[s.side]]
    if wrong:
        raise PairingError(
            "; ".join(
                f"the {s.side} server at {s.url} is "
                + (f"a {s.role}" if s.role else "in no KV transfer (no --kv-transfer-config)")
                + f", not a {ROLE_OF_SIDE[s.side]}"
                for s in wrong
            )
        )
    if len({s.weights_fingerprint for s in servers}) > 1:
        raise PairingError(
            "the servers run different weights, so no KV block can pass between them (a decode "
            "server refuses blocks of other weights, whatever the files' names and sizes): "
            + ", ".join(map(str, servers))
        )
