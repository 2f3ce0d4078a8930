"""Prefix pinning as requests ask for it: `cache_control`.

    OpenAI routes (an extra body field)    "cache_control": {"type": "ephemeral", "ttl": "5m"}
                                           pins the whole prompt
    Anthropic /v1/messages                 cache_control on system, message or tool blocks
                                           pins the prompt up to the last marked block
    offline                                LLM.generate(..., pin_prefix_s=300)

The core keeps the pinned prefix's KV blocks in the pool for `ttl` after the request
computes them (core/kv/prefix_pins.py `PrefixPins`), within --max-pinned-bytes; a pin asked
for again extends it. `ttl` is "<number><s|m|h>" (Anthropic's "5m" and "1h" among them),
5 minutes by default.
"""

from __future__ import annotations

import re

from zllm.errors import ParamError
from zllm.protocol import CachePin

DEFAULT_PIN_TTL_S = 300.0
MAX_PIN_TTL_S = 24 * 3600.0
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh])\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_ttl(value: object, param: str) -> float:
    """Seconds from "30s", "5m", "1h" (or a number of seconds)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _TTL.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise ParamError(
            f"{param} must be a duration like '5m', '1h' or '30s', got {value!r}", param
        )
    if not 0 < seconds <= MAX_PIN_TTL_S:
        raise ParamError(f"{param} must be between 0 and 24h, got {value!r}", param)
    return seconds


def parse_cache_control(value: object, param: str = "cache_control") -> CachePin:
    """A `cache_control` object -> the pin it asks for (the whole prompt; the caller narrows
    it to a prefix of messages when the API marks one)."""
    if not isinstance(value, dict):
        raise ParamError(f"{param} must be an object like {{'type': 'ephemeral'}}", param)
    if value.get("type") != "ephemeral":
        raise ParamError(f"{param}.type must be 'ephemeral', got {value.get('type')!r}", param)
    unknown = set(value) - {"type", "ttl"}
    if unknown:
        raise ParamError(f"{param} has unknown fields: {', '.join(sorted(unknown))}", param)
    ttl = value.get("ttl")
    return CachePin(ttl_s=DEFAULT_PIN_TTL_S if ttl is None else parse_ttl(ttl, f"{param}.ttl"))
