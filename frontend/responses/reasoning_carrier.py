"""`include: ["reasoning.encrypted_content"]`: a reasoning item's text sealed for the client
to carry, so that a stateless server (`store: false`, as Codex CLI always sends) reads the
model's reasoning back when the item returns as input in the next turn.

The text is sealed with AES-256-GCM (the `cryptography` package: authenticated encryption,
so the client can neither read nor alter it) under a key derived from the server's thinking
signature key (frontend/anthropic/thinking.py `ThinkingSigner`: --thinking-signature-key-file,
or $ZLLM_CACHE's, made at first use). Servers that share that key file read each other's
items; a server with another key refuses them with a 400 naming the item.

    encrypted_content = "zllm1." + urlsafe-base64(nonce (12 bytes) + ciphertext + tag)
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from zllm.errors import RequestError
from zllm.frontend.anthropic.thinking import ThinkingSigner

PREFIX = "zllm1."
_NONCE_BYTES = 12
# What the sealed text is, bound into the tag: an item sealed for one purpose opens for no other.
_ASSOCIATED = b"zllm responses reasoning"


class ReasoningCarrier:
    """Seals reasoning text into `encrypted_content`, and opens what clients send back."""

    def __init__(self, signer: ThinkingSigner) -> None:
        self._signer = signer
        self._aead: AESGCM | None = None

    def _cipher(self) -> AESGCM:
        if self._aead is None:  # its own key, derived: the signing key signs, this one seals
            key = hmac.new(self._signer.key(), b"reasoning.encrypted_content", hashlib.sha256)
            self._aead = AESGCM(key.digest())
        return self._aead

    def seal(self, text: str) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._cipher().encrypt(nonce, text.encode(), _ASSOCIATED)
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode()

    def open(self, token: str, param: str) -> str:
        """The text `token` seals; a 400 naming `param` if this server did not seal it."""
        try:
            if not token.startswith(PREFIX):
                raise ValueError("not this server's format")
            raw = base64.urlsafe_b64decode(token[len(PREFIX) :].encode())
            nonce, sealed = raw[:_NONCE_BYTES], raw[_NONCE_BYTES:]
            return self._cipher().decrypt(nonce, sealed, _ASSOCIATED).decode()
        except (ValueError, InvalidTag):
            raise RequestError(
                f"{param}: this server cannot read this encrypted_content (it was not sealed "
                "by a server with this server's thinking signature key, or it was altered).",
                param=param,
            ) from None
