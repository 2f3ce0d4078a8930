"""Who a request is for: its tenant, and how much of the engine each tenant is owed.

    API keys set (--api-key K1 --api-key K2)   the key's tenant: "key-1", "key-2" (the key's
                                               position; the key itself is a secret and never
                                               becomes a name or a metrics label)
    otherwise, an `X-Tenant: <name>` header    that name
    otherwise                                  "default"

`--scheduling-policy fair` shares the engine between tenants in proportion to their weights
(`--tenant-weights key-1=3,alice=2`; 1 for a tenant not listed): core/fair_share.py. Under
every policy the core counts each tenant's requests and tokens for /metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import re

from zllm.errors import ParamError

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-tenant"
MAX_TENANT_CHARS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.:@-]+$")


def api_key_tenant(key_index: int) -> str:
    """The tenant of the API key at `key_index` (0-based) in the --api-key list."""
    return f"key-{key_index + 1}"


def check_tenant_name(name: str, param: str = "X-Tenant") -> str:
    """A tenant name as a header or --tenant-weights gives it: 1-64 characters of letters,
    digits and `_ . : @ -` (it becomes a metrics label)."""
    if not 0 < len(name) <= MAX_TENANT_CHARS or not _NAME.match(name):
        raise ParamError(
            f"{param} must be 1-{MAX_TENANT_CHARS} characters of letters, digits and "
            f"'_.:@-', got {name[: MAX_TENANT_CHARS + 8]!r}",
            param,
        )
    return name


def check_tenant_weights(weights: dict[str, float]) -> dict[str, float]:
    """Names checked, weights positive and finite (float)."""
    checked = {}
    for name, weight in weights.items():
        check_tenant_name(str(name), "tenant_weights")
        try:
            value = float(weight)
        except (TypeError, ValueError):
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise ParamError(
                f"tenant_weights: the weight of {name!r} must be a positive number, got {weight!r}",
                "tenant_weights",
            )
        checked[str(name)] = value
    return checked


def parse_tenant_weights(text: str) -> dict[str, float]:
    """`--tenant-weights`: `name=weight,...` or a JSON object."""
    text = text.strip()
    try:
        if text.startswith("{"):
            weights = json.loads(text)
            if not isinstance(weights, dict):
                raise ValueError
        else:
            weights = {}
            for item in filter(None, (part.strip() for part in text.split(","))):
                name, sep, value = item.partition("=")
                if not sep:
                    raise ValueError
                weights[name.strip()] = value.strip()
        return check_tenant_weights(weights)
    except (ValueError, ParamError) as e:
        detail = f": {e}" if isinstance(e, ParamError) else ""
        raise argparse.ArgumentTypeError(
            f"expected name=weight pairs separated by commas (key-1=3,alice=1.5) or a JSON "
            f"object, got {text!r}{detail}"
        ) from None
